"""LoRA versions as peft adapter "slots" in the served model.

Injecting a new peft adapter walks and rewraps every target module: ~400 ms on SmolLM2, during
which the scheduler thread cannot decode. Successive versions of one adapter have the same shape,
so a slot whose version nobody uses any more is kept and the next version is *copied* into its
tensors (a few ms). A batch mixes slots per row through peft's `adapter_names`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Imported with the engine, not on the first swap (where it cost the scheduler thread 0.6-4 s).
from peft import PeftModel
from safetensors import SafetensorError
from safetensors.torch import load_file

from clawr1.core.types import AdapterError

# Fields of adapter_config.json that decide tensor shapes and scaling; equal => copyable.
_SHAPE_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern",
                 "layers_to_transform", "layers_pattern", "fan_in_fan_out")


def _signature(path: Path) -> str | None:
    """Shape signature of an adapter, or None when it has parts we do not copy (DoRA, biases, ...)."""
    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("modules_to_save") \
            or config.get("bias", "none") != "none" or config.get("lora_bias"):
        return None
    targets = config.get("target_modules")
    config["target_modules"] = sorted(targets) if isinstance(targets, list) else targets
    return json.dumps({k: config.get(k) for k in _SHAPE_FIELDS}, sort_keys=True)


Read = tuple[str | None, dict[str, torch.Tensor] | None]  # `AdapterSlots.read`: (signature, tensors)


class AdapterSlots:
    """Owns the peft wrapping of the base model; hands out slot names to serve adapter versions."""

    def __init__(self, base: Any):
        self.base = base
        self.peft: Any = None
        self._count = 0
        self._signature: dict[str, str | None] = {}
        self._free: list[str] = []

    @property
    def model(self) -> Any:
        return self.base if self.peft is None else self.peft

    def load(self, path: Path, read: Read | None = None) -> str:
        """Put the adapter at `path` into a slot (reusing a free one if it fits); return the slot name.
        `read`: `read(path)` done beforehand off the scheduler thread, so a copy costs it no disk I/O."""
        signature, state = read if read is not None else AdapterSlots.read(path)
        reusable = next((s for s in self._free if signature is not None and self._signature[s] == signature), None)
        if reusable is not None:
            self._copy_into(reusable, path, state)
            self._free.remove(reusable)
            return reusable

        slot = f"slot{self._count}"
        self._count += 1
        try:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=slot, is_trainable=False)
            else:
                self.peft.load_adapter(path, adapter_name=slot, is_trainable=False)
        except (ValueError, KeyError, RuntimeError, OSError) as exc:
            raise AdapterError(f"cannot load adapter from {path}: {exc}") from exc
        self.peft.eval()  # an adapter trained with lora_dropout must not drop out while serving
        self._signature[slot] = signature
        return slot

    def release(self, slot: str, in_use: set[str]) -> None:
        """`slot` serves nothing any more. Keep it as a spare (two at most: a double buffer) if a
        later version can be copied into it; with nothing in use, restore the bare base model
        exactly (LoRA layers removed)."""
        if not in_use:
            self.base = self.peft.unload()
            self.peft, self._free, self._signature = None, [], {}
            return
        if self._signature[slot] is None:
            self._delete(slot)
        else:
            self._free.append(slot)
        while len(self._free) > 2:
            self._delete(self._free.pop(0))

    def _delete(self, slot: str) -> None:
        self.peft.delete_adapter(slot)
        del self._signature[slot]

    @staticmethod
    def read(path: Path) -> Read:
        """What a copy into a spare slot needs from disk: the adapter's shape signature and tensors
        (None, None for an adapter no slot can take by copy). Safe on any thread. Files that do not
        parse (a truncated or overwritten version) are an `AdapterError`, like any adapter that
        does not load."""
        try:
            signature = _signature(path)
            return signature, load_file(path / "adapter_model.safetensors") if signature is not None else None
        except (SafetensorError, ValueError) as exc:  # (json's decode error is a ValueError)
            raise AdapterError(f"adapter at {path} does not parse: {exc}") from exc

    def _copy_into(self, slot: str, path: Path, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            raise AdapterError(f"adapter at {path} cannot be copied into a slot")
        params = {name.replace(f".{slot}.", "."): p for name, p in self.peft.named_parameters() if f".{slot}." in name}
        if set(state) != set(params):
            raise AdapterError(f"adapter at {path} does not match slot {slot}: "
                               f"{len(set(state) ^ set(params))} tensor names differ")
        for name, tensor in state.items():  # check everything before touching the slot
            if params[name].shape != tensor.shape:
                raise AdapterError(f"adapter at {path}: {name} has shape {tuple(tensor.shape)}, "
                                   f"expected {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
