"""`clawr1 demo` end to end (tiny model): `clawr1 up` starts, users talk, versions go live, the
summary reports the preference score per version and before/after on held-out prompts."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_short_demo_finishes_and_reports_the_score_per_version(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "clawr1.cli.main", "demo", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path),
           "--steps", "2", "--batch-size", "2", "--users", "3", "--turns", "2", "--max-tokens", "8",
           "--eval-questions", "1", "--max-minutes", "5", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo summary (combine)" in done.stdout and "preference score" in done.stdout
    result = json.loads((tmp_path / "demo" / "combine-seed0" / "demo.json").read_text())
    versions = [row["version"] for row in result["per_version"]]
    assert versions[0] == 0 and result["reached_version"] >= 2 and versions[-1] == result["reached_version"]
    assert all(0 <= row["score"] <= 1 and row["replies"] > 0 for row in result["per_version"])
    assert result["before"]["n"] == 3 and result["before"]["versions"] == {"clawr1-v0": 3}
    assert result["after"]["n"] == 3 and "clawr1-v0" not in result["after"]["versions"]
    # The versions were trained by the production trainer on judged turns.
    assert [m["version"] for m in result["trainer"]][:2] == [1, 2] and all(m["lease"] >= 1 for m in result["trainer"])
    # The main job shut down cleanly: its pool is closed and readable.
    stats = subprocess.run([sys.executable, "-m", "clawr1.cli.main", "pool", "stats", "--json", "--data-dir",
                            str(tmp_path / "demo" / "combine-seed0")], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(stats.stdout.strip().splitlines()[-1])["rewards"] >= 4
