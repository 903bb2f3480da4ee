"""The trainer on any device and dtype, with the same maths: the fused, chunked head equals the
unchunked log-softmax (values and gradients, the KLs to the base and to the hinted teacher too), a
bfloat16 base gives the float32 update within bfloat16's precision with float32 master weights
(multiplied in bfloat16: mixed precision), token-budget micro-batches and gradient checkpointing
change nothing but memory, and impossible placements fail with the fix in the message."""

from __future__ import annotations

import pytest
import torch

from clawr1.datapool import SQLitePool
from clawr1.trainer import head
from clawr1.trainer.batch import TrainSample, _teacher_rows, prepare
from clawr1.trainer.loop import Trainer, micro_batches
from clawr1.trainer.losses import masked_mean, vocab_entropy, vocab_kl
from clawr1.trainer.policy import Policy, placement, token_logprobs
from tests.unit.test_trainer import config_for, step_of


@pytest.fixture(scope="module")
def realistic_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's shape initialised as real checkpoints are (std 0.02): the tiny model's std
    0.5 makes it chaotic, so bfloat16's rounding of the base weights alone moves its logits by
    whole nats, which says nothing about the trainer's precision."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.initializer_range = 0.02
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-realistic")
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def samples_of(generations, n=6) -> list[TrainSample]:
    return [TrainSample(step_of(i, *generations[i]), 1.0 if i % 2 else -1.0) for i in range(n)]


def trainer_for(tiny_model_dir, data_dir, *extra) -> Trainer:
    config = config_for(tiny_model_dir, data_dir, 'trainer.method="rl"', *extra)
    pool = SQLitePool(data_dir, config.pool)
    return Trainer(config, pool, resume=False)


def moved(trainer: Trainer) -> None:
    """Put the LoRA off zero, so policy and base differ (the KL and its gradient are not trivial)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.policy.named_trainable().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone().float() for n, p in trainer.policy.named_trainable().items()}


def test_the_chunked_head_equals_the_unchunked_log_softmax(tiny_model_dir, tmp_path, generations, monkeypatch):
    trainer = trainer_for(tiny_model_dir, tmp_path, 'trainer.method="combine"', 'trainer.opd_estimator="full"')
    moved(trainer)
    policy, samples = trainer.policy, samples_of(generations)
    for i in (0, 2, 3):
        samples[i].hint = "Answer in one short sentence."
    m = prepare(policy, samples, trainer.tc, torch.ones(len(samples)))
    assert m.teacher is not None and m.distill is not None
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 3 * len(policy.tokenizer))  # three positions a chunk
    assert len(head.chunks(int(m.mask.sum()), len(policy.tokenizer))) > 10

    # The unchunked references: the model's own logits, log_softmax over [B, K, V]; the teacher's
    # from the hint-augmented contexts (base weights), right-aligned on the same reply tokens.
    full = policy.distributions(m.rows)
    with torch.no_grad(), policy.adapter_off():
        base = policy.distributions(m.rows)
        hinted = policy.distributions(_teacher_rows(policy, samples, [0, 2, 3], trainer.tc.hint_at))
    teacher = base.clone()
    for j, i in enumerate((0, 2, 3)):
        n = len(samples[i].step.token_ids)
        teacher[i, -n:] = hinted[j, -n:]
    on = m.mask > 0
    ref_logp, ref_entropy = token_logprobs(full, m.rows), vocab_entropy(full)
    ref_kl, ref_teacher = vocab_kl(full, base), vocab_kl(full, teacher)
    # The chance of ending the reply at each position (`stop_coef`), over two end ids: their summed probability.
    policy.stop_ids = [*policy.stop_ids, 5]
    ref_stop = torch.logsumexp(full[..., policy.stop_ids], -1)
    ref_loss = (masked_mean(ref_logp, m.mask) + masked_mean(ref_entropy, m.mask) + masked_mean(ref_kl, m.mask)
                + masked_mean(ref_teacher, m.distill) + masked_mean(ref_stop, m.mask))
    ref_loss.backward()
    expected = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)

    logp, entropy, kl, kl_teacher, stop, base_logp = policy.stats(m.rows, m.mask, reference=True, teacher=m.teacher,
                                                                  teacher_head=m.teacher_head, stop=True)
    assert torch.allclose(base_logp[on], token_logprobs(base, m.rows)[on], atol=1e-5)  # the k3 estimator's input
    hint = m.distill > 0
    assert torch.allclose(logp[on], ref_logp[on], atol=1e-5)
    assert torch.allclose(entropy[on], ref_entropy[on], atol=1e-5)
    assert torch.allclose(kl[on], ref_kl[on], atol=1e-5) and kl[on].max() > 1e-4
    assert torch.allclose(kl_teacher[hint], ref_teacher[hint], atol=1e-5) and kl_teacher[hint].max() > 1e-3
    assert torch.allclose(stop[on], ref_stop[on], atol=1e-5)
    assert torch.allclose(policy.logprobs_and_stop(m.rows)[1][on], ref_stop[on].detach(), atol=1e-5)
    assert hint.sum() < on.sum()  # the samples without a hint have no teacher term
    assert torch.allclose(policy.logprobs(m.rows)[on], ref_logp[on].detach(), atol=1e-5)
    (masked_mean(logp, m.mask) + masked_mean(entropy, m.mask) + masked_mean(kl, m.mask)
     + masked_mean(kl_teacher, m.distill) + masked_mean(stop, m.mask)).backward()
    for name, g in grads(trainer).items():  # float32 sums in another order: equal to ~1e-6 relative
        assert float((g - expected[name]).norm() / expected[name].norm()) < 1e-4, name
    assert sum(float(g.abs().sum()) for g in expected.values()) > 0


def test_a_bfloat16_base_trains_float32_lora_with_the_float32_update(realistic_model_dir, tmp_path, generations):
    samples = samples_of(generations)  # the tiny engine's tokens; their behaviour logprobs are another model's
    runs = {}
    for dtype in ("float32", "bfloat16"):
        trainer = trainer_for(realistic_model_dir, tmp_path / dtype, f'trainer.dtype="{dtype}"', "trainer.batch_size=6",
                              "trainer.micro_batch=6", "trainer.kl_coef=0.1",
                              "trainer.grad_clip=1000")  # raw gradients (a clip would rescale both alike)
        moved(trainer)
        base_dtypes = {p.dtype for n, p in trainer.policy.model.named_parameters() if "lora_" not in n}
        assert base_dtypes == {getattr(torch, dtype)}
        assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}  # master weights
        before = {n: p.detach().clone() for n, p in trainer.policy.named_trainable().items()}
        original_step = trainer.optimizer.step
        seen: dict[str, torch.Tensor] = {}

        def step(*args, _trainer=trainer, _seen=seen, _step=original_step, **kwargs):
            _seen.update(grads(_trainer))
            return _step(*args, **kwargs)

        trainer.optimizer.step = step
        # Mixed precision: the float32 LoRA weights are multiplied in the base's dtype (autocast),
        # not each LoRA input cast up to float32.
        active = trainer.policy.model.active_adapter
        lora_a = next(m for n, m in trainer.policy.model.named_modules() if n.endswith(f"lora_A.{active}"))
        computed: set[torch.dtype] = set()
        hook = lora_a.register_forward_hook(lambda _m, _i, out, _seen=computed: _seen.add(out.dtype))
        metrics = trainer.train_step(samples)
        hook.remove()
        assert computed == {getattr(torch, dtype)}
        assert metrics is not None and metrics["tokens"] > 0
        runs[dtype] = (seen, {n: p.detach() - before[n] for n, p in trainer.policy.named_trainable().items()})
    (g32, u32), (g16, u16) = runs["float32"], runs["bfloat16"]
    flat = {k: torch.cat([d[n].flatten() for n in sorted(d)]) for k, d in
            {"g32": g32, "g16": g16, "u32": u32, "u16": u16}.items()}
    # bfloat16 keeps 8 bits of mantissa: the gradient within a few percent, pointing the same way.
    assert (flat["g16"] - flat["g32"]).norm() / flat["g32"].norm() < 0.1
    assert torch.cosine_similarity(flat["g16"], flat["g32"], dim=0) > 0.99
    assert torch.cosine_similarity(flat["u16"], flat["u32"], dim=0) > 0.95 and flat["u16"].abs().max() > 0


def test_token_budget_micro_batches_and_checkpointing_change_nothing_but_memory(tiny_model_dir, tmp_path,
                                                                                 generations):
    samples = samples_of(generations)
    lengths = [len(s.step.prompt_ids) + len(s.step.token_ids) for s in samples]
    cut = micro_batches(samples, budget=2 * max(lengths), max_rows=4)
    assert sorted(i for batch in cut for i in batch) == list(range(len(samples)))
    assert all(len(b) * max(lengths[i] for i in b) <= 2 * max(lengths) for b in cut) and len(cut) >= 3
    assert micro_batches(samples, budget=1, max_rows=4) == [[i] for i in sorted(range(6), key=lengths.__getitem__)]
    assert len(micro_batches(samples, budget=10**6, max_rows=4)) == 2  # the row cap still holds

    results = []
    for extra in (("trainer.micro_batch_tokens=100000", "trainer.micro_batch=6"),
                  ("trainer.micro_batch_tokens=64", "trainer.grad_checkpointing=true")):
        trainer = trainer_for(tiny_model_dir, tmp_path / extra[0], "trainer.batch_size=6", "trainer.kl_coef=0.1",
                              *extra)
        moved(trainer)
        assert trainer.policy.causal_lm.is_activation_checkpointing == ("trainer.grad_checkpointing=true" in extra)
        trainer.optimizer.step = lambda *a, _t=trainer, **k: results.append(grads(_t))
        trainer.train_step(samples)
    one, many = results
    for name in one:
        assert float((one[name] - many[name]).norm() / one[name].norm()) < 1e-4, name


def test_impossible_placements_fail_with_the_fix(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path, 'trainer.device="cpu"').trainer
    assert placement(config) == (torch.device("cpu"), torch.float32)
    if not torch.cuda.is_available():
        cuda = config_for(tiny_model_dir, tmp_path, 'trainer.device="cuda:1"').trainer
        with pytest.raises(ValueError, match="sees no CUDA device"):
            placement(cuda)
        auto = config_for(tiny_model_dir, tmp_path, 'trainer.device="auto"').trainer
        assert placement(auto) == (torch.device("cpu"), torch.float32)
    quant = config_for(tiny_model_dir, tmp_path, 'trainer.device="cpu"', 'trainer.quantize="4bit"').trainer
    with pytest.raises(ValueError, match="needs a CUDA trainer.device"):
        Policy(tiny_model_dir, quant)
    with pytest.raises(ValueError, match="needs trainer.finetune"):
        config_for(tiny_model_dir, tmp_path, 'trainer.quantize="8bit"', 'trainer.finetune="full"')
    with pytest.raises(ValueError, match="the LM head and the embeddings take no adapter"):
        config_for(tiny_model_dir, tmp_path, 'trainer.lora_targets=["q_proj","lm_head"]')


def test_auto_dtype_is_float32_on_a_card_without_bfloat16_and_collectives_outlast_the_guard(tiny_model_dir, tmp_path,
                                                                                            monkeypatch):
    from clawr1.trainer import policy
    from clawr1.trainer.ranks import group_timeout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for supported, expected in ((False, torch.float32), (True, torch.bfloat16)):  # a T4 or V100, then an A100
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        assert policy.placement(config_for(tiny_model_dir, tmp_path, 'trainer.device="auto"').trainer)[1] == expected
        full = config_for(tiny_model_dir, tmp_path, 'trainer.device="auto"', 'trainer.finetune="full"').trainer
        assert policy.placement(full)[1] == expected  # full fine-tuning too: mixed precision over float32 weights
    with pytest.raises(ValueError, match="trainer.dtype"):
        config_for(tiny_model_dir, tmp_path, 'trainer.dtype="float16"')  # no loss scaling: not offered
    # Rank 0 waits up to guard.decision_timeout_s for a verdict while the others wait in a collective.
    assert group_timeout(300.0) == 600.0 and group_timeout(3600.0) > 3600.0
