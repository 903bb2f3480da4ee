"""Durability: a process writing steps is SIGKILLed at random moments, again and again.

Each round a fresh child opens the same pool, first replays a few step ids of the previous round
(which must be stored once, whatever the kill interrupted), then writes new steps through group
commit, with rewards and lease/ack traffic mixed in, printing each step id once its future has
resolved, i.e. once it is acknowledged. The parent kills it at a random moment (some rounds before
it acknowledged anything, during open and recovery) and checks that every acknowledged id is in
the file and that `PRAGMA integrity_check` is ok.
"""

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

from clawr1.datapool import POOL_FILE

CHILD = r"""
import sys
from concurrent.futures import FIRST_COMPLETED, wait
from clawr1.core.records import Reward, Step
from clawr1.datapool import SQLitePool

data_dir, round_ = sys.argv[1], int(sys.argv[2])

def step(step_id):
    n = int(step_id.rsplit("-", 1)[1])
    return Step(step_id=step_id, tenant="default", session_id=step_id.rsplit("-", 1)[0] + f"-s{n // 8}",
                prompt_id="p", turn_index=n % 8, turn_type="main" if n % 5 else "side",
                messages=[{"role": "user", "content": f"task {n}"}], tools=None, prompt_ids=list(range(64)),
                token_ids=list(range(n % 50)), logprobs=[-0.5] * (n % 50), text="reply", policy_version=0,
                adapter=None, finish_reason="stop", temperature=1.0)

pool = SQLitePool(data_dir)
for i in range(10):  # replays of the previous round's first ids: stored or not, never twice
    pool.append_step(step(f"r{round_ - 1}-{i}"))
pending, i = {}, 0
while True:
    while len(pending) < 64:
        step_id = f"r{round_}-{i}"
        pending[pool.submit_step(step(step_id))] = step_id
        i += 1
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    for future in done:
        future.result()
        step_id = pending.pop(future)
        print(step_id, flush=True)
        n = int(step_id.rsplit("-", 1)[1])
        if n % 5 and n % 7 == 1:
            pool.add_reward(Reward(step_id=step_id, score=1.0, source="judge"))
        if n % 97 == 3:
            pool.ack(pool.lease(8))
"""


def run_round(data_dir, round_: int, rng: random.Random) -> set[str]:
    """Start a writer, kill it with SIGKILL at a random moment; return the ids it acknowledged."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(data_dir), str(round_)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first_ack = threading.Event()

    def drain() -> None:
        for line in child.stdout:
            lines.append(line)
            first_ack.set()

    reader = threading.Thread(target=drain)
    reader.start()
    if round_ % 5 == 4:
        time.sleep(rng.uniform(0.0, 0.4))  # anywhere from interpreter start to open/recovery to writing
    else:
        assert first_ack.wait(30), f"the writer acknowledged nothing: {child.stderr.read()}"
        time.sleep(rng.uniform(0.0, 0.1))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    reader.join()
    stderr = child.stderr.read()
    assert child.returncode == -signal.SIGKILL, f"the writer failed before the kill:\n{stderr}"
    # A line is an acknowledgement only if it was written whole.
    return {line.strip() for line in lines if line.endswith("\n")}


def test_acknowledged_steps_survive_sigkill(tmp_path):
    rng = random.Random(1234)
    acknowledged: set[str] = set()
    round_ = 0
    # At least 22 kills, and on until 1,000 steps were acknowledged: a loaded machine writes fewer
    # steps a round, so it runs more rounds rather than testing less.
    while round_ < 22 or (len(acknowledged) <= 1000 and round_ < 200):
        round_ += 1
        acknowledged |= run_round(tmp_path, round_, rng)
        conn = sqlite3.connect(tmp_path / POOL_FILE)  # opening runs WAL recovery, as a restart would
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            stored = {step_id for (step_id,) in conn.execute("SELECT step_id FROM steps")}
            missing = acknowledged - stored
            assert not missing, f"round {round_}: {len(missing)} acknowledged steps lost, e.g. {sorted(missing)[:5]}"
            counts = conn.execute("SELECT count(*), count(DISTINCT step_id) FROM steps").fetchone()
            assert counts[0] == counts[1]
            orphans = "SELECT count(*) FROM samples WHERE status = 'leased' AND lease_id IS NULL"
            assert conn.execute(orphans).fetchone()[0] == 0
        finally:
            conn.close()
    assert len(acknowledged) > 1000, "the rounds were too short to test anything"
