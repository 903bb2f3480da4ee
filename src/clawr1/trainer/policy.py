"""The trainable policy: the served base model plus a LoRA adapter named `policy` (peft), and the
one computation every objective needs: log-probabilities at the reply positions, over the whole
vocabulary (`distributions`: the full KL and the entropy) or of the given reply tokens (`logprobs`).

Logits are computed only for reply positions (`logits_to_keep`): the prompt's positions would
cost a [tokens x 49k vocab] matrix each for nothing. Rows are left-padded so every reply ends at
the right edge, which is what `logits_to_keep` keeps.

Two other models come from the same weights without a second copy of the base: the base itself
(`adapter_off`), and the EMA teacher (`ema_weights`: the trained tensors trade places with their
moving average, which `update_ema` keeps after each optimizer step).
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
        self.ema = config.teacher == "ema"
        self._ema: dict[str, dict[str, torch.Tensor]] = {}  # adapter -> its trained tensors' moving average
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

    @property
    def has_base(self) -> bool:
        """Whether `adapter_off()` can give the base model (always with LoRA)."""
        return not self.full or self._reference is not None

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

    def distributions(self, rows: Rows) -> torch.Tensor:
        """[B, K, V] log-probabilities over the vocabulary at each reply position, under the
        temperature each reply was sampled at (the distributions the engine sampled from)."""
        out = self.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                         position_ids=rows.position_ids, logits_to_keep=rows.keep, use_cache=False)
        logits = out.logits[:, :-1].float() / rows.temperature[:, None, None]
        return torch.log_softmax(logits, dim=-1)

    def logprobs(self, rows: Rows) -> torch.Tensor:
        """[B, K] logprobs of `rows.targets` under the temperature each reply was sampled at."""
        return token_logprobs(self.distributions(rows), rows)

    # ---- the EMA teacher (`trainer.teacher = "ema"`) ----------------------------------------------
    def _ema_shadow(self) -> dict[str, torch.Tensor]:
        """The active adapter's moving average, started from its current weights on first use."""
        key = "full" if self.full else self.model.active_adapter
        if key not in self._ema:
            self._ema[key] = {n: p.detach().clone() for n, p in self.named_trainable().items()}
        return self._ema[key]

    @torch.no_grad()
    def update_ema(self, decay: float) -> None:
        """ema <- decay * ema + (1 - decay) * weights, for the active adapter (after an optimizer step)."""
        shadow = self._ema_shadow()
        for name, param in self.named_trainable().items():
            shadow[name].lerp_(param.detach(), 1 - decay)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The active adapter with its moving average in place of its weights (for no-grad
        forwards): the tensors trade places and trade back, nothing is copied."""
        params, shadow = self.named_trainable(), self._ema_shadow()

        def swap() -> None:
            for name, param in params.items():
                param.data, shadow[name] = shadow[name], param.data

        swap()
        try:
            yield
        finally:
            swap()

    def named_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the trainable tensors, and with the EMA teacher their moving
        average (as `ema.<name>`); loading copies into these same tensors."""
        state = self.named_trainable()
        if self.ema:
            state.update({f"ema.{name}": t for name, t in self._ema_shadow().items()})
        return state

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.chat.render(messages, tools)


def token_logprobs(distributions: torch.Tensor, rows: Rows) -> torch.Tensor:
    """[B, K] the reply tokens' log-probabilities, picked from [B, K, V] `distributions`."""
    return distributions.gather(-1, rows.targets.unsqueeze(-1)).squeeze(-1)
