"""White-box flows: loading a flow, the tool-agent loop, and `train_flow` end to end on the tiny
model (G rollouts per task in one GRPO group, outcomes on the sessions, a trained and served
version)."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from clawr1.core.config import Config, EnvsConfig, load_config
from clawr1.engine import adapters
from clawr1.entrypoints.inprocess import Served
from clawr1.entrypoints.whitebox import rounds_of, run_rollout, train_flow
from clawr1.envs.base import Env, Task
from clawr1.flows import AgentFlow, ToolAgentFlow, load_flow
from clawr1.flows.rollouts import plan
from clawr1.reward.types import Judgement
from clawr1.trainer.policy import ADAPTER
from tests.gateway_helpers import live_gateway

TASKS = [Task(id="add", env="coin", prompt="What is 2 + 2?"), Task(id="name", env="coin", prompt="Say a name.")]


class CoinEnv(Env):
    """No tools; the k-th outcome of a task is +1 for even k, -1 for odd, so every group of 2
    rollouts of a round has one of each (GRPO needs a spread)."""

    name = "coin"
    system = "Answer briefly."
    counts: ClassVar[collections.Counter] = collections.Counter()
    lock: ClassVar[threading.Lock] = threading.Lock()

    def tools(self):
        return []

    def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    def call(self, name, arguments):
        return "Error: no tools"

    def outcome(self, final_answer=None) -> float:
        with self.lock:
            k = self.counts[self.task.id]
            self.counts[self.task.id] += 1
        return 1.0 if k % 2 == 0 else -1.0


class NeverJudge:
    name = "never"

    async def judge(self, context, reply, next_state, m, want_hint):
        return Judgement(0, [0], ["0"], "test", "judge")


def flow_config(tiny_model_dir, tmp_path):
    """train-flow on the tiny model: plain RL, a large step, quick polls."""
    return load_config(None, [f'data_dir="{tmp_path}"', f'engine.model="{tiny_model_dir}"', 'trainer.method="rl"',
                              "trainer.lr=0.01", "trainer.micro_batch=4", "gateway.adapter_poll_s=0.05",
                              "reward.poll_s=0.05"])


def test_train_flow_groups_rollouts_closes_with_outcomes_and_trains(tiny_model_dir, tmp_path):
    config = flow_config(tiny_model_dir, tmp_path)
    CoinEnv.counts.clear()
    flow = ToolAgentFlow(config, max_turns=1, max_tokens=6, env_factory=lambda task: CoinEnv())
    result = train_flow(config, flow, TASKS, group=2, epochs=2, concurrency=4, judge=NeverJudge())

    assert len(result.rollouts) == 8 and [m["version"] for m in result.steps] == [1, 2] and result.version == 2
    groups = collections.defaultdict(list)
    for r in result.rollouts:
        groups[r.prompt_id].append(r)
    assert len(groups) == 4  # one group per task and round ...
    assert all(sorted(r.outcome for r in g) == [-1.0, 1.0] for g in groups.values())  # ... of G = 2
    assert len({r.session_id for r in result.rollouts}) == 8

    from clawr1.datapool import SQLitePool

    with SQLitePool(tmp_path) as pool:
        for r in result.rollouts:
            session = pool.show(r.session_id)
            assert session["status"] == "closed" and session["outcome_reward"] == r.outcome
            [step] = pool.get_steps([s["step_id"] for s in session["steps"]])  # max_turns=1: one main turn
            assert step.prompt_id == r.prompt_id
        versions = [pool.get_steps([pool.show(r.session_id)["steps"][0]["step_id"]])[0].policy_version
                    for r in result.rollouts]
        assert versions == [0] * 4 + [1] * 4  # round 2 was served by the version round 1 trained
        assert pool.stats()["consumed"] == 8
    assert [m["lease"] for m in result.steps] == [4, 4]  # a whole round, groups intact, per step

    root = tmp_path / "adapters"
    assert adapters.latest(root, ADAPTER)[0] == 2
    v1, v2 = (load_file(adapters.version_dir(root, ADAPTER, v) / "adapter_model.safetensors") for v in (1, 2))
    assert all(t.abs().sum() > 0 for name, t in v1.items() if "lora_B" in name)  # moved off its zero init
    assert all(not torch.equal(v1[name], v2[name]) for name in v1)  # the second step moved every matrix


def test_train_flow_evaluates_heldout_tasks_per_version_as_side_turns(tiny_model_dir, tmp_path):
    from clawr1.envs.families import generate

    config = flow_config(tiny_model_dir, tmp_path)
    CoinEnv.counts.clear()
    flow = ToolAgentFlow(config, max_turns=1, max_tokens=6, env_factory=lambda task: CoinEnv())
    heldout = generate("file-chores", "heldout", n=3)  # one short tool: fits the tiny model's 512 tokens
    result = train_flow(config, flow, TASKS, group=2, steps=3, concurrency=4, judge=NeverJudge(), heldout=heldout,
                        eval_every=2)

    assert [p["version"] for p in result.curve] == [0, 2, 3]  # before, every 2 versions, after the last
    for point in result.curve:
        assert [r["task_id"] for r in point["runs"]] == [t.id for t in heldout]
        assert {r["version"] for r in point["runs"]} == {f"clawr1-v{point['version']}"}
        assert 0 <= point["ci95"][0] <= point["success"] <= point["ci95"][1] <= 1
        assert set(point["by_level"]) == {"file-chores L0", "file-chores L1", "file-chores L2"}
    from clawr1.datapool import SQLitePool

    with SQLitePool(tmp_path) as pool:
        assert pool.stats()["consumed"] == 12  # only the 3 rounds' rollouts trained, never the evaluations
    from clawr1.flows.plot import plot_curve

    png = plot_curve(result.curve, tmp_path / "curve.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tool_agent_runs_tool_calls_until_a_final_answer():
    class ToolEnv(CoinEnv):
        def tools(self):
            return [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

        def call(self, name, arguments):
            self.calls.append((name, arguments))
            return "4"

        def outcome(self, final_answer=None) -> float:
            return 1.0 if final_answer == "It is 4." else -1.0

    env = ToolEnv()
    env.calls = []
    replies = [SimpleNamespace(content=None, tool_calls=[SimpleNamespace(
                   id="c1", function=SimpleNamespace(name="add", arguments='{"a": 2, "b": 2}'))]),
               SimpleNamespace(content="It is 4.", tool_calls=None)]
    sent = []

    def create(**kwargs):
        sent.append([dict(m) for m in kwargs["messages"]])
        assert kwargs["tools"] == env.tools()
        return SimpleNamespace(id=f"c-{len(sent)}", system_fingerprint="clawr1-v3",
                               choices=[SimpleNamespace(message=replies[len(sent) - 1])])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    assert ToolAgentFlow(env_factory=lambda task: env).run(TASKS[0], client) == 1.0
    assert env.calls == [("add", '{"a": 2, "b": 2}')]
    assert [m["role"] for m in sent[1]] == ["system", "user", "assistant", "tool"]
    assert sent[1][2]["tool_calls"][0]["id"] == "c1" and sent[1][3] == {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "4"}
    sent.clear()
    episode = ToolAgentFlow(env_factory=lambda task: env).episode(TASKS[0], client)
    assert (episode.outcome, episode.final, episode.turns, episode.tool_calls, episode.tool_errors) == \
        (1.0, "It is 4.", 2, 1, 0)
    assert (episode.last_id, episode.version) == ("c-2", "clawr1-v3")
    # max_turns bounds the model calls even when the model keeps calling tools.
    replies[1] = replies[0]
    sent.clear()
    assert ToolAgentFlow(max_turns=2, env_factory=lambda task: env).run(TASKS[0], client) == -1.0
    assert len(sent) == 2


def test_tool_agent_takes_max_turns_from_the_config_unless_given():
    calls = []

    def create(**kwargs):  # a model that never stops calling tools
        calls.append(kwargs)
        call = SimpleNamespace(id=f"c{len(calls)}", function=SimpleNamespace(name="add", arguments="{}"))
        return SimpleNamespace(id="c", system_fingerprint="", choices=[SimpleNamespace(
            message=SimpleNamespace(content=None, tool_calls=[call]))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    config = Config(envs=EnvsConfig(max_turns=3))
    assert ToolAgentFlow(config, env_factory=lambda task: CoinEnv()).episode(TASKS[0], client).turns == 3
    assert len(calls) == 3
    assert ToolAgentFlow(config, max_turns=2).max_turns == 2  # an explicit value (`--max-turns`) wins


class Undecided(AgentFlow):
    def run(self, task, client):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}], max_tokens=2)
        return task.meta.get("outcome")  # not given: the flow cannot tell


def test_an_undecided_outcome_closes_without_a_reward(engine, tmp_path):
    with live_gateway(engine, tmp_path) as (base, pool):
        [rollout] = plan(TASKS[:1], 1, "t", 0)
        result = run_rollout(Undecided(), Served(base, pool, engine, None), rollout)
        assert (result.outcome, result.turns, result.status) == (None, 1, "ok")
        session = pool.show(rollout.session_id)
        assert session["status"] == "closed" and session["outcome_reward"] is None
        assert session["steps"][0]["reason"] == "masked"


def test_flows_load_by_name_module_or_file(tmp_path):
    assert load_flow("tool-agent") is ToolAgentFlow
    assert load_flow("clawr1.flows.tool_agent:ToolAgentFlow") is ToolAgentFlow
    file = tmp_path / "my_flow.py"
    file.write_text("from clawr1.flows import AgentFlow\n\nclass Mine(AgentFlow):\n    def run(self, task, client):\n"
                    "        return 1.0\n\nNOT_A_FLOW = 3\n")
    assert load_flow(f"{file}:Mine").__name__ == "Mine"
    with pytest.raises(ValueError):
        load_flow("no-such-flow")
    with pytest.raises(TypeError):
        load_flow(f"{file}:NOT_A_FLOW")
    with pytest.raises(FileNotFoundError):
        load_flow(f"{Path(tmp_path) / 'missing.py'}:X")


def test_rounds_cycle_over_the_tasks():
    tasks = [Task(id=str(i), env="coin", prompt="p") for i in range(3)]
    assert [[t.id for t in r] for r in rounds_of(tasks, 2, None, 2)] == [["0", "1"], ["2"], ["0", "1"], ["2"]]
    assert [[t.id for t in r] for r in rounds_of(tasks, 1, 3, None)] == [["0", "1", "2"]] * 3


FLOW_FILE = '''
import itertools

from clawr1.flows import AgentFlow

_outcomes = itertools.cycle([1.0, -1.0])


class Ask(AgentFlow):
    def run(self, task, client):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}], max_tokens=4)
        return next(_outcomes)
'''


def test_cli_train_flow_with_a_flow_from_a_file(tiny_model_dir, tmp_path, capsys):
    import json

    from clawr1.cli import main as cli

    flow = tmp_path / "ask_flow.py"
    flow.write_text(FLOW_FILE)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "q", "env": "none", "prompt": "Hello?"}) + "\n")
    code = cli.main(["train-flow", f"{flow}:Ask", "--tasks", str(tasks), "--group", "2", "--steps", "1",
                     "--concurrency", "1", "--method", "rl", "--model", str(tiny_model_dir), "--data-dir",
                     str(tmp_path / "data"), "--set", 'reward.judge="llm"', "--set", "gateway.adapter_poll_s=0.05",
                     "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["version"] == 1 and [m["lease"] for m in out["steps"]] == [2]
    assert sorted(r["outcome"] for r in out["rollouts"]) == [-1.0, 1.0]
    assert len({r["prompt_id"] for r in out["rollouts"]}) == 1 and {r["turns"] for r in out["rollouts"]} == {1}


def test_tool_agent_counts_what_its_calls_got_wrong_about_their_form():
    from clawr1.envs.toolcall import ToolCallEnv

    def call(name, arguments):
        return SimpleNamespace(id=name, function=SimpleNamespace(name=name, arguments=arguments))

    replies = [[call("calc", '{"expression": "1"}'), call("calculator", '{"expr": "1"}')],  # wrong tool, bad args
               [call("calculator", '{"expression": "1 / 0"}')],  # the tool's own error: not a form failure
               '{"name": "calculator", "arguments": {"expression": "2"}}\nThe result is 2.']  # a call, not taken
    seen = []

    def create(**kwargs):
        reply = replies[len(seen)]
        seen.append(kwargs["messages"][0]["content"])
        message = (SimpleNamespace(content=reply, tool_calls=None) if isinstance(reply, str)
                   else SimpleNamespace(content=None, tool_calls=reply))
        return SimpleNamespace(id="c", system_fingerprint="", choices=[SimpleNamespace(message=message)])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    task = Task(id="t", env="toolcall", prompt="What is 2?", check={"type": "answer_contains", "text": "2"},
                tools=("calculator",))
    episode = ToolAgentFlow(env_factory=lambda task: ToolCallEnv()).episode(task, client)
    assert episode.mistakes == {"wrong_tool": 1, "bad_arguments": 1, "unparsed_call": 1}
    # The unparsed call spells out "2", but a call is no answer: not solved.
    assert episode.outcome == -1.0 and "The result is 2." in episode.final
    assert (episode.turns, episode.tool_calls, episode.tool_errors) == (3, 3, 3)
    assert "a calculator" in seen[0] and "key-value" not in seen[0]  # the system prompt names the task's tools
