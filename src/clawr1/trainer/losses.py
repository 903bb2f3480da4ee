"""The training objectives, as pure functions on per-token tensors (shape [tokens] or [B, T]).

Every function takes a `mask` (1 = a reply token that trains) so padding and masked samples cost
nothing. Losses are token-level means over the unmasked tokens of the whole batch (DAPO-style),
so a long reply does not count less per token than a short one.

The trust region and the drift metrics look at the whole vocabulary at each reply position
(`vocab_kl`, `vocab_entropy` on [..., V] log-probabilities): a sampled-token estimate (`kl_to_reference`)
sees only where the policy put its samples, not where the probability it took from them went.
Both are autograd functions that keep nothing for the backward pass but their inputs (the policy's
log-probabilities, which `log_softmax` keeps anyway, and the reference's), and work in chunks of
positions, so no further [B, K, V] tensor is alive between the forward and the backward pass.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ELEMENTS = 1 << 24  # positions x vocabulary per chunk of the vocabulary sums (64 MB of float32)
# The largest log-ratio the sampled-token terms exponentiate: exp(20) ~ 5e8, far from float32's
# overflow at exp(88.7), past which one token's inf (or inf * 0 on a masked one) made the loss NaN.
# Past it PPO's clips (ratio > 1 + eps_high, or the dual clip) already hold the gradient at zero.
MAX_LOG_RATIO = 20.0


def grpo_normalise(rewards: torch.Tensor, groups: list[str], eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: within each group of 2+ samples (same prompt id), (r - mean) / std;
    a sample alone in its group keeps its raw reward (the binary signal of the online mode)."""
    out = rewards.clone().float()
    for group in set(groups):
        index = torch.tensor([i for i, g in enumerate(groups) if g == group])
        if len(index) > 1:
            r = rewards[index].float()
            out[index] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return out


def singletons(groups: list[str]) -> torch.Tensor:
    """[n] bool: the samples alone in their group (online traffic: one reply per prompt)."""
    count: dict[str, int] = {}
    for g in groups:
        count[g] = count.get(g, 0) + 1
    return torch.tensor([count[g] == 1 for g in groups], dtype=torch.bool)


def online_advantages(rewards: torch.Tensor, groups: list[str], baseline: float,
                      negative_weight: float) -> torch.Tensor:
    """RL advantage per sample. Groups of 2+ are GRPO-normalised (`grpo_normalise`, unchanged); a
    singleton gets `r - baseline`, times `negative_weight` where that is negative. A lone sample's
    raw reward says only "more" or "less" of what was sampled; against a baseline a batch of mostly
    -1 stops pushing every sampled token down, and `negative_weight` < 1 lets the rarer +1 samples
    (which say where the probability should go) weigh more than the -1 ones."""
    out = grpo_normalise(rewards, groups)
    alone = singletons(groups)
    centred = rewards.float() - baseline
    centred = torch.where(centred < 0, centred * negative_weight, centred)
    return torch.where(alone, centred, out)


def ema_update(value: float, samples: torch.Tensor, decay: float) -> float:
    """An exponential moving average after `samples`, in order: v <- decay * v + (1 - decay) * x."""
    for x in samples.tolist():
        value = decay * value + (1 - decay) * x
    return value


def opd_advantage(teacher: torch.Tensor, behaviour: torch.Tensor, bound: float) -> torch.Tensor:
    """Hindsight-guided OPD: how much more the hint-informed teacher likes each sampled token than
    the policy that sampled it, clipped to [-bound, bound]."""
    return (teacher - behaviour).clamp(-bound, bound)


def combine_advantage(opd: torch.Tensor, reward: torch.Tensor, w_opd: float, w_rl: float) -> torch.Tensor:
    """advantage_t = w_opd * opd_t + w_rl * r (r broadcast over the reply's tokens)."""
    return w_opd * opd + w_rl * reward


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def ppo_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
             eps_low: float, eps_high: float, dual_clip: float = 3.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with the importance ratio pi_theta / pi_behaviour per token, and the
    dual clip (Ye et al. 2020) for negative advantages: there min(r A, clip(r) A) falls without
    bound as r grows (a token the learner now likes far more than the sampler did), so the
    objective is held at `dual_clip * A` or above, with no gradient past it.

    The behaviour logprobs are the ones the engine stored when it sampled, so the ratio corrects
    for the policy having moved since (off-policy samples within the staleness bound).
    Returns the loss and stats: mean ratio, clip fraction (tokens where either clip was binding).
    """
    ratio = torch.exp((logp - behaviour).clamp(max=MAX_LOG_RATIO))
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    objective = torch.where(advantage < 0, torch.maximum(objective, dual_clip * advantage), objective)
    loss = -masked_mean(objective, mask)
    with torch.no_grad():
        binding = (objective != unclipped).float()
        stats = {"ratio": masked_mean(ratio, mask), "clip_frac": masked_mean(binding, mask)}
    return loss, stats


def kl_to_reference(logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi_theta || pi_ref) on sampled tokens: exp(d) - d - 1, d = ref - logp;
    non-negative, unbiased, and low-variance (Schulman's approximation).

    Its value estimates the reverse KL, but its gradient as a loss (the tokens fixed, not
    reweighted) is E_theta[(1 - pi_ref/pi_theta) grad log pi_theta] = grad KL(pi_ref || pi_theta):
    the forward KL's, mass-covering rather than mode-seeking. `kl_estimator = "full"` (the default)
    has the reverse KL's own gradient.

    With the roles swapped, `kl_to_reference(behaviour, logp, mask)` estimates KL(sampler || learner)
    on the tokens the sampler drew: the sampler-vs-learner mismatch.

    d is clamped to +-`MAX_LOG_RATIO` (as verl's `low_var_kl`): exp(d) overflows float32 past 88.7,
    and a token the policy all but ruled out (a masked padding position included) made it inf."""
    d = (reference - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return masked_mean(torch.exp(d) - d - 1, mask)


def stop_kl(teacher: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || policy) of the stop decision at each position: two outcomes, ending the reply
    (logprobs `teacher`, `logp`) or going on. Differentiable in `logp`."""
    def go_on(lp: torch.Tensor) -> torch.Tensor:  # log(1 - p), finite while p < 1
        return torch.log(-torch.expm1(lp.clamp(max=-1e-6)))

    p = teacher.exp()
    return p * (teacher - logp) + (1 - p) * (go_on(teacher) - go_on(logp))


def vocab_kl(logp: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) at each position, over the whole vocabulary.

    `logp`, `reference`: [..., V] log-probabilities (log_softmax outputs); returns [...]. Exact
    gradients for both (the reference is usually a constant: the base model under no_grad)."""
    return _VocabKL.apply(logp, reference)


def vocab_entropy(logp: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum_v p_v log p_v at each position; `logp` [..., V] log-probabilities, returns [...]."""
    return _VocabEntropy.apply(logp)


def entropy_band(entropy: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """A penalty that is zero while the mean entropy is inside [low, high] and grows linearly
    outside: relu(low - H) + relu(H - high). A floor keeps the policy from collapsing onto one
    reply; a ceiling from spreading into word salad; neither pushes inside the band."""
    return torch.relu(low - entropy) + torch.relu(entropy - high)


def advantage_signs(advantage: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How many of the `mask` tokens have a positive, a negative and a zero advantage (counts)."""
    on = mask > 0
    return {"adv_pos": float((advantage[on] > 0).sum()), "adv_neg": float((advantage[on] < 0).sum()),
            "adv_zero": float((advantage[on] == 0).sum())}


def _chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _VocabKL(torch.autograd.Function):
    """f(l, r) = sum_v exp(l_v) (l_v - r_v); df/dl = p (l - r + 1), df/dr = -p. Through log_softmax's
    backward the first becomes p (log p - log q - KL), the familiar gradient of the KL in logits."""

    @staticmethod
    def forward(ctx: Any, logp: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        v = logp.shape[-1]
        flat_p, flat_r = logp.reshape(-1, v), reference.reshape(-1, v)
        out = torch.empty(flat_p.shape[0], dtype=logp.dtype, device=logp.device)
        for s in _chunks(flat_p.shape[0], v):
            out[s] = (flat_p[s].exp() * (flat_p[s] - flat_r[s])).sum(-1)
        ctx.save_for_backward(logp, reference)
        return out.reshape(logp.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        logp, reference = ctx.saved_tensors
        v = logp.shape[-1]
        flat_p, flat_r, flat_g = logp.reshape(-1, v), reference.reshape(-1, v), grad.reshape(-1, 1)
        want_p, want_r = ctx.needs_input_grad
        grad_p = torch.empty_like(flat_p) if want_p else None
        grad_r = torch.empty_like(flat_r) if want_r else None
        for s in _chunks(flat_p.shape[0], v):
            p = flat_p[s].exp() * flat_g[s]
            if grad_p is not None:
                grad_p[s] = p * (flat_p[s] - flat_r[s] + 1)
            if grad_r is not None:
                grad_r[s] = -p
        return (grad_p.reshape(logp.shape) if grad_p is not None else None,
                grad_r.reshape(reference.shape) if grad_r is not None else None)


class _VocabEntropy(torch.autograd.Function):
    """f(l) = -sum_v exp(l_v) l_v; df/dl = -p (l + 1), which log_softmax's backward turns into
    -p (log p + H)."""

    @staticmethod
    def forward(ctx: Any, logp: torch.Tensor) -> torch.Tensor:
        v = logp.shape[-1]
        flat = logp.reshape(-1, v)
        out = torch.empty(flat.shape[0], dtype=logp.dtype, device=logp.device)
        for s in _chunks(flat.shape[0], v):
            out[s] = -(flat[s].exp() * flat[s]).sum(-1)
        ctx.save_for_backward(logp)
        return out.reshape(logp.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (logp,) = ctx.saved_tensors
        v = logp.shape[-1]
        flat, flat_g = logp.reshape(-1, v), grad.reshape(-1, 1)
        out = torch.empty_like(flat)
        for s in _chunks(flat.shape[0], v):
            out[s] = -flat[s].exp() * (flat[s] + 1) * flat_g[s]
        return out.reshape(logp.shape)
