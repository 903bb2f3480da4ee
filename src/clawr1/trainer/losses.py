"""The training objectives, as pure functions on per-token tensors (shape [tokens] or [B, T]).

Every function takes a `mask` (1 = a reply token that trains) so padding and masked samples cost
nothing. Losses are token-level means over the unmasked tokens of the whole batch (DAPO-style),
so a long reply does not count less per token than a short one.
"""

from __future__ import annotations

import torch


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
             eps_low: float, eps_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with the importance ratio pi_theta / pi_behaviour per token.

    The behaviour logprobs are the ones the engine stored when it sampled, so the ratio corrects
    for the policy having moved since (off-policy samples within the staleness bound).
    Returns the loss and stats: mean ratio, clip fraction (tokens where the clip was binding).
    """
    ratio = torch.exp(logp - behaviour)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    loss = -masked_mean(objective, mask)
    with torch.no_grad():
        binding = (clipped < unclipped).float()
        stats = {"ratio": masked_mean(ratio, mask), "clip_frac": masked_mean(binding, mask)}
    return loss, stats


def kl_to_reference(logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi_theta || pi_ref) on sampled tokens: exp(d) - d - 1, d = ref - logp;
    non-negative, unbiased, and low-variance (Schulman's approximation)."""
    d = reference - logp
    return masked_mean(torch.exp(d) - d - 1, mask)
