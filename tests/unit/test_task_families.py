"""Generated task families: every reference solution passes its checker, doing nothing does not,
and the held-out split shares no template and no prompt with the training split."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from clawr1.envs import builtin_tasks, load_tasks, make_env, task_set
from clawr1.envs.base import Task
from clawr1.envs.checks import CheckContext, check
from clawr1.envs.families import generate, registry

TOOLCALL = [name for name, fam in registry().items() if fam.env == "toolcall"]


def replay(task: Task, *, calls: bool = True, answer: str | None = None) -> float:
    """The task's outcome after its reference calls (or none) and its answer (or the reference's)."""
    solution = task.meta["solution"]
    with make_env(task.env) as env:
        env.reset(task)
        for call in solution["calls"] if calls else []:
            reply = env.call(call["name"], json.dumps(call["arguments"]))
            assert not reply.startswith("Error"), (task.id, call, reply)
        return env.outcome(solution["answer"] if answer is None else answer)


@pytest.mark.parametrize("family", TOOLCALL)
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_generated_task_is_solved_by_its_reference_and_not_without_it(family: str, split: str) -> None:
    tasks = generate(family, split)
    assert len(tasks) >= (100 if split == "train" else 40)
    for task in tasks:
        assert replay(task) == 1.0, task
        assert replay(task, calls=False, answer="I don't know.") == -1.0, task


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_file_chores_are_solved_by_their_command_and_not_without_it(split: str) -> None:
    tasks = generate("file-chores", split, n=24)  # the sandbox costs ~0.1 s a command; 24 covers every chore
    assert {t.meta["template"] for t in tasks} == {t.meta["template"] for t in generate("file-chores", split)}
    for task in tasks:
        assert replay(task) == 1.0, task
        assert replay(task, calls=False) == -1.0, task


@pytest.mark.parametrize("family", list(registry()))
def test_the_heldout_split_shares_no_template_or_prompt_with_training(family: str) -> None:
    train, heldout = generate(family, "train"), generate(family, "heldout")
    assert not {t.meta["template"] for t in train} & {t.meta["template"] for t in heldout}
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert len({t.prompt for t in train}) > 0.5 * len(train), "templates x seeds should rarely repeat a prompt"
    assert {t.meta["level"] for t in heldout} == {0, 1, 2}


def test_generation_is_deterministic_and_the_seed_changes_it() -> None:
    assert generate("arithmetic", n=10) == generate("arithmetic", n=10)
    assert [t.prompt for t in generate("arithmetic", n=10, seed=1)] != [t.prompt for t in generate("arithmetic", n=10)]


def test_task_set_reads_families_by_name_and_spec() -> None:
    assert task_set("word-problems") == generate("word-problems", "train")
    assert task_set("family:word-problems:heldout") == generate("word-problems", "heldout")
    assert task_set("word-problems", split="heldout") == generate("word-problems", "heldout")
    with pytest.raises(ValueError, match="unknown split"):
        task_set("family:arithmetic:test")
    with pytest.raises(ValueError, match="applies to task families"):
        task_set("toolcall", split="heldout")
    with pytest.raises(ValueError, match="unknown task family"):
        generate("nope")


def test_task_set_mixes_several_families_and_caps_every_kind_of_set(tmp_path) -> None:
    mixed = task_set("arithmetic,family:kv-chores:train", n=3, default_split="heldout")
    assert [t.meta["family"] for t in mixed] == ["arithmetic", "kv-chores"] * 3  # interleaved: rounds mix them
    assert [t.meta["split"] for t in mixed] == ["heldout", "train"] * 3  # a spec's own split beats the default
    assert [t.meta["family"] for t in task_set("all", n=1)] == list(registry())
    shipped = load_tasks(builtin_tasks("toolcall"))
    assert task_set("toolcall") == shipped and task_set("toolcall", n=2) == shipped[:2]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(asdict(t)) for t in shipped[:3]) + "\n")
    assert task_set(str(path), n=5) == shipped[:3]
    with pytest.raises(ValueError, match="unknown task family"):
        task_set("arithmetic,nope")
    with pytest.raises(ValueError, match="no built-in tasks"):
        task_set("nope")
    with pytest.raises(FileNotFoundError):
        task_set(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="n must be"):
        task_set("toolcall", n=0)


@pytest.mark.parametrize(("expected", "answer", "solved"), [
    ("66", "The answer is 66.", True), ("66", "66, I think", True), ("66", "-66", False), ("66", "66.5", False),
    ("66", "0.66", False), ("66", "3,966", False), ("66", "66,000", False), ("4851", "It is 4,851.", True),
    ("2,845", "2845 metres", True), ("2,845", "2,845", True), ("-12", "It is -12", True), ("-12", "12", False),
    ("2.5", "2.5 kg", True), ("2.5", "12.5", False), ("tern", "the western gull", False), ("tern", "A Tern.", True),
    ("seven", "seventeen minutes", False), ("42", "420 minutes", False), ("42", "42 minutes", True),
])
def test_whole_word_answers_match_whole_numbers_and_words(expected: str, answer: str, solved: bool) -> None:
    spec = {"type": "answer_contains", "text": expected, "whole_word": True}
    assert check(spec, CheckContext(final_answer=answer)) is solved


def test_search_answers_are_checked_as_whole_words() -> None:
    tasks = [t for split in ("train", "heldout") for t in generate("search-answer", split)]
    assert tasks and all(t.check.get("whole_word") for t in tasks)
