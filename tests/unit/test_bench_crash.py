"""`clawr1 bench crash` in small: kill -9 under load loses no step whose reply a client received
when `gateway.durable_reply` is on (the full bench runs 50 cycles; its numbers are in docs/gateway.md)."""

from __future__ import annotations

from rich.console import Console

from benchmarks.crash import run
from clawr1.core.config import load_config


def test_a_killed_gateway_loses_no_reply_it_sent_with_durable_replies(tmp_path):
    numbers = run(load_config(None, [f'data_dir="{tmp_path}"']), Console(file=open(tmp_path / "out", "w")),
                  cycles=3, clients=8)
    durable = numbers["settings"]["durable_reply on"]
    assert durable["replies_received"] > 0 and durable["steps_lost"] == 0
    assert numbers["settings"]["durable_reply off"]["replies_received"] > 0
