"""The objectives against hand-computed values."""

import math

import pytest
import torch

from clawr1.trainer.losses import (
    combine_advantage,
    grpo_normalise,
    kl_to_reference,
    masked_mean,
    opd_advantage,
    ppo_loss,
)


def test_ppo_ratio_and_asymmetric_clip():
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    # ratios 1.0, 1.5 (above 1 + 0.28), 0.5 (below 1 - 0.2), 1.1
    logp = torch.log(torch.tensor([0.5, 0.75, 0.25, 0.55]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4)
    loss, stats = ppo_loss(logp, behaviour, adv, mask, eps_low=0.2, eps_high=0.28)
    # per token min(r*A, clip(r)*A): 1.0, min(1.5, 1.28) = 1.28, min(-0.5, -0.8) = -0.8, -1.1
    expected = -(1.0 + 1.28 - 0.8 - 1.1) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 4)
    assert stats["ratio"].item() == pytest.approx((1.0 + 1.5 + 0.5 + 1.1) / 4, abs=1e-6)


def test_clipped_tokens_get_no_gradient_and_masking_excludes_tokens():
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    logp = torch.log(torch.tensor([0.75, 0.5, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss, _ = ppo_loss(logp, behaviour, adv, mask, 0.2, 0.28)
    loss.backward()
    # token 0 is clipped (ratio 1.5 > 1.28 with A > 0): zero gradient; token 1: -A * ratio / 2 tokens
    assert logp.grad[0].item() == 0.0
    assert logp.grad[1].item() == pytest.approx(-0.5)
    assert logp.grad[2].item() == 0.0  # masked
    assert loss.item() == pytest.approx(-(1.28 + 1.0) / 2)


def test_positive_advantage_pushes_logprob_up_negative_down():
    behaviour = torch.zeros(2)
    logp = torch.zeros(2, requires_grad=True)
    loss, _ = ppo_loss(logp, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2), 0.2, 0.28)
    loss.backward()
    assert logp.grad[0] < 0 < logp.grad[1]  # gradient descent raises token 0, lowers token 1


def test_opd_sign_and_bound():
    teacher = torch.tensor([-0.1, -3.0, -1.0])
    behaviour = torch.tensor([-2.0, -0.5, -1.0])
    adv = opd_advantage(teacher, behaviour, bound=1.5)
    # the teacher (with the hint) likes token 0 more: positive; token 1 less: negative; clipped
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0])


def test_combine_weighting():
    opd = torch.tensor([0.5, -0.25])
    out = combine_advantage(opd, torch.tensor(-1.0), w_opd=2.0, w_rl=0.5)
    assert out.tolist() == pytest.approx([2 * 0.5 - 0.5, 2 * -0.25 - 0.5])


def test_grpo_normalisation_per_group():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    out = grpo_normalise(rewards, ["a", "a", "a", "b", "c"])
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 3)
    assert out[:3].tolist() == pytest.approx([(1 - mean) / std, (-1 - mean) / std, (1 - mean) / std], abs=1e-5)
    assert out[3:].tolist() == [1.0, -1.0]  # singletons keep the raw binary reward


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    ref = torch.log(torch.tensor([0.3, 0.6]))
    mask = torch.ones(2)
    assert kl_to_reference(ref, ref, mask).item() == pytest.approx(0.0)
    d = torch.log(torch.tensor([0.3, 0.6])) - torch.log(torch.tensor([0.5, 0.2]))
    expected = (torch.exp(d) - d - 1).mean().item()
    assert kl_to_reference(torch.log(torch.tensor([0.5, 0.2])), ref, mask).item() == pytest.approx(expected)
    assert expected > 0


def test_masked_mean_ignores_masked_and_survives_empty():
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 0.0])).item() == 2.0
    assert masked_mean(torch.tensor([1.0]), torch.tensor([0.0])).item() == 0.0
