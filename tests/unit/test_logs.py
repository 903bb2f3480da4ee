"""JSON logs for `up`, `serve`, `train`: one object a line with extras, and secrets never written."""

from __future__ import annotations

import io
import json
import logging
import tomllib
from datetime import datetime

import pytest

from clawr1.cli import main as cli
from clawr1.core.config import load_config, to_toml
from clawr1.entrypoints import logs
from clawr1.entrypoints.console import say

ADMIN = "admin-secret-0123456789"


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_one_json_object_per_record_with_extras_and_no_secrets():
    out = io.StringIO()
    logs.configure("json", ["sk-agent-secret", ADMIN], stream=out)
    log = logging.getLogger("clawr1.gateway.test")
    log.info("served %d requests for %s", 3, "sk-agent-secret", extra={"version": 2, "api_key": "anything",
                                                                        "note": f"admin is {ADMIN}"})
    log.warning("client sent Authorization: Bearer sk-clawr1-s-abcdef")
    try:
        raise RuntimeError(f"upstream refused {ADMIN}")
    except RuntimeError:
        log.exception("judge call failed")
    logging.getLogger("httpx").info("HTTP Request: POST ...")  # quietened: one line per request
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    first, second, third = (json.loads(line) for line in lines)
    assert first["level"] == "INFO" and first["logger"] == "clawr1.gateway.test"
    assert first["message"] == "served 3 requests for [redacted]"
    assert first["version"] == 2 and first["api_key"] == "[redacted]" and first["note"] == "admin is [redacted]"
    assert datetime.fromisoformat(first["time"]).utcoffset().total_seconds() == 0
    assert second["level"] == "WARNING" and second["message"] == "client sent Authorization: Bearer [redacted]"
    assert third["level"] == "ERROR" and "RuntimeError" in third["exception"]
    text = out.getvalue()
    assert "sk-agent-secret" not in text and ADMIN not in text and "abcdef" not in text


def test_an_extra_named_like_a_core_key_does_not_replace_it():
    out = io.StringIO()
    logs.configure("json", stream=out)
    logging.getLogger("x").info("hello", extra={"level": "mine", "logger": "other"})
    record = json.loads(out.getvalue())
    assert (record["level"], record["logger"], record["extra_level"], record["extra_logger"]) == (
        "INFO", "x", "mine", "other")


@pytest.mark.parametrize("command", ["serve", "up", "train"])
def test_log_json_flag_sets_the_config_the_trainer_also_gets(command):
    args = cli.build_parser().parse_args([command, "--log-json"])
    config = cli.resolve(args)
    assert config.log_format == "json"
    assert tomllib.loads(to_toml(config))["log_format"] == "json"  # `up` hands the trainer this TOML
    assert cli.resolve(cli.build_parser().parse_args([command])).log_format == "rich"


def test_serve_with_log_json_writes_only_json_lines(monkeypatch, capsys):
    def fake_serve(args, config):
        logging.getLogger("clawr1.gateway.app").warning("serving policy v%d", 4, extra={"load_ms": 21})
        say(config, "[green]ready[/green]", "gateway ready", url="http://127.0.0.1:1/v1")
        logging.getLogger("clawr1.reward.worker").error(f"key {ADMIN} leaked?")  # noqa: G004 - a careless message
        return 0

    monkeypatch.setattr(cli, "cmd_serve", fake_serve)
    assert cli.main(["serve", "--log-json", "--set", f'gateway.admin_key="{ADMIN}"']) == 0
    err = capsys.readouterr().err
    records = [json.loads(line) for line in err.splitlines()]
    assert [r["message"] for r in records] == ["serving policy v4", "gateway ready", "key [redacted] leaked?"]
    assert records[0]["load_ms"] == 21 and records[1]["url"] == "http://127.0.0.1:1/v1"
    assert ADMIN not in err


def test_secrets_of_finds_every_configured_key():
    config = load_config(None, ['gateway.api_keys=["agent-k1", "agent-k2"]', f'gateway.admin_key="{ADMIN}"',
                                'reward.judge_api_key="judge-key"'])
    assert sorted(logs.secrets_of(config)) == sorted(["agent-k1", "agent-k2", ADMIN, "judge-key"])
