"""The training queue: leases, acks, expiry, staleness and the fresh/off-policy mix.

Real pools on both backends (a SQLite file, a PostgreSQL server); no mocks. Expiry moves the
pool's clock (the `pool_later` fixture) instead of sleeping.
"""

import pytest

from clawr1.core.config import PoolConfig
from clawr1.core.records import Reward, Step
from clawr1.datapool import DataPool, UnknownLeaseError


def ready_steps(pool: DataPool, count: int, version: int = 0, prefix: str = "s") -> list[str]:
    """Store `count` rewarded main turns produced by `version`; return their ids."""
    ids = [f"{prefix}{version}-{i}" for i in range(count)]
    pool.append_steps(Step(step_id=i, tenant="default", session_id=i, prompt_id=i, turn_index=0, turn_type="main",
                           messages=[{"role": "user", "content": "hi"}], tools=None, prompt_ids=[1], token_ids=[2],
                           logprobs=[-0.5], text="hello", policy_version=version, adapter=None,
                           finish_reason="stop", temperature=1.0) for i in ids)
    for future in [pool.submit_reward(Reward(step_id=i, score=1.0, source="judge")) for i in ids]:
        future.result()
    return ids


@pytest.fixture
def open_pool(open_test_pool):
    """`open_pool(**config)`: a pool on each backend (SQLite file, PostgreSQL); `like=` another pool
    opens a second one on the same database, as a second process would."""
    return lambda like=None, **config: open_test_pool(PoolConfig(**config), like=like)


def test_lease_then_ack_consumes_exactly_once(open_pool):
    with open_pool() as pool:
        ids = ready_steps(pool, 10)
        first = pool.lease(4)
        second = pool.lease(100)
        assert len(first) == 4 and len(second) == 6
        assert set(first.step_ids) | set(second.step_ids) == set(ids)
        assert first.samples[0].reward == 1.0 and first.samples[0].weight == 1.0
        assert len(pool.lease(5)) == 0  # nothing READY left
        assert pool.ack(first) == 4
        assert pool.ack(second.lease_id) == 6
        stats = pool.stats()
        assert (stats["ready"], stats["leased"], stats["consumed"], stats["open_leases"]) == (0, 0, 10, 0)


def test_a_double_ack_is_harmless(open_pool):
    with open_pool() as pool:
        ready_steps(pool, 3)
        lease = pool.lease(3)
        assert pool.ack(lease) == 3
        assert pool.ack(lease) == 0
        assert pool.ack(pool.lease(3)) == 0  # an empty lease
        assert pool.stats()["consumed"] == 3
        with pytest.raises(UnknownLeaseError):
            pool.ack("no-such-lease")


def test_an_expired_lease_returns_its_samples(open_pool, pool_later):
    with open_pool(lease_seconds=60) as pool:
        ids = ready_steps(pool, 5)
        crashed = pool.lease(5)  # a trainer takes them, then dies without acking
        assert pool.stats()["leased"] == 5
        pool_later(59)
        assert pool.expire_leases() == 0  # not yet
        pool_later(2)
        assert pool.expire_leases() == 5
        assert pool.stats()["ready"] == 5
        retry = pool.lease(3)
        assert set(retry.step_ids) <= set(ids)
        # The crashed trainer's late ack consumes only what nobody leased again: no sample twice.
        assert pool.ack(crashed) == 2
        assert pool.ack(retry) == 3
        assert pool.stats()["consumed"] == 5


def test_lease_expiry_is_applied_by_lease_and_ack_too(open_pool, pool_later):
    with open_pool(lease_seconds=60) as pool:
        ready_steps(pool, 2)
        first = pool.lease(2)
        pool_later(61)
        again = pool.lease(2)  # no explicit expire_leases(): lease() sweeps first
        assert set(again.step_ids) == set(first.step_ids)
        pool_later(61)
        assert pool.ack(again) == 2  # expired but not leased again: still consumed, once
        assert pool.ack(first) == 0


def test_stale_samples_are_dropped_with_the_reason(open_pool):
    with open_pool(max_staleness=2) as pool:
        old = ready_steps(pool, 3, version=0)
        ok = ready_steps(pool, 3, version=3)
        lease = pool.lease(10, current_version=5)  # bound 2: version 3 is fine, version 0 is not
        assert set(lease.step_ids) == set(ok)
        stats = pool.stats()
        assert stats["dropped"] == 3 and stats["dropped_by_reason"] == {"stale": 3}
        assert pool.show(old[0])["sample"]["reason"] == "stale"
        assert len(pool.lease(10, max_staleness=100, current_version=5)) == 0  # dropped stays dropped


def test_stale_samples_can_be_downweighted_instead(open_pool):
    with open_pool(stale_policy="downweight", stale_weight=0.25) as pool:
        old = ready_steps(pool, 2, version=0)
        fresh = ready_steps(pool, 2, version=9)
        lease = pool.lease(4, max_staleness=1, current_version=9)
        weights = {s.step_id: (s.weight, s.reason) for s in lease.samples}
        assert all(weights[i] == (0.25, "stale") for i in old)
        assert all(weights[i] == (1.0, None) for i in fresh)
        assert pool.stats()["dropped"] == 0


def test_fresh_and_off_policy_samples_mix_by_the_configured_fraction(open_pool):
    with open_pool(fresh_fraction=0.75, max_staleness=10) as pool:
        older = ready_steps(pool, 20, version=1)
        fresh = ready_steps(pool, 20, version=2)
        lease = pool.lease(8, current_version=2)
        assert sum(i in fresh for i in lease.step_ids) == 6 and sum(i in older for i in lease.step_ids) == 2
        pool.ack(lease)
        # When one kind runs short the other fills in, so a lease is never smaller than what is READY.
        lease = pool.lease(100, current_version=2)
        assert len(lease) == 32


def test_fresh_samples_are_leased_oldest_first(open_pool):
    with open_pool(fresh_fraction=1.0) as pool:
        first = ready_steps(pool, 3, prefix="first")
        ready_steps(pool, 3, prefix="later")
        assert list(pool.lease(3).step_ids) == first


def test_two_pools_on_one_file_share_the_queue(open_pool):
    with open_pool() as gateway, open_pool(like=gateway) as trainer:  # as two processes would
        ready_steps(gateway, 6)
        lease = trainer.lease(6)
        assert len(lease) == 6 and gateway.stats()["leased"] == 6
        assert trainer.ack(lease) == 6 and gateway.stats()["consumed"] == 6


def test_bad_lease_arguments(open_pool):
    with open_pool() as pool:
        with pytest.raises(ValueError):
            pool.lease(0)
        with pytest.raises(ValueError):
            pool.lease(4, max_staleness=-1)


def test_hold_out_takes_each_sessions_earliest_untrained_turn_one_session_each(open_pool):
    """The guard's probes: first turns carry their own topic (a later turn is often a reaction)."""
    with open_pool() as pool:
        for turn in range(3):
            pool.append_steps(Step(step_id=f"{s}-t{turn}", tenant="default", session_id=s, prompt_id=s, turn_index=turn,
                                   turn_type="main", messages=[{"role": "user", "content": f"{s} {turn}"}], tools=None,
                                   prompt_ids=[1], token_ids=[2], logprobs=[-0.5], text="hello", policy_version=0,
                                   adapter=None, finish_reason="stop", temperature=1.0) for s in ("a", "b", "c"))
        first = pool.hold_out(None, 2)
        assert len(first) == 2 and {i.split("-")[1] for i in first} == {"t0"} and len({i[0] for i in first}) == 2
        rest = pool.hold_out(None, 2)  # the third session's first turn, then a second turn
        assert rest[0] == ({"a", "b", "c"} - {i[0] for i in first}).pop() + "-t0" and rest[1].endswith("-t1")
        assert all(pool.show(i)["sample"]["reason"] == "probe" for i in first + rest)
        assert not set(pool.lease(10).step_ids) & set(first + rest)  # held out: never trained on


def test_feedback_given_while_a_lease_runs_applies_when_the_lease_expires(open_pool, pool_later):
    """A reward that comes while a sample is leased is history only (that batch trains on what it
    leased); if the lease expires, nothing was trained, so the reward that should stand applies: a
    person's feedback over the judge, and a later judge opinion never over the feedback."""
    with open_pool(lease_seconds=60) as pool:
        judged, untouched = ready_steps(pool, 2)
        crashed = pool.lease(2)
        pool.add_reward(Reward(step_id=judged, score=-1.0, source="feedback"))
        pool.add_reward(Reward(step_id=judged, score=1.0, source="judge"))  # outranked by the feedback
        assert {s.step_id: s.reward for s in crashed.samples} == {judged: 1.0, untouched: 1.0}
        pool_later(61)
        assert pool.expire_leases() == 2
        assert {s.step_id: s.reward for s in pool.lease(2).samples} == {judged: -1.0, untouched: 1.0}


def test_a_sample_whose_training_keeps_failing_is_dropped_as_poison(open_pool, pool_later):
    """A sample the trainer cannot train (out of memory alone in its pass, or one that kills the
    process) came back with its lease and failed again, forever. Each failed attempt (given back
    with why, or an expired lease) is an event of its session; at `max_lease_attempts` it is
    dropped as `poison`, counted among the drop reasons; the others of its leases train on."""
    with open_pool(lease_seconds=60, max_lease_attempts=3) as pool:
        bad, good = ready_steps(pool, 2)
        for _ in range(2):
            lease = pool.lease(2)
            assert set(lease.step_ids) == {bad, good}
            assert pool.release(lease, {bad: "out of memory: CUDA out of memory"}) == 2  # both READY again
        assert pool.release(lease) == 0  # given back already
        crashed = pool.lease(2)
        pool_later(61)  # the trainer died with it: the expiry is the third failure of `bad`, the first of `good`
        assert pool.expire_leases() == 1
        stats = pool.stats()
        assert stats["dropped_by_reason"] == {"poison": 1} and stats["ready"] == 1
        assert pool.show(bad)["sample"]["reason"] == "poison"
        failures = [e for e in pool.show(bad, kind="session")["events"] if e["kind"] == "lease_failed"]
        assert [e["data"]["step_id"] for e in failures] == [bad, bad, bad]
        assert [e["data"]["error"] for e in failures][:2] == ["out of memory: CUDA out of memory"] * 2
        assert "expired" in failures[2]["data"]["error"] and failures[2]["data"]["attempt"] == 3
        assert list(pool.lease(2).step_ids) == [good]  # the poison one is never leased again
        assert pool.ack(crashed) == 0  # a late ack consumes nothing dropped, nothing leased again
        with pytest.raises(UnknownLeaseError):
            pool.release("no-such-lease")


def test_a_lease_takes_a_grpo_group_whole(open_pool):
    """Samples of one prompt id are a GRPO group, normalised together. A lease cut at `n` split a
    group (the trainer normalised each part alone, a member left alone was taken for a lone
    online sample); a lease now takes the rest of any group it starts."""
    with open_pool() as pool:
        alone = ready_steps(pool, 1, prefix="alone")
        group = [f"g-{i}" for i in range(3)]
        pool.append_steps(Step(step_id=i, tenant="default", session_id=i, prompt_id="prompt-7", turn_index=0,
                               turn_type="main", messages=[{"role": "user", "content": "hi"}], tools=None,
                               prompt_ids=[1], token_ids=[2], logprobs=[-0.5], text="hello", policy_version=0,
                               adapter=None, finish_reason="stop", temperature=1.0) for i in group)
        for i, step_id in enumerate(group):
            pool.add_reward(Reward(step_id=step_id, score=1.0 if i else -1.0, source="env"))
        later = ready_steps(pool, 2, prefix="later")
        lease = pool.lease(2)  # the oldest two: `alone` and the first of the group, then the rest of it
        assert list(lease.step_ids) == alone + group and len(lease.samples) == 4
        assert set(pool.lease(10).step_ids) == set(later)
