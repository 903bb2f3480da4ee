"""The pool on a real PostgreSQL server, where SQLite's single file lock is gone: several gateways
write the same sessions at once, several trainers lease at once, a killed writer loses nothing it
acknowledged, and a gateway runs on it unchanged. (The whole pool contract also runs on it: see
the `pool` fixtures of test_datapool*.py and test_stepwise.py.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from clawr1.core.config import PoolConfig
from clawr1.core.records import Reward, Step
from clawr1.datapool.postgres import PostgresPool
from tests.gateway_helpers import live_gateway, wait_for


def step(step_id: str, session: str, turn: int, version: int = 0) -> Step:
    return Step(step_id=step_id, tenant="default", session_id=session, prompt_id=session, turn_index=turn,
                turn_type="main", messages=[{"role": "user", "content": f"{session} turn {turn}"}], tools=None,
                prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], text="ok", policy_version=version, adapter=None,
                finish_reason="stop", temperature=1.0)


def test_two_gateways_writing_the_same_sessions_at_once_keep_every_step_and_link(postgres):
    dsn = postgres.fresh()
    gateways = [PostgresPool(dsn, PoolConfig(commit_linger_ms=1)) for _ in range(2)]
    sessions, turns = 6, 20
    start = threading.Barrier(2)
    acked: list[list[bool]] = [[], []]

    def write(g: int) -> None:  # gateway g writes turns g, g + 2, ...: every session, interleaved
        start.wait()
        futures = [gateways[g].submit_step(step(f"s{s}-t{t}", f"s{s}", t)) for t in range(g, turns, 2)
                   for s in range(sessions)]
        acked[g] = [f.result(timeout=120) for f in futures]

    threads = [threading.Thread(target=write, args=(g,)) for g in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert all(acked[0]) and all(acked[1]) and len(acked[0]) + len(acked[1]) == sessions * turns
        assert gateways[1].stats()["steps"] == sessions * turns and gateways[0].stats()["sessions"] == sessions
        for s in range(sessions):  # whatever interleaving the two wrote in, each session is one chain
            links = {t["turn_index"]: t["next_step_id"] for t in gateways[0].show(f"s{s}")["steps"]}
            assert links == {t: (f"s{s}-t{t + 1}" if t + 1 < turns else None) for t in range(turns)}
    finally:
        for pool in gateways:
            pool.close()


def test_gateways_starting_at_once_create_the_schema_once(postgres):
    dsn, pools, errors = postgres.fresh(), [], []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        try:
            pools.append(PostgresPool(dsn))
        except Exception as error:  # noqa: BLE001 - the test reports it below
            errors.append(error)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for pool in pools:
        pool.close()
    assert not errors and len(pools) == 4


def test_two_trainers_leasing_at_once_get_disjoint_batches(postgres):
    dsn = postgres.fresh()
    with PostgresPool(dsn) as gateway:
        gateway.append_steps([step(f"x{i}", f"x{i}", 0) for i in range(40)])
        for i in range(40):
            gateway.add_reward(Reward(step_id=f"x{i}", score=1.0, source="judge"))
    trainers = [PostgresPool(dsn) for _ in range(2)]
    start, leases = threading.Barrier(2), [None, None]

    def take(t: int) -> None:
        start.wait()
        leases[t] = trainers[t].lease(25)

    threads = [threading.Thread(target=take, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        a, b = (set(lease.step_ids) for lease in leases)
        assert not a & b and len(a | b) == 40 and {len(a), len(b)} == {25, 15}
        assert trainers[0].ack(leases[0]) + trainers[1].ack(leases[1]) == 40
        assert trainers[0].stats()["consumed"] == 40
    finally:
        for pool in trainers:
            pool.close()


CHILD = r"""
import sys
from clawr1.core.records import Step
from clawr1.datapool.postgres import PostgresPool

pool = PostgresPool(sys.argv[1])
i = 0
while True:
    futures = [(f"k-{i + j}", pool.submit_step(Step(step_id=f"k-{i + j}", tenant="default", session_id=f"k{(i + j) // 5}",
               prompt_id="p", turn_index=(i + j) % 5, turn_type="main", messages=[{"role": "user", "content": "hi"}],
               tools=None, prompt_ids=[1], token_ids=[2], logprobs=[-1.0], text="ok", policy_version=0, adapter=None,
               finish_reason="stop", temperature=1.0))) for j in range(16)]
    for step_id, future in futures:
        future.result()
        print(step_id, flush=True)
    i += 16
"""


def test_a_killed_writer_loses_nothing_it_acknowledged(postgres):
    dsn = postgres.fresh()
    child = subprocess.Popen([sys.executable, "-c", CHILD, dsn], stdout=subprocess.PIPE, text=True)
    acked: list[str] = []
    reader = threading.Thread(target=lambda: acked.extend(line.strip() for line in child.stdout), daemon=True)
    reader.start()
    wait_for(lambda: len(acked) >= 200, timeout=60, what="200 acknowledged steps")
    child.kill()  # SIGKILL: no clean shutdown, whatever was in flight
    child.wait()
    reader.join(timeout=10)
    with PostgresPool(dsn) as pool:
        stored = {s.step_id for s in pool.get_steps(acked)}  # raises if any acknowledged step is missing
        assert stored == set(acked) and pool.stats()["steps"] >= len(acked)


def test_a_gateway_serves_and_records_on_postgres_and_a_second_one_continues_its_session(engine, tmp_path, postgres):
    dsn = postgres.fresh()
    body = {"model": "m", "max_tokens": 4, "temperature": 0}
    overrides = ['pool.backend="postgres"', f'pool.postgres_dsn="{dsn}"']
    with live_gateway(engine, tmp_path / "a", *overrides) as (first, pool_a), \
            live_gateway(engine, tmp_path / "b", *overrides) as (second, pool_b):
        messages = [{"role": "user", "content": "hello"}]
        reply = httpx.post(f"{first}/v1/chat/completions", headers={"X-Session-Id": "shared"},
                           json={**body, "messages": messages}, timeout=60).json()
        wait_for(lambda: pool_b.stats()["steps"] == 1, what="the first turn, seen by the other gateway")
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "and again"}]
        httpx.post(f"{second}/v1/chat/completions", headers={"X-Session-Id": "shared"},
                   json={**body, "messages": messages}, timeout=60).raise_for_status()
        wait_for(lambda: pool_a.stats()["steps"] == 2, what="the second turn")
        turns = pool_a.show("shared")["steps"]
        assert [t["turn_index"] for t in turns] == [0, 1] and turns[0]["next_step_id"] == turns[1]["step_id"]
        feedback = httpx.post(f"{second}/v1/feedback", json={"completion_id": reply["id"], "reward": 1}, timeout=30)
        assert feedback.status_code == 200  # a turn the other gateway recorded
        time.sleep(0.1)
        assert pool_a.show(turns[0]["step_id"])["sample"]["reward"] == 1.0
