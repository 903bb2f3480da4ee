"""Memory entries and the guard: what each reminder still changes in a version's replies to its
held-out probes (`guard/memory.py`), recorded on the entry and retiring it within the edges."""

from __future__ import annotations

import time

import httpx
import pytest

from clawr1.core import memory
from clawr1.engine import adapters as store
from tests.conftest import run
from tests.gateway_helpers import live_gateway, wait_for
from tests.unit.test_guard import GUARD, publish


def test_a_reminders_gap_is_measured_on_the_versions_unreminded_probe_replies(engine):
    """Per entry: the version's unreminded reply scored after the prompt as served minus after the
    prompt as sent, a token mean over the probes that carried it; probes without memory count for
    nothing. Near 0 the reminder changes nothing, and the entry may leave the prompts."""
    from clawr1.core.types import SamplingParams
    from clawr1.guard.memory import probe_gaps
    from clawr1.guard.probes import Probe

    sent = [{"role": "user", "content": "How do I keep basil fresh?"}]
    reminded = [{"role": "system", "content": "Ann asked: no lists, one short paragraph."}, *sent]
    plain_ids, reminded_ids = engine.render(sent), engine.render(reminded)
    probes = [Probe("a", sent, None, plain_ids, 1.0, 8, 1, memory_ids=(4, 5), reminded_ids=reminded_ids),
              Probe("b", sent, None, plain_ids, 1.0, 8, 2, memory_ids=(4,), reminded_ids=reminded_ids),
              Probe("c", sent, None, plain_ids, 1.0, 8, 3)]

    async def go():
        gens = [await engine.generate(p.prompt_ids, SamplingParams(max_tokens=8, temperature=1.0, seed=p.seed)).final()
                for p in probes]
        diffs = [[a - b for a, b in zip(await engine.score(reminded_ids, list(g.token_ids)),
                                        await engine.score(plain_ids, list(g.token_ids)))] for g in gens[:2]]
        return await probe_gaps(engine, probes, gens, None), diffs

    gaps, diffs = run(go())
    assert set(gaps) == {4, 5}  # probe c carried no memory
    assert gaps[5]["tokens"] == len(diffs[0]) and gaps[5]["steps"] == ["a"]
    assert gaps[5]["gap"] == pytest.approx(sum(diffs[0]) / len(diffs[0]), abs=1e-4)
    assert gaps[4]["tokens"] == len(diffs[0]) + len(diffs[1]) and gaps[4]["steps"] == ["a", "b"]
    assert gaps[4]["gap"] == pytest.approx(sum(diffs[0] + diffs[1]) / gaps[4]["tokens"], abs=1e-4)
    assert abs(gaps[4]["gap"]) > 1e-3  # the reminder changes what the tiny model expects


def test_the_guard_measures_each_entry_on_its_probes_and_records_it_on_the_entry(fresh_engine, tiny_model_dir,
                                                                                  tmp_path):
    """A user's entry rides in the prompts the guard holds out; the promoted version's probe gap is
    recorded on the entry (`source: probes`), where `check_memory` retires it within the edges.
    The tiny random model's reminder changes a great deal (about -9 nats a token, past the widest
    edge), so the entry stays active."""
    edges = ("memory.refresh_s=0.05", "memory.retire_gap=5", "memory.return_gap=5", "memory.retire_min_tokens=1")
    with live_gateway(fresh_engine, tmp_path, *GUARD, *edges) as (base, pool):
        def ask(session: str, question: str) -> None:
            body = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": question}]}
            headers = {"X-Session-Id": session, "X-User-Id": "ann"}
            assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200

        ask("corrected", "How do I cook rice?")
        httpx.post(f"{base}/v1/feedback", json={"session_id": "corrected", "correction": "Please answer in one "
                                                "short paragraph."}, timeout=30).raise_for_status()
        [entry] = wait_for(lambda: [e for e in pool.memory() if e["status"] == "active"], 10, "the entry")
        time.sleep(0.3)  # (the gateway reads it within memory.refresh_s)
        for i in range(10):
            ask(f"s{i}", f"Question {i}: how do I cook rice?")
        publish(tiny_model_dir, tmp_path, 1, scale=0.0)
        verdict = wait_for(lambda: store.verdict(tmp_path / "adapters", "policy", 1), 120, "a verdict on v1")
        assert verdict["status"] == "promoted", verdict
        gap = verdict["scores"]["memory_gaps"][str(entry["id"])]
        check = wait_for(lambda: pool.memory_entry(entry["id"])["checks"], 10, "the probes' check")[-1]
        assert check["source"] == "probes" and check["version"] == 1 and check["tokens"] >= 4
        assert check["gap"] == pytest.approx(gap, abs=1e-4) and abs(gap) > 5  # the reminder still matters
        assert pool.memory_entry(entry["id"])["status"] == "active"
        assert memory.learned([check]) == f"v1 {check['gap']:+.2f} probes"  # the dashboard's column


def test_a_probe_replayed_from_an_agents_turn_measures_a_call_as_a_call():
    """A probe from an agent's turn offers its tools; a reply that is only a call of one is measured
    as the call it is (relevance and echo not held against it), as `POST /v1/quality` measures it."""
    import types

    from clawr1.core.types import Generation
    from clawr1.engine.chat import ChatFormat
    from clawr1.guard.probes import Probe, replies_of

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    call = '{"name": "calculator", "arguments": {"expression": "2 + 3"}}'
    asked = [{"role": "user", "content": "What is 2 + 3?"}]
    probes = [Probe("a", asked, tools, [1], 1.0, 8, 1), Probe("b", asked, None, [1], 1.0, 8, 2)]
    gens = [Generation([1], [5], [-0.1], call), Generation([1], [5], [-0.1], "It is 5.")]
    engine = types.SimpleNamespace(parse=ChatFormat.parse)
    as_call, prose = replies_of(probes, gens, engine)
    assert as_call.tool_call and as_call.text == call
    assert not prose.tool_call and prose.text == "It is 5."
    [offered_none] = replies_of(probes[1:], gens[:1], engine)  # no tools offered: JSON is text
    assert not offered_none.tool_call
