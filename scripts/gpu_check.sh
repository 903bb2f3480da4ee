#!/usr/bin/env bash
# The GPU check, one prepared script (each step time-capped; about 5 minutes on one GPU expected): the engine on CUDA, trainer steps in
# bfloat16 on a real architecture (random weights from its config: no model hub needed), and a
# live swap, each printing its numbers beside the same run's baseline. Figures go to $OUT (or
# ./gpu-check/) as JSON and text, for docs/scale.md.
#
#   bash scripts/gpu_check.sh                  # on a CUDA machine, with its own PyTorch
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # the same steps, tiny, on a CPU (checks the script)
#
# It uses the Python in $PYTHON (default: .venv/bin/python if present, else python3), which must
# have torch (CUDA build) and this project's dependencies; it installs this package without deps.
# Set CLAWR1_TRL_PYTHON to a Python with TRL to add TRL's GRPO step to the trainer table.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DATA=$(mktemp -d /tmp/clawr1-gpu-check.XXXXXX)
failed=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep its output, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    if ! timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1; then
        failed+=("$name")
        echo "   FAILED (exit $?), last lines:"
    fi
    tail -n 25 "$OUT/$name.txt"
}

step environment 60 "$PYTHON" -c "
import torch, platform
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
assert '$DEVICE' == 'cpu' or torch.cuda.is_available(), 'no CUDA device visible to this torch'"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt"
"$PYTHON" -c "import clawr1" 2>/dev/null || "$PYTHON" -m pip install -q --no-deps -e . >"$OUT/install.txt" 2>&1

CLAWR1=("$PYTHON" -m clawr1.cli.main)
if [ "$QUICK" = 1 ]; then
    ENGINE_TOKENS=8; SHAPE=smollm2-135m; SAMPLES=2; REPLY=32; MB=2; BIG=""
else
    ENGINE_TOKENS=128; SHAPE=qwen2.5-1.5b; SAMPLES=8; REPLY=1024; MB=8,4; BIG=llama-3.1-8b
fi
DTYPE=$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)

# 1. The engine on the device: sequential HF generate vs our batched engine, same run.
step engine 120 "${CLAWR1[@]}" bench engine --data-dir "$DATA" --max-tokens "$ENGINE_TOKENS" \
    --set engine.device="\"$DEVICE\"" --set engine.dtype="\"$DTYPE\"" --set engine.threads=0 --json

# 2. Trainer steps: a Qwen2.5-1.5B-shaped model, LoRA r16, 8 x 1024 reply tokens, bfloat16 base
#    (TRL's GRPO step beside it when CLAWR1_TRL_PYTHON is set).
step trainer 150 "${CLAWR1[@]}" bench trainer --data-dir "$DATA" --device "$DEVICE" --dtype "$DTYPE" \
    --shape "$SHAPE" --samples "$SAMPLES" --reply-tokens "$REPLY" --micro-batches "$MB" \
    --set trainer.lora_rank=16 --set trainer.lora_alpha=32 --json

# 3. An 8B-shaped model, bfloat16, LoRA r16, with checkpointing: does it fit, and how fast.
if [ -n "$BIG" ]; then
    step trainer-8b 120 "${CLAWR1[@]}" bench trainer --data-dir "$DATA" --device "$DEVICE" --dtype "$DTYPE" \
        --shape "$BIG" --samples 4 --reply-tokens 1024 --micro-batches 2 --grad-checkpointing \
        --set trainer.lora_rank=16 --set trainer.lora_alpha=32 --json
fi

# 4. Live swaps with the engine on the device: failed requests, p99 during swaps vs steady, publish-to-serving.
step swap 140 "${CLAWR1[@]}" bench swap --data-dir "$DATA" --set engine.device="\"$DEVICE\"" \
    --set engine.dtype="\"$DTYPE\"" --json

rm -rf "$DATA"
echo "== done: figures in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
