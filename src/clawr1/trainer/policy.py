"""The trainable policy: the served base model plus a LoRA adapter named `policy` (peft), on the
trainer's device and dtype (`trainer.device`, `trainer.dtype`, `trainer.quantize`), and the one
computation every objective needs: per reply token, the sampled token's logprob, the entropy and
the KL to the base model (`stats`), or the logprobs alone (`logprobs`).

The decoder runs over the whole rows; the LM head only at the reply positions, fused with the
log-softmax in chunks of positions (`head.py`), so no [tokens x vocabulary] tensor outlives a
chunk. Rows are left-padded so every reply ends at the right edge.

Two other models come from the same weights without a second copy of the base: the base itself
(`adapter_off`), and the EMA teacher (`ema_weights`: the trained tensors trade places with their
moving average, which `update_ema` keeps after each optimizer step).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from clawr1.core.config import TrainerConfig
from clawr1.core.records import POLICY
from clawr1.engine.chat import ChatFormat
from clawr1.engine.frontend import end_of_turn_ids
from clawr1.engine.tokenizer import load_tokenizer
from clawr1.trainer.head import Cut, head_logprobs, head_stats

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
    cuts: list[tuple[int, float]] | None = None  # per row: the (top_k, top_p) its reply was sampled with

    def to(self, device: torch.device) -> Rows:
        return Rows(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.targets,
                                               self.mask, self.temperature)), self.keep, self.cuts)

    def cut_at(self, where: torch.Tensor) -> Cut | None:
        """The (top_k, top_p) of each position of `where` [B, K] (True at the positions picked, in
        row-major order, as `tensor[where]` picks them); None when every row was sampled uncut."""
        if self.cuts is None or all(k <= 0 and p >= 1.0 for k, p in self.cuts):
            return None
        rows = where.nonzero()[:, 0].tolist()
        return [self.cuts[r][0] for r in rows], [self.cuts[r][1] for r in rows]


def pack(prompts: list[list[int]], replies: list[list[int]], temperatures: list[float], pad_id: int,
         cuts: list[tuple[int, float]] | None = None) -> Rows:
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
    return Rows(ids, attention, positions, targets, mask, torch.tensor(temperatures, dtype=torch.float32), k + 1, cuts)


class Policy:
    """Base model + trainable LoRA adapters (`policy`, or one per tenant); `adapter_off()` gives
    the base model (KL reference, base teacher) without a second copy of the weights.

    Several adapters share one base (per-tenant training): `activate(name)` makes one the active,
    and the only trainable, adapter (peft's `set_adapter`); `parameters()`/`named_trainable()` are then
    that adapter's."""

    def __init__(self, model_path: Path, config: TrainerConfig, adapter: str = ADAPTER, base: Any = None):
        """`base`: an already built transformers model (on the trainer's device and dtype) instead
        of the weights at `model_path`, whose tokenizer is still used (`bench trainer --shape`)."""
        from peft import LoraConfig, get_peft_model

        self.device, dtype = placement(config)
        self.dtype = dtype
        self.tokenizer = load_tokenizer(model_path)
        self.chat = ChatFormat(self.tokenizer)
        self.full = config.finetune == "full"
        # Full fine-tuning trains the weights themselves: float32 master weights whatever `dtype`,
        # which (bfloat16) the decoder then computes in under autocast (`_mixed_precision`).
        stored = torch.float32 if self.full else dtype
        base = base.to(stored) if base is not None else load_base(model_path, config, self.device, stored)
        if getattr(base.config, "final_logit_softcapping", None):
            raise ValueError(f"{model_path}: logit soft-capping (Gemma-2 style) is not supported by the fused head")
        if config.grad_checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.seed = config.seed
        self._reference: Any = None
        self.ema = config.teacher == "ema"
        self._ema: dict[str, dict[str, torch.Tensor]] = {}  # adapter -> its trained tensors' moving average
        if self.full:  # every weight trains; the base stays only where something compares with it
            self.model = base
            if config.kl_coef > 0 or config.teacher == "base":
                self._reference = frozen_copy(base, dtype)
        else:
            self.lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                   target_modules=config.lora_targets, lora_dropout=0.0, bias="none",
                                   task_type="CAUSAL_LM")
            torch.manual_seed(self.seed)  # LoRA A init
            self.model = get_peft_model(base, self.lora, adapter_name=adapter, autocast_adapter_dtype=True)
            self._master_weights()
        self.model.train()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # The ids a reply ends with (the tokenizer's and the generation config's, as the engines
        # stop on them): the stop term's decision is ending at all, whichever of them.
        self.stop_ids = sorted(end_of_turn_ids(self.tokenizer.eos_token_id,
                                               getattr(base.generation_config, "eos_token_id", None)))

    def _master_weights(self) -> None:
        """LoRA tensors in float32 whatever the base's dtype: AdamW's small updates would round
        away in bfloat16 (the forward casts them down under autocast: `_mixed_precision`)."""
        for name, param in self.model.named_parameters():
            if "lora_" in name and param.dtype != torch.float32:
                param.data = param.data.float()

    def add(self, adapter: str) -> None:
        """Another adapter on the same base (a no-op when it exists); initialised like the first."""
        if not self.full and adapter not in self.model.peft_config:
            torch.manual_seed(self.seed)
            self.model.add_adapter(adapter, self.lora)
            self._master_weights()

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

    @property
    def causal_lm(self) -> Any:
        """The transformers model under peft's wrapper (its layers carry the LoRA), or the full model."""
        return self.model if self.full else self.model.get_base_model()

    def hidden(self, rows: Rows) -> torch.Tensor:
        """[B, K, H] the decoder's last hidden states at the positions that predict the reply tokens."""
        rows = rows.to(self.device)
        with self._mixed_precision():
            out = self.causal_lm.get_decoder()(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                                               position_ids=rows.position_ids, use_cache=False)
        # In the head's dtype: CUDA's autocast gives float32 out of a LayerNorm (RMSNorm casts back).
        return out.last_hidden_state[:, -rows.keep:-1].to(self.head.dtype)

    def _mixed_precision(self) -> contextlib.AbstractContextManager[Any]:
        """With a bfloat16 base, the decoder runs under autocast (mixed precision, as TRL's
        `bf16=True`): the float32 LoRA weights are multiplied in bfloat16, so no float32 copy of
        each LoRA input is multiplied and kept for the backward (peft still casts it up, and
        autocast back down). A bf16 step on the CPU, 8 x 256 tokens, the same script back to back:
        12.9 -> 9.9 s. The weights, their gradients and AdamW's state stay float32; the fused head
        (outside) keeps its float32 log-softmax. Not for float16: without a loss scale its
        gradients could underflow in the LoRA matmuls too."""
        if self.dtype == torch.bfloat16 and self.device.type in ("cpu", "cuda"):
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    @property
    def head(self) -> torch.Tensor:
        return self.causal_lm.get_output_embeddings().weight

    def stats(self, rows: Rows, mask: torch.Tensor, reference: bool, teacher: torch.Tensor | None = None,
              teacher_head: torch.Tensor | None = None, stop: bool = False) -> tuple[torch.Tensor, ...]:
        """[B, K] float32 (logprob of the reply token, entropy, KL(policy || base), KL(policy ||
        teacher), logprob of ending the reply, the base's logprob of the reply token) at the
        positions of `mask`, zeros elsewhere; differentiable in the trainable weights (the last
        not). `reference` False: no base forward, and the KL to it and its logprobs are zeros.
        `teacher` [B, K, H]: the teacher's hidden states at the same reply positions
        (`teacher_hidden`) under `teacher_head`; without it that KL is zeros. `stop` False: the
        fifth is zeros. Each over the whole vocabulary, chunked (`head.py`)."""
        where = mask.to(self.device) > 0
        hidden = self.hidden(rows)[where]
        ref = ref_head = None
        if reference:
            with torch.no_grad(), self.adapter_off():
                ref, ref_head = self.hidden(rows)[where], self.head
        rows = rows.to(self.device)
        inv_t = (1.0 / rows.temperature)[:, None].expand(where.shape)[where]
        outs = head_stats(hidden, self.head, rows.targets[where], inv_t, ref, ref_head,
                          None if teacher is None else teacher[where], teacher_head, self._stop_ids() if stop else None,
                          rows.cut_at(where))
        return tuple(torch.zeros(where.shape, device=self.device).masked_scatter(where, o) for o in outs)

    @torch.no_grad()
    def logprobs(self, rows: Rows) -> torch.Tensor:
        """[B, K] logprobs of `rows.targets` (zeros at padding) under the temperature each reply was
        sampled at; no gradient (teachers, probes, the reference)."""
        return self._picked(rows, stop=False)[0]

    @torch.no_grad()
    def logprobs_and_stop(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs`, and [B, K] the logprobs of ending the reply (any of `stop_ids`) at the same
        positions, from one forward (the OPD teacher with the stop term)."""
        picked, stop = self._picked(rows, stop=True)
        return picked, stop

    def _picked(self, rows: Rows, stop: bool) -> list[torch.Tensor]:
        where = rows.mask.to(self.device) > 0
        hidden = self.hidden(rows)[where]
        rows = rows.to(self.device)
        inv_t = (1.0 / rows.temperature)[:, None].expand(where.shape)[where]
        outs = head_logprobs(hidden, self.head, rows.targets[where], inv_t, self._stop_ids() if stop else None,
                             rows.cut_at(where))
        return [torch.zeros(where.shape, device=self.device).masked_scatter(where, out) for out in outs]

    def _stop_ids(self) -> torch.Tensor:
        if not self.stop_ids:
            raise ValueError("trainer.stop_coef: this model names no end-of-turn token (tokenizer eos_token_id, "
                             "generation_config eos_token_id)")
        return torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)

    def distributions(self, rows: Rows) -> torch.Tensor:
        """[B, K, V] log-probabilities over the vocabulary at each reply position, unchunked: the
        reference the fused head is tested against, and a tool for tests. Training never calls it."""
        rows = rows.to(self.device)
        with self._mixed_precision():  # the same computation as `hidden`
            out = self.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                             position_ids=rows.position_ids, logits_to_keep=rows.keep, use_cache=False)
        logits = out.logits[:, :-1].float() / rows.temperature[:, None, None]
        return torch.log_softmax(logits, dim=-1)

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
    return distributions.gather(-1, rows.targets.to(distributions.device).unsqueeze(-1)).squeeze(-1)


def placement(config: TrainerConfig) -> tuple[torch.device, torch.dtype]:
    """The trainer's device and base dtype from `trainer.device` / `trainer.dtype`; a clear error
    when the device asked for is not there."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":  # one GPU per data-parallel rank (`ranks.py`); cuda:0 alone
        name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"trainer.device = {config.device!r} but this torch ({torch.__version__}) sees no CUDA "
                             "device; set trainer.device = \"cpu\" or \"auto\"")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"trainer.device = {config.device!r} but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("trainer.device = \"mps\" but this torch sees no MPS device")
    device = torch.device(name)
    dtype = config.dtype
    if dtype == "auto":  # bfloat16 where the card computes in it (Ampere on); float32 else
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bfloat16" if bf16 else "float32"
    return device, getattr(torch, dtype)


def frozen_copy(model: Any, dtype: torch.dtype) -> Any:
    """The base kept beside a fully fine-tuned model (`kl_coef`, the base teacher): frozen, with its
    decoder's linear weights stored in `dtype`. Under mixed precision the trained model's linear
    layers multiply in that dtype anyway (autocast rounds the float32 weights down each time), so
    those weights are the same numbers in half the memory, while embeddings, norms and the head
    stay float32 like the trained model's: at step 0 both compute exactly the same logits (a KL of
    0), as a whole bfloat16 copy would not (its residual stream would be bfloat16)."""
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    if dtype != torch.float32:
        for module in frozen.get_decoder().modules():
            if isinstance(module, torch.nn.Linear):
                module.to(dtype)
    return frozen


def load_base(model_path: Path, config: TrainerConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """The base model on `device` in `dtype`, or quantized (`trainer.quantize`) where that can run."""
    if config.quantize == "none":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    if device.type != "cuda":
        raise ValueError(f"trainer.quantize = {config.quantize!r} needs a CUDA trainer.device (bitsandbytes); "
                         f"this trainer is on {device}")
    try:
        import bitsandbytes  # noqa: F401  (transformers imports it by name; fail here with the fix)
    except ImportError as e:
        raise ValueError(f"trainer.quantize = {config.quantize!r} needs bitsandbytes: pip install -e '.[qlora]'") from e
    from transformers import BitsAndBytesConfig

    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                bnb_4bit_use_double_quant=True)
             if config.quantize == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant,
                                                device_map={"": device})
