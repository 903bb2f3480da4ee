"""A LoRA publisher to kill: `python tests/killable_publisher.py ROOT MODEL_DIR`, driven over stdin
by `tests/unit/test_faults.py`.

It loads torch, peft and the tiny model once, then forks a publisher per command, so the test can
SIGKILL 20+ publishers without paying 20 interpreter starts. Commands, one a line:
- `loop`: the child publishes versions back to back as the trainer does after a restart (the next
  number after the newest complete one, a partial directory of a killed attempt reused), pruning to
  the newest 3; the test kills it at a random moment.
- `cut K`: the child publishes one version and kills itself right after its K-th open of a file
  for writing under ROOT returns: the file exists (created or truncated) and nothing is written
  yet, the moment a random kill almost never hits. Exits 0 if the publish opened fewer files.
For each command it prints `pid N`, then `exit N STATUS` once the child is gone (STATUS as
`os.waitstatus_to_exitcode`: -9 is SIGKILL). `quit` ends it.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children run torch code safely

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from clawr1.engine import adapters  # noqa: E402

NAME, KEEP = "policy", 3


def model_with_lora(model_dir: str):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, config, adapter_name=NAME)


def publish_next(model, root: Path) -> int:
    newest = adapters.latest(root, NAME)
    version = (newest[0] if newest else 0) + 1
    with torch.no_grad():  # each version's weights differ, as after an optimizer step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    adapters.publish(model, root, NAME, version)
    adapters.prune(root, NAME, KEEP, {version})
    return version


def cut_after(k: int, root: Path) -> None:
    """SIGKILL this process right after its k-th open of a file under `root` for writing."""
    opened = 0
    real_open = builtins.open

    def open_then_die(file, mode="r", *args, **kwargs):
        nonlocal opened
        handle = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") \
                and Path(file).resolve().is_relative_to(root.resolve()):
            opened += 1
            if opened == k:
                os.kill(os.getpid(), signal.SIGKILL)
        return handle

    builtins.open = io.open = open_then_die


def main() -> None:
    root, model_dir = Path(sys.argv[1]), sys.argv[2]
    model = model_with_lora(model_dir)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command == ["quit"]:
            return
        pid = os.fork()
        if pid == 0:  # the child: never returns into the command loop
            try:
                if command[0] == "loop":
                    while True:
                        publish_next(model, root)
                else:
                    cut_after(int(command[1]), root)
                    publish_next(model, root)
            except BaseException as error:  # noqa: BLE001 - a publisher that fails (not killed) is the test's failure
                print(f"publisher failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
