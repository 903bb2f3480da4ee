"""`clawr1 demo` end to end (tiny model): `clawr1 up` starts, users talk, versions go live, the
summary reports preferred-and-sane beside the preference score and the sane rate, before/after on
held-out prompts, with a held-out curve and the replies verbatim."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_short_demo_finishes_and_reports_preference_and_quality_per_version(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "clawr1.cli.main", "demo", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path),
           "--steps", "2", "--batch-size", "2", "--users", "3", "--turns", "2", "--max-tokens", "8",
           "--eval-questions", "3", "--eval-every", "1", "--preferences", "short,no-exclamation,by-name",
           "--max-minutes", "5", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "demo summary (combine" in out and "held-out preferred and sane" in out and "sane rate" in out
    assert "held-out replies, before -> after" in out and "and substantive (adds to the question)" in out
    result = json.loads((tmp_path / "demo" / "combine-seed0" / "demo.json").read_text())
    assert result["settings"]["preferences"] == ["short", "no-exclamation", "by-name"]
    assert result["settings"]["lr"] is None  # the product's learning rate: the demo set none
    versions = [row["version"] for row in result["per_version"]]
    assert versions[0] == 0 and result["reached_version"] >= 2 and versions[-1] == result["reached_version"]
    assert all(0 <= row["score"] <= 1 and row["replies"] > 0 for row in result["per_version"])
    # Every user reply was measured against the base's held-out replies (flushed at the end).
    assert sum(row["measured"] for row in result["per_version"]) == result["replies"]
    assert all(row["sane_rate"] is not None and 0 <= row["sane_rate"] <= 1 for row in result["per_version"])
    before, after = result["before"], result["after"]
    assert before["n"] == after["n"] == 9 and before["versions"] == {"clawr1-v0": 9}
    assert "clawr1-v0" not in after["versions"] and after["base"] == before["base"]  # the base, asked once
    for shown in (before, after):
        assert shown["quality_error"] is None and 0 <= shown["preferred_and_sane"] <= shown["score"]
        assert 0 <= shown["preferred_sane_substantive"] <= shown["preferred_and_sane"]
        assert 0 <= shown["substantive"] <= shown["answered"]
        assert len(shown["replies"]) == 9 and all({"question", "text", "preference", "sane", "preferred", "reasons"}
                                                  <= set(r) for r in shown["replies"])
    # The held-out curve: before, at least one evaluation while the users talked, after.
    assert len(result["curve"]) >= 3 and result["curve"][0]["version"] == 0
    assert result["curve"][-1]["version"] == max(int(v.rsplit("v", 1)[1]) for v in after["versions"])
    # The versions were trained by the production trainer on judged turns.
    assert [m["version"] for m in result["trainer"]][:2] == [1, 2] and all(m["lease"] >= 1 for m in result["trainer"])
    # The main job shut down cleanly: its pool is closed and readable.
    stats = subprocess.run([sys.executable, "-m", "clawr1.cli.main", "pool", "stats", "--json", "--data-dir",
                            str(tmp_path / "demo" / "combine-seed0")],
                           capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(stats.stdout.strip().splitlines()[-1])["rewards"] >= 4


def test_a_memory_demo_measures_the_memory_and_the_weights_apart(tiny_model_dir, tmp_path):
    """`--memory`: each held-out point is asked three ways (as served, with the users' memory; the
    same version without it: the weights alone; the base with it: the memory alone), so one run
    shows what each half does."""
    cmd = [sys.executable, "-m", "clawr1.cli.main", "demo", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path),
           "--steps", "1", "--batch-size", "2", "--users", "2", "--turns", "2", "--max-tokens", "8",
           "--eval-questions", "4", "--preferences", "short,by-name", "--max-minutes", "5", "--threads", "1",
           "--memory"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "after, without memory:" in done.stdout and "after, the base with memory:" in done.stdout
    result = json.loads((tmp_path / "demo" / "combine-seed0" / "demo.json").read_text())
    before, after = result["curve"][0], result["curve"][-1]
    assert "weights_alone" not in before  # nothing to take apart before anyone talked
    for key in ("weights_alone", "memory_alone"):
        assert after[key]["n"] == 8 and after[key]["sane_rate"] is not None
        assert len(result["after_apart"][key]["replies"]) == 8
    assert set(after["memory_alone"]["versions"]) == {"clawr1-v0"}  # the base's weights, asked as the users
    assert "clawr1-v0" not in after["weights_alone"]["versions"]  # the served version, without the memory
    # As recorded: asked as the users (their memory record), and without the memory (none at all).
    import sqlite3

    pool = sqlite3.connect(f"file:{tmp_path / 'demo' / 'combine-seed0' / 'pool.sqlite3'}?mode=ro", uri=True)
    def records(key):
        ids = [r["completion_id"] + "-0" for r in result["after_apart"][key]["replies"]]
        return [json.loads(m) if m else None for (m,) in pool.execute(
            f"SELECT memory FROM steps WHERE step_id IN ({','.join('?' * len(ids))})", ids)]
    assert all(r is not None and r["user"].startswith("user:") for r in records("memory_alone"))
    assert records("weights_alone") == [None] * 8
    # The saved run plots four ways (three without a run that had no memory) without running again.
    png = tmp_path / "memory.png"
    plotted = subprocess.run([sys.executable, "-m", "clawr1.cli.main", "demo", "--from-runs",
                              str(tmp_path / "demo" / "combine-seed0" / "demo.json"), "--plot", str(png)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert png.stat().st_size > 10_000 and "plot written" in plotted.stderr
