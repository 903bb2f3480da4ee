"""`clawr1 eval --tasks`: tasks run through a live gateway as side turns, success per family and
level with Wilson intervals; and `clawr1 tasks` writes a family as a task file."""

from __future__ import annotations

import asyncio
import json
import re

from clawr1.core.config import EngineConfig
from clawr1.engine.local import LocalEngine
from clawr1.envs.base import load_tasks
from clawr1.envs.families import generate
from clawr1.flows.evaluate import evaluate_tasks, wilson
from tests.gateway_helpers import live_gateway
from tests.scripted_engine import ScriptedEngine

NUMBER = re.compile(r"-?\d+")
CALL = re.compile(r'<tool_call>\{"name": "calculator".*?</tool_call>')


class CopyingEngine(ScriptedEngine):
    """Answers with the literal tool-call line a level-0 task gives; once the call is in the
    conversation, with the last number of the prompt (the tool's result). Levels 1 and 2 give no
    line to copy, so it fails them: the per-level numbers are known in advance."""

    def generate(self, prompt_ids, sampling, adapter=None, affinity=None):
        text = self.tokenizer.decode(prompt_ids)
        calls = CALL.findall(text)
        self.reply = calls[0] if len(calls) == 1 else "The result is " + NUMBER.findall(text)[-1] + "."
        return super().generate(prompt_ids, sampling, adapter, affinity)

    def score(self, *args, **kwargs):  # the quality measure's base-model pass, on the real tiny model
        return self.engine.score(*args, **kwargs)


def test_eval_runs_tasks_as_side_turns_and_reports_success_per_level(tiny_model_dir, tmp_path):
    tasks = generate("arithmetic", "heldout", n=9)
    # The tool prompt and the conversation outgrow the shared tiny engine's 512 tokens.
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8, max_context=4096))
    with live_gateway(CopyingEngine(engine, ""), tmp_path) as (base, pool):
        result = evaluate_tasks(base, "none", tasks, concurrency=2)
        steps = [s for session in pool.sessions(limit=100) for s in pool.show(session["session_id"])["steps"]]
        stats = pool.stats()
    asyncio.run(engine.close())
    served = result.as_dict()["served"]
    assert served["by_level"]["arithmetic L0"]["success"] == 1.0  # copied the call, then read the result
    assert served["by_level"]["arithmetic L1"]["success"] == 0.0 == served["by_level"]["arithmetic L2"]["success"]
    assert served["n"] == 9 and served["solved"] == 3 and served["tool_calls_per_task"] == 3 / 9
    assert served["tool_error_share"] == 0.0
    lo, hi = served["ci95"]
    assert lo < 3 / 9 < hi and (lo, hi) == wilson(3, 9)
    assert [r.task_id for r in result.served] == [t.id for t in tasks]
    assert all(r.version == "clawr1-v0" for r in result.served) and result.base == result.served  # asked once
    assert len(steps) == 9 + 3 and {s["turn_type"] for s in steps} == {"side"}  # recorded, never trained
    assert stats["ready"] == 0
    assert result.quality_error is None and all(r.sane is not None for r in result.served)  # measured vs the base


def test_wilson_interval():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
    assert wilson(10, 10)[1] == 1.0 and wilson(0, 10)[0] == 0.0


def test_cli_tasks_writes_a_family_as_a_task_file(tmp_path, capsys):
    from clawr1.cli import main as cli

    out = tmp_path / "held.jsonl"
    assert cli.main(["tasks", "kv-chores", "--split", "heldout", "-n", "5", "--out", str(out)]) == 0
    assert load_tasks(out) == generate("kv-chores", "heldout", 5)
    assert cli.main(["tasks"]) == 0
    assert "file-chores" in capsys.readouterr().out
    assert cli.main(["tasks", "kv-chores", "-n", "2"]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == \
        [t.id for t in generate("kv-chores", n=2)]
