"""The output layer, fused with everything the objectives read from it, so that no [positions x
vocabulary] tensor outlives a chunk of positions.

The model gives hidden states [n, H] at the reply positions; the LM head turns each into logits
over the vocabulary (49k rows for SmolLM2, 152k for Qwen). What the trainer needs from those
logits is three numbers per position: the sampled token's logprob, the entropy, and the KL to
the base model (whose hidden states come from the same weights with the adapter off). `head_stats`
computes the three in chunks of positions in the forward pass and keeps only its inputs; the
backward pass recomputes each chunk's logits and returns the gradient for the hidden states (and
the head, when it trains). Peak memory is a few [chunk x V] float32 tensors whatever the batch.

Gradients, per position, with p = softmax(z / T), l = log p, q the reference, t the target:
  d l_t / dz = (onehot_t - p) / T
  d H / dz   = -p (l + H) / T
  d KL / dz  = p (l - log q - KL) / T
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # positions x vocabulary per chunk (64 MB of float32 logits)


def chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def head_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor,
               reference: torch.Tensor | None = None, reference_weight: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of `targets`, entropy, KL(policy || reference)) at each of n positions, in float32.

    `hidden` [n, H] and `weight` [V, H] (the LM head) give the logits, divided by the sampling
    temperature (`inv_temperature` [n] = 1 / T). `reference` [n, H]: the base model's hidden states
    at the same positions (no gradient), under `reference_weight` (default: `weight`); without it
    the KL is zeros. Differentiable in `hidden` and `weight`."""
    empty = hidden.new_zeros((0, hidden.shape[-1]))
    ref = empty if reference is None else reference.detach()
    ref_weight = weight.detach() if reference_weight is None else reference_weight.detach()
    return _HeadStats.apply(hidden, weight, targets, inv_temperature.float(), ref, ref_weight)


@torch.no_grad()
def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  inv_temperature: torch.Tensor) -> torch.Tensor:
    """[n] logprobs of `targets`, chunked, without autograd (teachers, probes)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in chunks(hidden.shape[0], weight.shape[0]):
        logp = torch.log_softmax(F.linear(hidden[s], weight).float() * inv_temperature[s, None].float(), -1)
        out[s] = logp.gather(-1, targets[s, None]).squeeze(-1)
    return out


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """A chunk's log-probabilities [c, V] in float32 (the matmul in the model's dtype, as HF's head)."""
    return torch.log_softmax(F.linear(hidden, weight).float() * inv_t[:, None], -1)


class _HeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor,
                reference: torch.Tensor, ref_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, with_ref = hidden.shape[0], reference.shape[0] > 0
        logp_t, entropy, kl = (torch.zeros(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        for s in chunks(n, weight.shape[0]):
            logp = _chunk(hidden[s], weight, inv_t[s])
            p = logp.exp()
            logp_t[s] = logp.gather(-1, targets[s, None]).squeeze(-1)
            entropy[s] = -(p * logp).sum(-1)
            if with_ref:
                kl[s] = (p * (logp - _chunk(reference[s], ref_weight, inv_t[s]))).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, inv_t, reference, ref_weight, entropy, kl)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: its term is skipped
        return logp_t, entropy, kl

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor, g_entropy: torch.Tensor, g_kl: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, inv_t, reference, ref_weight, entropy, kl = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with_kl = reference.shape[0] > 0 and g_kl is not None  # else no reference logits to recompute
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for s in chunks(hidden.shape[0], weight.shape[0]):
            logp = _chunk(hidden[s], weight, inv_t[s])
            p = logp.exp()
            dz = torch.zeros_like(logp)
            if g_logp is not None:  # the target's term: (onehot - p) * g
                dz -= p * g_logp[s, None]
                dz.scatter_add_(-1, targets[s, None], g_logp[s, None])
            if g_entropy is not None:
                dz -= p * (logp + entropy[s, None]) * g_entropy[s, None]
            if with_kl:
                dz += p * (logp - _chunk(reference[s], ref_weight, inv_t[s]) - kl[s, None]) * g_kl[s, None]
            dz *= inv_t[s, None]
            if grad_h is not None:
                grad_h[s] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += dz.T @ hidden[s].float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None
