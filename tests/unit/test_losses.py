"""The objectives against hand-computed values."""

import math

import pytest
import torch

from clawr1.trainer import head
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


# ---- the whole-vocabulary terms, the baseline, the advantage signs ---------------------------------
from types import SimpleNamespace  # noqa: E402

from clawr1.core.config import TrainerConfig  # noqa: E402
from clawr1.trainer import losses  # noqa: E402
from clawr1.trainer.batch import rl_advantages  # noqa: E402
from clawr1.trainer.losses import (  # noqa: E402
    advantage_signs,
    ema_update,
    entropy_band,
    online_advantages,
    singletons,
    vocab_entropy,
    vocab_kl,
)


def _distributions(*shape, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=generator, dtype=dtype) * 2, dim=-1)


def test_vocab_kl_and_entropy_are_the_sums_over_the_vocabulary():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    kl = vocab_kl(p.log(), q.log())
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0 + 0.25 * math.log(0.5))
    assert kl[1].item() == pytest.approx(sum(pi * math.log(pi * 3) for pi in (0.9, 0.05, 0.05)))
    assert vocab_kl(p.log(), p.log()).tolist() == pytest.approx([0.0, 0.0])
    entropy = vocab_entropy(p.log())
    assert entropy[0].item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert vocab_entropy(torch.full((1, 7), -math.log(7.0), dtype=torch.float64)).item() == pytest.approx(math.log(7))


def test_vocab_terms_have_exact_gradients_in_every_shape_and_chunking(monkeypatch):
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    reference = _distributions(2, 3, 5, seed=1).requires_grad_()
    for chunk in (losses.CHUNK_ELEMENTS, 5, 10):  # one chunk; one position a chunk; two
        monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk)
        assert torch.autograd.gradcheck(lambda x, r: vocab_kl(torch.log_softmax(x, -1), r), (logits, reference))
        assert torch.autograd.gradcheck(lambda x: vocab_entropy(torch.log_softmax(x, -1)), (logits,))
    # In logits the familiar forms: dKL/dx = p (log p - log q - KL), dH/dx = -p (log p + H).
    logp = torch.log_softmax(logits, -1)
    kl, h = vocab_kl(logp, reference.detach()), vocab_entropy(logp)
    (grad_kl,) = torch.autograd.grad(kl.sum(), logits, retain_graph=True)
    (grad_h,) = torch.autograd.grad(h.sum(), logits)
    p = logp.exp().detach()
    assert torch.allclose(grad_kl, p * (logp.detach() - reference.detach() - kl.detach()[..., None]))
    assert torch.allclose(grad_h, -p * (logp.detach() + h.detach()[..., None]))


def test_vocab_kl_matches_the_naive_formula_in_float32_on_a_real_vocabulary(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 3 * 49152)  # 3 positions a chunk: 4 chunks of 10 rows
    logp, ref = _distributions(2, 5, 49152, dtype=torch.float32), _distributions(2, 5, 49152, seed=1,
                                                                                  dtype=torch.float32)
    naive = (logp.exp() * (logp - ref)).sum(-1)
    assert torch.allclose(vocab_kl(logp, ref), naive, rtol=1e-5, atol=1e-6)
    assert torch.allclose(vocab_entropy(logp), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-6)


def test_entropy_band_is_zero_inside_and_linear_outside():
    band = [entropy_band(torch.tensor(h), 1.0, 3.0).item() for h in (0.25, 1.0, 2.0, 3.0, 4.5)]
    assert band == pytest.approx([0.75, 0.0, 0.0, 0.0, 1.5])
    h = torch.tensor(0.5, requires_grad=True)
    entropy_band(h, 1.0, 3.0).backward()
    assert h.grad.item() == -1.0  # below the floor: descending the penalty raises the entropy


def test_a_singleton_is_judged_against_the_baseline_and_negatives_are_scaled():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])
    groups = ["a", "a", "b", "c", "d"]
    assert singletons(groups).tolist() == [False, False, True, True, True]
    out = online_advantages(rewards, groups, baseline=-0.5, negative_weight=0.25)
    # group a: GRPO, as before; b, d: (-1 + 0.5) * 0.25; c: 1 + 0.5
    assert out[:2].tolist() == pytest.approx(grpo_normalise(rewards[:2], ["a", "a"]).tolist())
    assert out[2:].tolist() == pytest.approx([-0.125, 1.5, -0.125])
    assert online_advantages(rewards, groups, 0.0, 1.0).tolist() == grpo_normalise(rewards, groups).tolist()


def test_ema_update_in_order():
    assert ema_update(0.0, torch.tensor([1.0, -1.0]), decay=0.5) == pytest.approx(-0.25)  # 0 -> 0.5 -> -0.25
    assert ema_update(0.3, torch.tensor([]), decay=0.9) == 0.3


def test_batch_advantages_use_the_baseline_from_before_the_batch_then_update_it():
    def sample(reward, prompt):
        return SimpleNamespace(reward=reward, relabelled=False, step=SimpleNamespace(prompt_id=prompt))

    batch = [sample(-1.0, "p1"), sample(None, "p2"), sample(1.0, "p3"), sample(1.0, "g"), sample(-1.0, "g")]
    config = TrainerConfig(baseline="ema", baseline_decay=0.5, negative_weight=0.5)
    advantage, baseline = rl_advantages(batch, config, baseline=-0.5)
    # p1: (-1 + 0.5) * 0.5; p2: no reward, no signal; p3: 1 + 0.5; the group: +-1 (GRPO)
    assert advantage.tolist() == pytest.approx([-0.25, 0.0, 1.5, 1.0, -1.0], abs=1e-5)
    assert baseline == pytest.approx(0.5 * (0.5 * -0.5 + 0.5 * -1.0) + 0.5 * 1.0)  # p1 then p3; not the group
    plain, same = rl_advantages(batch, TrainerConfig(baseline="none", negative_weight=1.0), baseline=-0.5)
    assert plain.tolist() == pytest.approx([-1.0, 0.0, 1.0, 1.0, -1.0], abs=1e-5) and same == -0.5


def test_advantage_signs_count_the_masked_tokens():
    advantage = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert advantage_signs(advantage, mask) == {"adv_pos": 1.0, "adv_neg": 2.0, "adv_zero": 2.0}


def test_sampler_kl_is_k3_with_the_roles_swapped():
    behaviour = torch.log(torch.tensor([0.5, 0.2]))
    learner = torch.log(torch.tensor([0.4, 0.3]))
    r = learner.exp() / behaviour.exp()  # pi_learner / pi_sampler on tokens the sampler drew
    expected = (r - 1 - r.log()).mean().item()
    assert kl_to_reference(behaviour, learner, torch.ones(2)).item() == pytest.approx(expected)


def test_two_turns_of_one_session_are_not_one_grpo_group():
    """Online turns carry their own prompt ids (the gateway's `session/tN`): equal rewards on two
    turns of one session keep their advantage; they were normalised together to zero when the
    group id was the session id."""
    from clawr1.core.config import TrainerConfig
    from clawr1.trainer.batch import rl_advantages

    def sample(prompt: str, reward: float) -> SimpleNamespace:
        return SimpleNamespace(reward=reward, relabelled=False, step=SimpleNamespace(prompt_id=prompt))

    config = TrainerConfig(baseline="none", negative_weight=1.0)
    online, _ = rl_advantages([sample("s1/t0", 1.0), sample("s1/t1", 1.0)], config, 0.0)
    assert online.tolist() == [1.0, 1.0]
    as_before, _ = rl_advantages([sample("s1", 1.0), sample("s1", 1.0)], config, 0.0)
    assert as_before.tolist() == [0.0, 0.0]  # what one group per session did


def test_a_sample_without_a_reward_is_no_member_of_its_grpo_group():
    """A hint-only sample (reward 0 or None) trains by distillation only: it must not move its
    group's mean and spread, or two +1 replies get +0.7 each instead of 0, and a +1 beside it
    is normalised instead of judged against the baseline."""
    from clawr1.core.config import TrainerConfig
    from clawr1.trainer.batch import rl_advantages

    def sample(reward: float | None) -> SimpleNamespace:
        return SimpleNamespace(reward=reward, relabelled=False, step=SimpleNamespace(prompt_id="p"))

    config = TrainerConfig(baseline="ema", negative_weight=1.0)
    for unrewarded in (0.0, None):
        with_it, _ = rl_advantages([sample(1.0), sample(1.0), sample(unrewarded)], config, 0.0)
        without, _ = rl_advantages([sample(1.0), sample(1.0)], config, 0.0)
        assert with_it.tolist() == pytest.approx([*without.tolist(), 0.0], abs=1e-6) == [0.0, 0.0, 0.0]
        alone, baseline = rl_advantages([sample(1.0), sample(unrewarded)], config, 0.25)
        assert alone.tolist() == pytest.approx([0.75, 0.0]) and baseline != 0.25  # a singleton: r - baseline


@pytest.mark.parametrize("terms", [("logp",), ("entropy",), ("kl",), ("stop",), ("logp", "kl"),
                                   ("logp", "entropy", "kl", "teacher", "stop")])
@pytest.mark.parametrize("temperatures", ["one", "mixed"])
def test_the_fused_head_has_the_gradients_of_the_naive_log_softmax(monkeypatch, terms, temperatures):
    """Each output of `head_stats` alone (the backward's shortcuts: softmax only for the target's
    term, the temperature pass skipped at 1) and together, against autograd through the full
    [n, V] log-softmax; three positions a chunk."""
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 3 * 301)
    gen = torch.Generator().manual_seed(len(terms))
    n, hidden_size, vocab = 10, 16, 301
    hidden = torch.randn(n, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    reference, teacher = torch.randn(n, hidden_size, generator=gen), torch.randn(n, hidden_size, generator=gen)
    teacher_weight = torch.randn(vocab, hidden_size, generator=gen)
    targets, stop = torch.randint(0, vocab, (n,), generator=gen), torch.tensor([3, 7])
    inv_t = torch.ones(n) if temperatures == "one" else 1 / torch.linspace(0.5, 1.5, n)
    coefficients = {term: torch.randn(n, generator=gen) for term in ("logp", "entropy", "kl", "teacher", "stop")}

    def naive(h, w):
        logp = torch.log_softmax(h @ w.T * inv_t[:, None], -1)
        p = logp.exp()
        return {"logp": logp.gather(-1, targets[:, None]).squeeze(-1), "entropy": -(p * logp).sum(-1),
                "kl": (p * (logp - torch.log_softmax(reference @ w.detach().T * inv_t[:, None], -1))).sum(-1),
                "teacher": (p * (logp - torch.log_softmax(teacher @ teacher_weight.T * inv_t[:, None], -1))).sum(-1),
                "stop": torch.logsumexp(logp[:, stop], -1),
                "ref_logp": torch.log_softmax(reference @ w.detach().T * inv_t[:, None], -1).gather(
                    -1, targets[:, None]).squeeze(-1)}

    def fused(h, w):
        outs = head.head_stats(h, w, targets, inv_t, reference, None, teacher, teacher_weight, stop)
        return dict(zip(("logp", "entropy", "kl", "teacher", "stop", "ref_logp"), outs, strict=True))

    grads = []
    for fn in (naive, fused):
        values = fn(hidden, weight)
        loss = sum((values[term] * coefficients[term]).sum() for term in terms)
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
        for term, value in values.items():  # every output's value, used in the loss or not
            assert torch.allclose(value, naive(hidden, weight)[term], atol=1e-5), term
    for got, expected in zip(grads[1], grads[0], strict=True):
        assert float((got - expected).norm() / expected.norm()) < 1e-5, terms


def test_dual_clip_bounds_a_negative_advantage_and_nothing_overflows():
    """A token the learner now likes e^30 times more than the sampler did, with a negative
    advantage: min(r A, clip(r) A) was -1e13 (and past e^88.7 the ratio was inf, the loss NaN).
    The dual clip holds it at 3 A with no gradient; a positive advantage is clipped as before;
    the k3 term on a token the reference all but ruled out stays finite."""
    behaviour = torch.tensor([-40.0, -40.0, -200.0, -1.0])
    logp = torch.tensor([-10.0, -10.0, -1.0, -1.0], requires_grad=True)
    adv = torch.tensor([-1.0, 1.0, -2.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last is masked: it must not turn the mean into NaN
    loss, stats = ppo_loss(logp, behaviour, adv, mask, 0.2, 0.28, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(3.0 * -1.0 + 1.28 * 1.0 + 3.0 * -2.0) / 3)
    assert torch.isfinite(logp.grad).all() and logp.grad.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert stats["clip_frac"].item() == pytest.approx(1.0) and math.isfinite(stats["ratio"].item())
    within = ppo_loss(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])), torch.tensor([-1.0]),
                      torch.ones(1), 0.2, 0.28, dual_clip=3.0)[0]
    assert within.item() == pytest.approx(2.0)  # ratio 2 < 3: min(-2, -1.28) = -2, the dual clip not binding
    reference, far = torch.tensor([0.0]), torch.tensor([-200.0], requires_grad=True)
    k3 = kl_to_reference(far, reference, torch.ones(1))
    k3.backward()
    assert math.isfinite(k3.item()) and k3.item() > 1e8 and torch.isfinite(far.grad).all()
