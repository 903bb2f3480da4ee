"""The black-box runner drives a real external agent process (tests/agents/echo_agent.py, a stock
`openai` client) against a live gateway; the pool shows its turns, groups and outcome rewards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from clawr1.cli import main as cli
from clawr1.core.config import load_config
from clawr1.datapool import SQLitePool
from clawr1.entrypoints import blackbox
from clawr1.entrypoints.blackbox import run_agent, run_process
from clawr1.envs.base import Env, Task
from tests.gateway_helpers import live_gateway

AGENT = [sys.executable, str(Path(__file__).parents[1] / "agents" / "echo_agent.py")]


class FileEnv(Env):
    """Solved when the workspace's answer.txt and the final answer both equal `check.text`."""

    name = "file"
    system = "Write the answer to answer.txt."

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="file-env-"))
        self.task: Task | None = None

    def tools(self):
        return []

    def reset(self, task: Task) -> str:
        self.task = task
        for name, text in task.files.items():
            (self.dir / name).write_text(text)
        return f"Task {task.id}: {task.prompt}"

    def call(self, name, arguments):
        return "Error: no tools here"

    def outcome(self, final_answer=None) -> float:
        written = self.dir / "answer.txt"
        expected = self.task.check["text"]
        return 1.0 if written.is_file() and written.read_text() == expected and final_answer == expected else -1.0

    @property
    def workdir(self) -> Path:
        return self.dir

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def task(id: str, answer: str, expected: str, turns: int = 1) -> Task:
    return Task(id=id, env="file", prompt="answer please", check={"text": expected},
                meta={"answer": answer, "turns": turns})


def test_runner_drives_an_external_agent_and_closes_with_its_outcome(engine, tmp_path):
    tasks = [task("right", "42", "42", turns=2), task("wrong", "41", "42")]
    with live_gateway(engine, tmp_path / "pool") as (base, pool):
        config = load_config(None, [f'data_dir="{tmp_path / "pool"}"'])
        results = run_agent(config, AGENT, tasks, group=2, base_url=base + "/v1", concurrency=2,
                            env_factory=lambda t: FileEnv())
        assert [(r.task_id, r.rollout) for r in results] == [("right", 0), ("right", 1), ("wrong", 0), ("wrong", 1)]
        assert [r.outcome for r in results] == [1.0, 1.0, -1.0, -1.0]
        assert [r.turns for r in results] == [2, 2, 1, 1] and {r.status for r in results} == {"ok"}
        for r in results:
            session = pool.show(r.session_id)
            assert session["status"] == "closed" and session["outcome_reward"] == r.outcome
            last = session["steps"][-1]
            assert last["reward"] == r.outcome and last["status"] == "ready"
            steps = pool.get_steps([s["step_id"] for s in session["steps"]])
            assert {s.prompt_id for s in steps} == {r.prompt_id}  # the rollout's group
        assert results[0].prompt_id == results[1].prompt_id != results[2].prompt_id
        assert results[0].session_id != results[1].session_id
        # The agent's turn 1 carries its turn 0 reply and "Go on.": turn 0's next state.
        first = pool.show(results[0].session_id)["steps"][0]["step_id"]
        assert pool.get_steps([first])[0].next_state == [{"role": "user", "content": "Go on."}]


def test_an_agent_gets_a_key_that_serves_its_session_and_cannot_rate_it(engine, tmp_path, monkeypatch):
    """The agent had the runner's (the tenant's) key: its model could rate its own turns +1."""
    keys = 'gateway.api_keys=["sk-runner-0001"]'
    monkeypatch.setenv("CLAWR1_TEST_RATED", str(tmp_path / "rated.txt"))  # where the agent says what it got
    greedy = Task(id="greedy", env="file", prompt="answer please", check={"text": "42"},
                  meta={"answer": "41", "rate": True})
    with live_gateway(engine, tmp_path / "pool", keys) as (base, pool):
        config = load_config(None, [f'data_dir="{tmp_path / "pool"}"', keys])
        [result] = run_agent(config, AGENT, [greedy], base_url=base + "/v1", env_factory=lambda t: FileEnv())
        assert (tmp_path / "rated.txt").read_text() == "403"
        assert result.status == "ok" and result.outcome == -1.0 and result.turns == 1
        session = pool.show(result.session_id)
        assert session["outcome_reward"] == -1.0 and session["steps"][-1]["reward"] == -1.0
        assert not [r for s in session["steps"] for r in s["rewards"] if r["source"] == "feedback"]


def test_cli_run_agent_with_an_in_process_gateway(tiny_model_dir, tmp_path, monkeypatch, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "env": "file", "prompt": "p", "check": {"text": "ok"},
                                 "meta": {"answer": "ok"}}) + "\n")
    monkeypatch.setattr(blackbox, "env_for", lambda config: lambda t: FileEnv())  # until clawr1.envs lands
    code = cli.main(["run-agent", "--tasks", str(tasks), "--serve", "--model", str(tiny_model_dir),
                     "--data-dir", str(tmp_path), "--set", 'reward.judge="llm"', "--json", "--", *AGENT])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["summary"]["mean_outcome"] == 1.0
    [row] = out["rollouts"]
    assert (row["task_id"], row["outcome"], row["turns"], row["status"]) == ("t1", 1.0, 1, "ok")
    with SQLitePool(tmp_path) as pool:
        assert pool.show(row["session_id"])["outcome_reward"] == 1.0


def test_an_agent_past_the_wall_time_is_killed(tmp_path):
    status, out, _ = run_process([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(30)"],
                                 tmp_path, {}, timeout_s=1.0)
    assert status == "timeout" and out.strip() == "started"
    assert run_process([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, {}, 10)[0] == "exit 3"


def test_the_wall_time_bounds_a_run_whose_escaped_grandchild_holds_the_pipes(tmp_path):
    started = time.monotonic()
    status, out, err = run_process(["sh", "-c", "setsid sleep 20 & echo $!"], tmp_path, {}, 1)
    try:
        assert status == "timeout"
        assert time.monotonic() - started < 8  # not the 20 s the grandchild lives
        assert "still held the output open" in err
    finally:
        os.kill(int(out.split()[0]), signal.SIGKILL)  # the grandchild escaped the group kill by design


def test_no_gateway_fails_before_any_agent_runs(tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"'])
    with pytest.raises(ConnectionError, match="clawr1 up"):
        run_agent(config, AGENT, [task("t", "1", "1")], base_url="http://127.0.0.1:9", env_factory=lambda t: FileEnv())
