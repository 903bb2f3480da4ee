"""`clawr1 bench judge` on the shipped set with judges that need no model."""

from __future__ import annotations

import io

from rich.console import Console

from benchmarks.judge import run
from clawr1.core.config import load_config
from clawr1.reward.judge import LLMJudge, RuleFirstJudge


async def oracle(messages, temperature, max_tokens):
    """A scripted judge model: -1 for one task, +1 for every other, and always a hint."""
    prompt = messages[1]["content"]
    if messages[-1]["content"] == "Score:":
        return "Score: -1" if "Load sales.csv" in prompt else "Score: +1"
    return "[HINT_START] Use pandas and group the rows by region. [HINT_END]"


def test_rules_only_and_a_scripted_judge_report_every_number():
    console = Console(file=io.StringIO(), width=120)
    judge = RuleFirstJudge(LLMJudge(oracle, name="oracle"))
    report = run(load_config(), console, judges=["rules", judge, "url"])
    assert report["items"] >= 60 and report["m"] == 3
    assert report["skipped"] == {"url": "reward.judge_url is not set"}
    rules, scripted = report["judges"]["rules only"], report["judges"]["rules+oracle"]
    assert sum(map(sum, rules["confusion"])) == report["items"]
    assert rules["committed_accuracy"] == 1.0 and rules["by_rule"] >= 15  # rules are precise where they apply
    assert scripted["by_rule"] == rules["by_rule"] and 0 < scripted["accuracy"] < 1
    assert scripted["hints_on_corrections"] == scripted["corrections"]  # the oracle always offers a hint
    for key in ("hint_acceptance", "false_hints_on_vague", "hint_reasons", "seconds_per_turn", "by_category"):
        assert key in scripted
    printed = console.file.getvalue()
    assert "rules only: accuracy" in printed and "gold \\ judged" in printed and "Judges side by side" in printed


def test_per_category_keeps_a_few_of_each():
    report = run(load_config(), Console(file=io.StringIO()), judges=["rules"], per_category=2)
    assert report["items"] == 14


def test_env_labelled_tool_messages_carry_the_envs_own_verdicts():
    from benchmarks.judge_tools import items
    from clawr1.envs import make_env

    labelled = items(per_split=4)
    families = {i.id.rsplit("-", 4)[0] for i in labelled}
    assert families >= {"arithmetic", "kv-chores", "search-answer", "multi-step", "file-chores"}
    ok, bad = [i for i in labelled if i.id.endswith("-ok")], [i for i in labelled if i.id.endswith("-bad")]
    assert all(i.label == 1 and i.category == "tool_success" for i in ok)  # every reference call succeeds
    assert sum(i.label == -1 for i in bad) >= 0.9 * len(bad)  # nearly every broken call fails, by the env's word
    assert all(i.next_state[0]["role"] == "tool" for i in labelled)
    terminal, toolcall = make_env("terminal"), make_env("toolcall")
    assert terminal.failed("exit code: 127\nstderr:\nsh: sotrx: not found") and terminal.failed("Error: bad arguments")
    assert not terminal.failed("exit code: 0") and toolcall.failed("Error: no such key 'x'")
    assert not toolcall.failed("deleted 'x'")
    report = run(load_config(), Console(file=io.StringIO()), judges=["rules"], items=labelled)
    rules = report["judges"]["rules only"]
    assert rules["committed_accuracy"] == 1.0 and rules["by_rule"] >= len(bad) * 0.5  # rules catch the errors
