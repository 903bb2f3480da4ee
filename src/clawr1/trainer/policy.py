"""The trainable policy: the served base model plus a LoRA adapter named `policy` (peft), and the
one computation every objective needs: per-token logprobs of given reply tokens.

Logits are computed only for reply positions (`logits_to_keep`): the prompt's positions would
cost a [tokens x 49k vocab] matrix each for nothing. Rows are left-padded so every reply ends at
the right edge, which is what `logits_to_keep` keeps.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawr1.core.config import TrainerConfig
from clawr1.core.records import POLICY
from clawr1.engine.chat import ChatFormat

ADAPTER = POLICY  # the shared adapter's name (per tenant: `adapter_name(tenant)`)


@dataclass
class Rows:
    """A left-padded batch; `targets`/`mask` are right-aligned [B, K] over the reply tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    temperature: torch.Tensor
    keep: int  # logits kept = K + 1 (the last one predicts past the end and is dropped)


def pack(prompts: list[list[int]], replies: list[list[int]], temperatures: list[float], pad_id: int) -> Rows:
    lengths = [len(p) + len(r) for p, r in zip(prompts, replies, strict=True)]
    width, k = max(lengths), max(len(r) for r in replies)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    targets = torch.full((len(prompts), k), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), k))
    for i, (p, r) in enumerate(zip(prompts, replies, strict=True)):
        ids[i, width - lengths[i]:] = torch.tensor(p + r)
        attention[i, width - lengths[i]:] = 1
        if r:
            targets[i, k - len(r):] = torch.tensor(r)
            mask[i, k - len(r):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return Rows(ids, attention, positions, targets, mask, torch.tensor(temperatures, dtype=torch.float32), k + 1)


class Policy:
    """Base model + trainable LoRA adapters (`policy`, or one per tenant); `adapter_off()` gives
    the base model (KL reference, base teacher) without a second copy of the weights.

    Several adapters share one base (per-tenant training): `activate(name)` makes one the active,
    and the only trainable, adapter (peft's `set_adapter`); `parameters()`/`named_trainable()` are then
    that adapter's."""

    def __init__(self, model_path: Path, config: TrainerConfig, adapter: str = ADAPTER):
        from peft import LoraConfig, get_peft_model

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.chat = ChatFormat(self.tokenizer)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.seed = config.seed
        self.full = config.finetune == "full"
        self._reference: Any = None
        if self.full:  # every weight trains; the base stays only where something compares with it
            self.model = base
            if config.kl_coef > 0 or config.teacher == "base":
                self._reference = copy.deepcopy(base).eval().requires_grad_(False)
        else:
            self.lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                   target_modules=config.lora_targets, lora_dropout=0.0, bias="none",
                                   task_type="CAUSAL_LM")
            torch.manual_seed(self.seed)  # LoRA A init
            self.model = get_peft_model(base, self.lora, adapter_name=adapter)
        self.model.train()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def add(self, adapter: str) -> None:
        """Another adapter on the same base (a no-op when it exists); initialised like the first."""
        if not self.full and adapter not in self.model.peft_config:
            torch.manual_seed(self.seed)
            self.model.add_adapter(adapter, self.lora)

    def activate(self, adapter: str) -> None:
        if not self.full and self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)  # also makes it the only adapter with requires_grad

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def adapter_off(self) -> Iterator[None]:
        """The base model: the adapter switched off, or (full fine-tuning) the kept original."""
        if not self.full:
            with self.model.disable_adapter():
                yield
            return
        if self._reference is None:
            raise RuntimeError("full fine-tuning keeps the base model only for kl_coef > 0 or teacher = \"base\"")
        model, self.model = self.model, self._reference
        try:
            yield
        finally:
            self.model = model

    def logprobs(self, rows: Rows) -> torch.Tensor:
        """[B, K] logprobs of `rows.targets` under the temperature each reply was sampled at."""
        out = self.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                         position_ids=rows.position_ids, logits_to_keep=rows.keep, use_cache=False)
        logits = out.logits[:, :-1].float() / rows.temperature[:, None, None]
        return torch.log_softmax(logits, dim=-1).gather(-1, rows.targets.unsqueeze(-1)).squeeze(-1)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.chat.render(messages, tools)
