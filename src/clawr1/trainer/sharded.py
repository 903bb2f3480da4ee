"""Full fine-tuning across data-parallel ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`):
each decoder layer's weights, gradients and AdamW moments are split across the ranks, so a rank
holds 1/N of them; a layer's weights are gathered for its forward and freed after it, and gathered
again for its backward. Each layer is its own FSDP root (nothing above it is sharded), and FSDP
keeps a root's gathered weights from its forward until its backward unless told otherwise
(`reshard_after_forward=True`, given explicitly): by default every layer stayed gathered through
the whole forward, and sharding lowered no peak (measured in docs/scale.md).

The optimizer (`adamw`) holds the sharded parameters (DTensors) and the whole ones in two
parameter groups: AdamW's `foreach` kernels (its default on CUDA) take one group's tensors in one
call, and refuse a list that mixes DTensors with plain tensors. Checkpoints keep the one-process
format (one group, parameters in model order): `gather` merges the groups, `scatter` splits them.

What stays whole on every rank: the embeddings, the final norm and the LM head (tied to the
embeddings in SmolLM2 and Qwen). The fused head (`head.py`) reads the head's weight outside any
module's forward, where FSDP would hand it over sharded; their gradients are summed by hand
(`Ranks.sum_gradients`), as under LoRA. The kept base model (`kl_coef`, the base teacher) is a
replicated, frozen copy: it never trains, so it needs no gradient or optimizer state.

Every forward/backward of a sharded layer is a collective, so the ranks must run the same passes:
`Trainer.train_step` pads the ranks with fewer micro-batches with empty passes, and the teacher
must be the base (a teacher forward through the sharded policy would run only on ranks whose
share holds a hinted sample). Gradients are reduced as sums (not FSDP's default mean): the step
divides the summed gradients by the total token count, as one process would.

Checkpoints and published weights are whole tensors (gathered, written by rank 0) in the same
format as one process writes, so a run can resume with a different number of ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU


def shard(model: Any) -> int:
    """Shard each decoder layer of a transformers causal LM over the default process group (sums,
    not means, of the gradients). Returns the number of layers sharded."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder `layers` to shard (FSDP2 needs the layer list)")
    for layer in layers:
        # Explicit: left to its default, a root (each layer is one) stays gathered until its backward.
        fully_shard(layer, reshard_after_forward=True)
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum (PREMUL_SUM)
    return len(layers)


def is_sharded(model: Any) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
          foreach: bool | None = None) -> torch.optim.AdamW:
    """AdamW over `params` (in model order), the sharded ones (DTensors) in a group of their own
    before the whole ones: `foreach` (None: torch's choice, `True` on CUDA) runs one group at a
    time and cannot mix the two kinds. Unsharded, one group, as always."""
    split = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    groups = [{"params": group} for group in split if group]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, foreach=foreach)


def local_bytes(model: Any) -> int:
    """Bytes of the parameters this rank holds (its shards, plus what is replicated)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def gather(model: Any, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Collective (every rank calls it): the whole trainable tensors and, with `optimizer`, its
    state keyed as one process's `optimizer.state_dict()` keys it (one group, parameter indices in
    model order), on rank 0; empty elsewhere."""
    names = trainable_names(model)
    weights = get_model_state_dict(model, options=GATHERED)
    weights = {n: weights[n] for n in names if n in weights}
    if optimizer is None:
        return weights, {}
    state = get_optimizer_state_dict(model, optimizer, options=GATHERED)
    if not state:
        return weights, {}
    index = {name: i for i, name in enumerate(names)}
    # `adamw`'s groups differ only in their parameters: one group of them all, as one process has.
    hyper = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    return weights, {"state": {index[n]: s for n, s in state["state"].items()},
                     "param_groups": [{**hyper, "params": sorted(index[n] for g in state["param_groups"]
                                                                 for n in g["params"])}]}


def scatter(model: Any, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor], state: dict) -> None:
    """Collective: load whole tensors and an index-keyed optimizer state (as `gather` returns them,
    or as one process saves them), passed by rank 0 (the others pass empty dicts), into every
    rank's shards of the model and the optimizer."""
    names = trainable_names(model)
    from_lead = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights, options=from_lead)
    name_of = {id(p): n for n, p in model.named_parameters()}
    hyper = {k: v for k, v in state["param_groups"][0].items() if k != "params"} if state else {}
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},  # into `adamw`'s groups
               "param_groups": [{**hyper, "params": [name_of[id(p)] for p in g["params"]]}
                                for g in optimizer.param_groups]} if state else {}
    set_optimizer_state_dict(model, optimizer, by_name, options=from_lead)


def trainable_names(model: Any) -> list[str]:
    """Parameter names in the order the optimizer holds them (`Policy.parameters()`)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` for a mix of sharded (DTensor) and whole gradients, which it refuses: the
    squared norms of the local shards are summed over the ranks, the whole ones counted once."""
    sharded = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
    whole = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    square = torch.stack([g.float().pow(2).sum() for g in sharded]).sum() if sharded else torch.zeros(())
    if dist.is_initialized() and sharded:
        dist.all_reduce(square)
    square = square + (torch.stack([g.float().pow(2).sum() for g in whole]).sum() if whole else 0.0)
    norm = math.sqrt(float(square))
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
