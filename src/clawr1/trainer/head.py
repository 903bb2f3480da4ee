"""The output layer, fused with everything the objectives read from it, so that no [positions x
vocabulary] tensor outlives a chunk of positions.

The model gives hidden states [n, H] at the reply positions; the LM head turns each into logits
over the vocabulary (49k rows for SmolLM2, 152k for Qwen). What the trainer needs from those
logits is a few numbers per position: the sampled token's logprob, the entropy, the KL to the base
model (whose hidden states come from the same weights with the adapter off), for full-vocabulary
OPD the KL to the hint-informed teacher (hidden states of the same reply with the hint in the
context) and, for the stop term, the logprob of ending the reply there (any end-of-turn id).
`head_stats` computes them in chunks of positions in the forward pass and keeps only its inputs;
the backward pass recomputes each chunk's logits and returns the gradient for the hidden states
(and the head, when it trains). Peak memory is a few [chunk x V] float32 tensors whatever the batch.

The sampled token's logprob (and the reference's, for the k3 estimator) is under the distribution
each reply was sampled from (`cut`: its top_k and top_p, `engine/sampling.py`), so the importance
ratio compares it with the engine's recorded logprob like with like; entropy and the KLs are over
the whole distribution at temperature T.

Gradients, per position, with p = softmax(z / T), l = log p, q the reference, t the target, and
p_S the sampling distribution (p cut to the kept set S and renormalised; p itself when uncut):
  d l_t / dz = (onehot_t - p_S) / T
  d H / dz   = -p (l + H) / T
  d KL / dz  = p (l - log q - KL) / T
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from clawr1.engine.sampling import processed_logprobs

CHUNK_ELEMENTS = 1 << 24  # positions x vocabulary per chunk (64 MB of float32 logits)


def chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


Cut = tuple[list[int], list[float]]  # per position: the top_k and top_p its reply was sampled with


def uncut(cut: Cut | None) -> bool:
    return cut is None or all(k <= 0 for k in cut[0]) and all(p >= 1.0 for p in cut[1])


def head_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor,
               reference: torch.Tensor | None = None, reference_weight: torch.Tensor | None = None,
               teacher: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
               stop: torch.Tensor | None = None, cut: Cut | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of `targets`, entropy, KL(policy || reference), KL(policy || teacher), logprob of
    `stop`, the reference's logprob of `targets`) at each of n positions, in float32.

    `hidden` [n, H] and `weight` [V, H] (the LM head) give the logits, divided by the sampling
    temperature (`inv_temperature` [n] = 1 / T). `reference` and `teacher` [n, H]: other models'
    hidden states at the same positions (no gradient: the base model, the hinted teacher), under
    their own heads (default: `weight`); either absent gives zeros for its KL. `stop` [m]: the ids
    that end a reply (the model's end-of-turn ids): the fifth output is the log of their summed
    probability at each position, the chance of stopping there; absent, zeros. The sixth (zeros
    without `reference`) is the k3 KL estimator's input, read off the reference's log-softmax the
    KL computes anyway. `cut` (per position top_k, top_p): the first and sixth are under the
    sampling distribution of those settings, each target kept in it (`engine/sampling.py`).
    Differentiable in `hidden` and `weight` (the sixth is a constant)."""
    empty = hidden.new_zeros((0, hidden.shape[-1]))

    def other(h: torch.Tensor | None, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (empty if h is None else h.detach()), (weight.detach() if w is None else w.detach())

    stop = targets.new_zeros(0) if stop is None else stop
    return _HeadStats.apply(hidden, weight, targets, inv_temperature.float(), *other(reference, reference_weight),
                            *other(teacher, teacher_weight), stop, None if uncut(cut) else cut)


@torch.no_grad()
def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  inv_temperature: torch.Tensor, stop: torch.Tensor | None = None,
                  cut: Cut | None = None) -> list[torch.Tensor]:
    """[[n] logprobs of `targets`] and, with `stop` (end-of-turn ids [m]), [n] the logprobs of
    stopping (as `head_stats`, `cut` too), chunked, without autograd (teachers, probes)."""
    outs = [torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            for _ in range(1 if stop is None else 2)]
    cut = None if uncut(cut) else cut
    for s in chunks(hidden.shape[0], weight.shape[0]):
        z = _chunk(hidden[s], weight, inv_temperature[s].float())
        logp = torch.log_softmax(z, -1)
        picked = logp if cut is None else processed_logprobs(z, cut[0][s], cut[1][s], keep=targets[s])
        outs[0][s] = picked.gather(-1, targets[s, None]).squeeze(-1)
        if stop is not None:
            outs[1][s] = torch.logsumexp(logp[:, stop], -1)
    return outs


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, inv_t: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits [c, V] in float32, divided by the temperature (`inv_t` None: all 1, the
    common case, and one pass over [c, V] saved). The matmul in the model's dtype, as HF's head."""
    z = F.linear(hidden, weight).float()
    return z if inv_t is None else z.mul_(inv_t[:, None])


class _HeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor,
                reference: torch.Tensor, ref_weight: torch.Tensor, teacher: torch.Tensor,
                teacher_weight: torch.Tensor, stop: torch.Tensor, cut: Cut | None) -> tuple[torch.Tensor, ...]:
        n = hidden.shape[0]
        ctx.cut = cut
        others = ((reference, ref_weight), (teacher, teacher_weight))
        logp_t, entropy, kl_ref, kl_teacher, logp_stop, ref_t = (
            torch.zeros(n, dtype=torch.float32, device=hidden.device) for _ in range(6))
        ctx.scaled = bool((inv_t != 1).any())  # some reply sampled at a temperature other than 1
        for s in chunks(n, weight.shape[0]):
            t = inv_t[s] if ctx.scaled else None
            z = _chunk(hidden[s], weight, t)
            logp = torch.log_softmax(z, -1)
            p = logp.exp()
            sampled = logp if cut is None else processed_logprobs(z, cut[0][s], cut[1][s], keep=targets[s])
            del z
            logp_t[s] = sampled.gather(-1, targets[s, None]).squeeze(-1)
            if stop.shape[0]:
                logp_stop[s] = torch.logsumexp(logp[:, stop], -1)
            entropy[s] = -torch.linalg.vecdot(p, logp)
            for (h, w), kl, picked in zip(others, (kl_ref, kl_teacher), (ref_t, None)):
                if h.shape[0]:
                    zq = _chunk(h[s], w, t)
                    q = torch.log_softmax(zq, -1)
                    kl[s] = torch.linalg.vecdot(p, logp - q)
                    if picked is not None:
                        if cut is not None:
                            q = processed_logprobs(zq, cut[0][s], cut[1][s], keep=targets[s])
                        picked[s] = q.gather(-1, targets[s, None]).squeeze(-1)
        ctx.save_for_backward(hidden, weight, targets, inv_t, reference, ref_weight, teacher, teacher_weight,
                              stop, entropy, kl_ref, kl_teacher, logp_stop)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: its term is skipped
        ctx.mark_non_differentiable(ref_t)  # the reference's, which has no gradient
        return logp_t, entropy, kl_ref, kl_teacher, logp_stop, ref_t

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor, g_entropy: torch.Tensor, g_ref: torch.Tensor,
                 g_teacher: torch.Tensor, g_stop: torch.Tensor, _g_ref_t: None) -> tuple[Any, ...]:
        (hidden, weight, targets, inv_t, reference, ref_weight, teacher, teacher_weight,
         stop, entropy, kl_ref, kl_teacher, logp_stop) = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # A KL term counts when the loss used it and its other model's logits can be recomputed.
        kls = [(h, w, kl, g) for h, w, kl, g in ((reference, ref_weight, kl_ref, g_ref),
                                                 (teacher, teacher_weight, kl_teacher, g_teacher))
               if g is not None and h.shape[0]]
        g_stop = g_stop if g_stop is not None and stop.shape[0] else None
        # dz = p * (row + logp * slope - sum_k g_k log q_k) + onehot_t * g_logp (+ the stop ids' term),
        # the docstring's gradients summed: the per-position parts first, then one pass over [c, V]
        # per term that varies along the vocabulary. Only the target's term: p = softmax, no logp.
        # A cut sampling distribution puts the target's -p_S term apart (not a multiple of p).
        cut = ctx.cut
        row = torch.zeros_like(entropy)
        slope = torch.zeros_like(entropy)
        for g, value in ((g_logp if cut is None else None, None), (g_stop, None), (g_entropy, entropy)):
            if g is not None:
                row -= g if value is None else g * value
        if g_entropy is not None:
            slope -= g_entropy
        for _, _, kl, g in kls:
            row -= g * kl
            slope += g
        needs_logp = g_entropy is not None or bool(kls) or g_stop is not None
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for s in chunks(hidden.shape[0], weight.shape[0]):
            t = inv_t[s] if ctx.scaled else None
            z = _chunk(hidden[s], weight, t)
            p_cut = None
            if cut is not None and g_logp is not None:
                p_cut = processed_logprobs(z, cut[0][s], cut[1][s], keep=targets[s]).exp_()
            if not needs_logp:
                dz = torch.softmax(z, -1).mul_(row[s, None])
            else:
                logp = torch.log_softmax(z, -1)
                del z
                m = logp * slope[s, None] if g_entropy is not None or kls else torch.zeros_like(logp)
                m += row[s, None]
                for h, w, _, g in kls:
                    m -= torch.log_softmax(_chunk(h[s], w, t), -1).mul_(g[s, None])
                dz = m.mul_(logp.exp())
                if g_stop is not None:  # log sum_S p: p / p_S on S, the -p above elsewhere
                    dz.index_add_(1, stop, (logp[:, stop] - logp_stop[s, None]).exp() * g_stop[s, None])
            if g_logp is not None:
                if p_cut is not None:
                    dz.sub_(p_cut.mul_(g_logp[s, None]))
                dz.scatter_add_(-1, targets[s, None], g_logp[s, None])
            if t is not None:
                dz.mul_(t[:, None])
            if grad_h is not None:
                grad_h[s] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += dz.T @ hidden[s].float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), *([None] * 8)
