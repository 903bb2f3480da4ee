"""`clawr1 versions`, `clawr1 pin`, `clawr1 rollback`: what the guard decided, and the admin's levers,
read and written through the version store (the files the gateway and the trainer poll)."""

from __future__ import annotations

import json

from clawr1.cli.main import main
from clawr1.engine import adapters as store
from tests.unit.test_guard import publish


def test_versions_lists_verdicts_and_the_levers_write_the_control(tiny_model_dir, tmp_path, capsys):
    root = tmp_path / "adapters"
    for version, status in ((1, "promoted"), (2, "rejected")):
        publish(tiny_model_dir, tmp_path, version, scale=0.0)
        store.decide(root, "policy", version, status, f"because {version}",
                     {"candidate": {"sane_rate": 0.5 * version, "kl": 0.1 * version}})
    publish(tiny_model_dir, tmp_path, 3, scale=0.0)  # published, not decided yet
    assert main(["versions", "--data-dir", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(v["version"], v["status"], v["sane_rate"]) for v in shown["versions"]] == [
        (1, "promoted", 0.5), (2, "rejected", 1.0), (3, "undecided", None)]
    assert main(["versions", "--data-dir", str(tmp_path)]) == 0
    assert "because 2" in capsys.readouterr().out

    assert main(["pin", "1", "--data-dir", str(tmp_path)]) == 0
    assert store.control(root, "policy")["pinned"] == 1
    assert main(["pin", "--off", "--data-dir", str(tmp_path)]) == 0
    assert store.control(root, "policy")["pinned"] is None
    assert main(["rollback", "1", "--data-dir", str(tmp_path)]) == 0
    first = store.control(root, "policy")["rollback"]
    assert main(["rollback", "1", "--data-dir", str(tmp_path)]) == 0
    assert first["to"] == 1 and store.control(root, "policy")["rollback"]["id"] != first["id"]  # each is new

    # Refused, with a reason and exit code 2: a version not on disk, a tenant without per-tenant adapters.
    assert main(["rollback", "7", "--data-dir", str(tmp_path)]) == 2
    assert main(["pin", "--data-dir", str(tmp_path)]) == 2
    assert main(["versions", "--tenant", "acme", "--data-dir", str(tmp_path)]) == 2
    assert "not on disk" in capsys.readouterr().out


def test_pruning_keeps_the_newest_and_the_protected(tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    for version in range(1, 7):
        publish(tiny_model_dir, tmp_path, version, scale=0.0)
    removed = store.prune(root, "policy", keep=2, protect={1, 3})
    assert removed == [2, 4] and store.published(root, "policy") == [1, 3, 5, 6]
    assert store.newest(root, "policy")[0] == 6


def test_the_command_line_starts_without_torch():
    """`clawr1 versions`, `config`, `--help` read files and print: they must not pay the seconds
    torch and transformers take to import (the engine and the trainer import them when they run)."""
    import subprocess
    import sys

    probe = "import sys, clawr1.cli.main; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
