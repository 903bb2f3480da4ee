"""`clawr1 export` / `DataPool.export`: each format round-trips in TRL's conversational shape, and
every filter selects exactly the rows it names."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from clawr1.cli.export import parse_time, parse_versions
from clawr1.cli.main import main
from clawr1.core.records import Hint, Reward, Step
from clawr1.datapool import SQLitePool
from clawr1.datapool.base import ExportFilter


def conversation(turn: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for t in range(turn):
        messages += [{"role": "user", "content": f"question {t}"}, {"role": "assistant", "content": f"answer {t}"}]
    return messages + [{"role": "user", "content": f"question {turn}"}]


def make_step(step_id: str, session: str, turn: int, version: int, created_at: float, tenant: str = "default",
              turn_type: str = "main") -> Step:
    return Step(step_id=step_id, tenant=tenant, session_id=session, prompt_id=session, turn_index=turn,
                turn_type=turn_type, messages=conversation(turn), tools=None, prompt_ids=[1, 2], token_ids=[3, 4],
                logprobs=[-0.5, -0.25], text=f"answer {turn}", policy_version=version, adapter=None,
                finish_reason="stop", temperature=1.0, created_at=created_at)


@pytest.fixture
def pool(tmp_path):
    """a: +1 with a judge and a feedback hint; b: -1; c: unrewarded; d: another tenant, +0.5; e: side."""
    with SQLitePool(tmp_path / "data") as pool:
        pool.append_steps([make_step("a", "s1", 0, 0, 1000.0), make_step("b", "s1", 1, 1, 2000.0),
                           make_step("c", "s2", 0, 2, 3000.0), make_step("d", "s3", 0, 3, 4000.0, tenant="acme"),
                           make_step("e", "s1", 2, 1, 2500.0, turn_type="side")])
        pool.add_reward(Reward(step_id="a", score=1.0, source="judge"))
        pool.add_hint(Hint(step_id="a", text="feedback hint", source="feedback"))
        pool.add_hint(Hint(step_id="a", text="later judge hint", source="judge"))
        pool.add_reward(Reward(step_id="b", score=-1.0, source="judge"))
        pool.add_reward(Reward(step_id="d", score=0.5, source="feedback"))
        yield pool


def read(path, format: str) -> list[dict]:
    if format == "jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if format == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    import datasets

    return list(datasets.load_from_disk(str(path)))


@pytest.mark.parametrize("format", ["jsonl", "parquet", "hf"])
def test_each_format_round_trips_in_trl_conversational_form(pool, tmp_path, format):
    out = tmp_path / f"export-{format}"
    assert pool.export(out, format) == 4
    rows = {row["step_id"]: row for row in read(out, format)}
    assert sorted(rows) == ["a", "b", "c", "d"]  # main turns only
    a, b, c, d = (rows[k] for k in "abcd")
    # TRL's conversational prompt-completion: lists of {role, content}, the completion one assistant message.
    assert a["prompt"] == conversation(0) and b["prompt"] == conversation(1)
    assert all(m.keys() == {"role", "content"} for row in rows.values() for m in row["prompt"])
    assert b["completion"] == [{"role": "assistant", "content": "answer 1"}]
    assert (a["reward"], b["reward"], c["reward"], d["reward"]) == (1.0, -1.0, None, 0.5)
    assert a["hint"] == "feedback hint" and b["hint"] is None  # the hint it trains with: feedback first
    assert (b["session_id"], b["turn_index"], b["policy_version"], b["tenant"], b["created_at"]) == (
        "s1", 1, 1, "default", 2000.0)
    assert d["tenant"] == "acme" and d["created_at"] == 4000.0
    assert not (tmp_path / f"export-{format}.tmp").exists()


def ids(pool, tmp_path, **bounds) -> list[str]:
    out = tmp_path / "filtered.jsonl"
    count = pool.export(out, filters=ExportFilter(**bounds))
    rows = [json.loads(line)["step_id"] for line in out.read_text().splitlines()]
    assert count == len(rows)
    return rows


@pytest.mark.parametrize(("bounds", "expected"), [
    ({}, "abcd"),
    ({"tenant": "acme"}, "d"),
    ({"tenant": "nobody"}, ""),
    ({"since": 2000.0}, "bcd"),  # since is inclusive
    ({"until": 3000.0}, "ab"),  # until is exclusive
    ({"since": 1500.0, "until": 3500.0}, "bc"),
    ({"rewarded_only": True}, "abd"),
    ({"min_reward": 0.0}, "ad"),  # a reward bound keeps only rewarded samples
    ({"max_reward": 0.5}, "bd"),
    ({"min_reward": -1.0, "max_reward": -1.0}, "b"),
    ({"min_version": 1, "max_version": 2}, "bc"),
    ({"min_version": 3, "max_version": 3}, "d"),
    ({"max_version": 0}, "a"),
    ({"tenant": "default", "rewarded_only": True, "min_version": 1}, "b"),
])
def test_filters_select_exactly_their_rows(pool, tmp_path, bounds, expected):
    assert ids(pool, tmp_path, **bounds) == list(expected)


def test_pool_export_keeps_its_rewarded_only_flag(pool, tmp_path):
    assert pool.export(tmp_path / "r.jsonl", rewarded_only=True, filters=ExportFilter(tenant="default")) == 2


def test_bad_filters_and_formats_are_refused(pool, tmp_path):
    with pytest.raises(ValueError, match="since"):
        ExportFilter(since=5.0, until=1.0)
    with pytest.raises(ValueError, match="min_version"):
        ExportFilter(min_version=-1)
    with pytest.raises(ValueError, match="jsonl or parquet"):
        pool.export(tmp_path / "x.csv", "csv")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        pool.export(tmp_path / "taken", "hf")


def test_hf_without_datasets_says_what_to_install(pool, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"clawr1\[export\]"):
        pool.export(tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_time_and_version_arguments():
    assert parse_time("1767225600") == 1767225600.0 and parse_time("12.5") == 12.5
    assert parse_time("1970-01-01T00:50:00") == 3000.0  # no offset: UTC
    assert parse_time("1970-01-01T01:50:00+01:00") == 3000.0 and parse_time("1970-01-01T00:50:00Z") == 3000.0
    assert parse_versions("3") == (3, 3) and parse_versions("2:5") == (2, 5)
    assert parse_versions("2:") == (2, None) and parse_versions(":5") == (None, 5)
    for bad in ("x", ":", "-1", "1:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_versions(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("yesterday")


def test_cli_export_with_filters_and_pool_export_still_works(pool, tmp_path, capsys):
    data = str(tmp_path / "data")
    out = tmp_path / "cli.jsonl"
    assert main(["export", "--data-dir", data, "--out", str(out), "--since", "1970-01-01T00:50:00Z",
                 "--version", "2:", "--rewarded-only", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"rows": 1, "out": str(out), "format": "jsonl"}
    assert [json.loads(line)["step_id"] for line in out.read_text().splitlines()] == ["d"]
    assert main(["export", "--data-dir", data, "--out", str(tmp_path / "v.jsonl"), "--tenant", "default",
                 "--min-reward", "-1", "--max-reward", "0"]) == 0
    assert [json.loads(line)["step_id"] for line in (tmp_path / "v.jsonl").read_text().splitlines()] == ["b"]
    assert main(["pool", "export", "--data-dir", data, "--out", str(tmp_path / "p.jsonl"), "--rewarded-only"]) == 0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3


def test_commands_that_read_never_create_a_pool_and_name_a_shared_session_by_tenant(pool, tmp_path, capsys):
    """A mistyped `--data-dir` is an error, not an empty pool created there (exit 1, nothing
    written); `pool show` of a session id two tenants use asks for, and takes, `--tenant`."""
    missing = tmp_path / "typo"
    for argv in (["pool", "stats", "--json"], ["pool", "show", "s1"], ["export", "--out", str(tmp_path / "x.jsonl")]):
        assert main([*argv, "--data-dir", str(missing)]) == 1, argv
        assert "no data pool" in capsys.readouterr().err
    assert not missing.exists()
    pool.append_step(make_step("f", "s3", 0, 0, 5000.0))  # s3 is acme's too
    data = str(tmp_path / "data")
    assert main(["pool", "show", "s3", "--data-dir", data]) == 2
    assert "--tenant" in capsys.readouterr().err
    assert main(["pool", "show", "s3", "--tenant", "acme", "--data-dir", data]) == 0
    assert [s["step_id"] for s in json.loads(capsys.readouterr().out)["steps"]] == ["d"]
