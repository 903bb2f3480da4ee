"""The real OpenClaw, from the npm registry and unmodified, against `clawr1 up` on the embedded model.

It holds a three-message conversation through the config `clawr1 openclaw-config` prints, sends no
session header (OpenClaw has none), and the gateway must still file the turns in one session, in
order, each paired with its next state, by history matching alone. Then OpenClaw compacts the
conversation (`openclaw sessions compact`, through its own gateway): its summarising call is a side
turn, and the next message, sent with a summary in place of the history, still continues the
session and becomes the last turn's next state. OpenClaw's full prompt, which
does not fit SmolLM2's context, must come back as OpenAI's 400 `context_length_exceeded` (OpenClaw
reports a context overflow) without storing anything or hurting the server."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

from clawr1.cli.openclaw import openclaw_config
from clawr1.core.config import EMBEDDED_MODEL, load_config
from clawr1.datapool import SQLitePool
from clawr1.engine.models import model_cache_dir
from tests.gateway_helpers import free_port, healthy, interrupt, live_gateway, wait_for
from tests.npm_helpers import node_bin, npm_install
from tests.scripted_engine import ScriptedEngine

OPENCLAW = "openclaw@2026.9.6"  # needs Node 24.16+ (< 25), which the npm package `node` ships
MESSAGES = ["What is the capital of France?", "And the capital of Germany?", "Thanks. Name a river there."]


def clawr1(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clawr1.cli.main", *args], capture_output=True, text=True,
                          check=True, timeout=300)


class OpenClaw:
    def __init__(self, folder: Path, node: Path, home: Path, config: dict):
        self.bin = folder / "node_modules" / ".bin" / "openclaw"
        home.mkdir(parents=True, exist_ok=True)
        (home / "openclaw.json").write_text(json.dumps(config))
        self.env = {**os.environ, "HOME": str(home), "OPENCLAW_CONFIG_PATH": str(home / "openclaw.json"),
                    "OPENCLAW_STATE_DIR": str(home / "state"), "OPENCLAW_NO_AUTO_UPDATE": "1", "DO_NOT_TRACK": "1",
                    "PATH": f"{node}{os.pathsep}{os.environ['PATH']}"}

    def say(self, session: str, message: str) -> dict:
        done = subprocess.run([str(self.bin), "agent", "--local", "--session-id", session, "--message", message,
                               "--json"], capture_output=True, text=True, env=self.env, timeout=600, check=False)
        assert done.returncode in (0, 1), done.stderr[-3000:]
        return json.loads(done.stdout)

    def compact(self, session: str) -> dict:
        """`openclaw sessions compact`, which needs OpenClaw's own gateway running (loopback, a token)."""
        port, token = free_port(), secrets.token_hex(16)
        env = {**self.env, "OPENCLAW_GATEWAY_TOKEN": token}
        log = Path(self.env["HOME"]) / "openclaw-gateway.log"  # a file: a full pipe would stall it
        with log.open("w") as out:
            gateway = subprocess.Popen([str(self.bin), "gateway", "run", "--port", str(port), "--bind", "loopback",
                                        "--allow-unconfigured"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _listening(port) or gateway.poll() is not None, timeout=300, what="OpenClaw's gateway")
            assert gateway.poll() is None, log.read_text()[-3000:]
            done = subprocess.run([str(self.bin), "sessions", "compact", f"agent:main:explicit:{session}", "--url",
                                   f"ws://127.0.0.1:{port}", "--token", token, "--json"], capture_output=True, text=True,
                                  env=env, timeout=600, check=False)
        finally:
            gateway.terminate()
            gateway.wait(timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_openclaw_conversation_lands_in_one_session_in_order(real_data_dir, tmp_path):
    node = node_bin()
    folder = npm_install("openclaw", OPENCLAW, node=node)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data_dir = tmp_path / "data"
    model = model_cache_dir(real_data_dir) / EMBEDDED_MODEL  # converted once for the integration tests
    log = tmp_path / "up.log"  # a file, not a pipe: nobody reads a pipe mid-test, and a full one blocks `up`
    with open(log, "w") as err:
        up = subprocess.Popen([sys.executable, "-m", "clawr1.cli.main", "up", "--model", str(model), "--data-dir",
                               str(data_dir), "--port", str(port)], stderr=err, text=True)
    try:
        wait_for(lambda: healthy(base), timeout=180, what="clawr1 up to serve")
        lean = json.loads(clawr1("openclaw-config", "--model", str(model), "--data-dir", str(data_dir), "--port",
                                 str(port), "--max-tokens", "48", "--workspace", str(tmp_path / "ws")).stdout)
        assert "headers" not in lean["models"]["providers"]["clawr1"]  # nothing but the base URL identifies turns
        claw = OpenClaw(folder, node, tmp_path / "home", lean)
        for message in MESSAGES:
            reply = claw.say("conversation-1", message)
            assert not any(p.get("isError") for p in reply["payloads"]), reply["payloads"]
            assert "".join(p.get("text") or "" for p in reply["payloads"]).strip()

        with SQLitePool(data_dir) as pool:
            sessions = pool.sessions()
            assert len(sessions) == 1, sessions  # three OpenClaw turns, one session, found by history alone
            turns = [t for t in pool.show(sessions[0]["session_id"])["steps"] if t["turn_type"] == "main"]
            steps = pool.get_steps([t["step_id"] for t in turns])
        asked = [s.messages[-1]["content"] for s in steps if s.messages[-1]["role"] == "user"]
        assert [next(m for m in MESSAGES if m in str(text)) for text in asked] == MESSAGES  # in order
        assert [t["turn_index"] for t in turns] == list(range(len(turns)))
        for turn, following in itertools.pairwise(turns):  # every turn is paired with the next one's state
            assert turn["next_step_id"] == following["step_id"]
        assert MESSAGES[1] in json.dumps(steps[0].next_state)

        # OpenClaw compacts the conversation, then the user goes on: still the same session.
        assert claw.compact("conversation-1")["compacted"] is True
        after = "One more: what is the capital of Italy?"
        claw.say("conversation-1", after)
        with SQLitePool(data_dir) as pool:
            sessions = {s["session_id"]: pool.show(s["session_id"])["steps"] for s in pool.sessions()}
            main = [[t for t in turns if t["turn_type"] == "main"] for turns in sessions.values()]
            main = [turns for turns in main if turns]
            side = [t for turns in sessions.values() for t in turns if t["turn_type"] == "side"]
            assert len(main) == 1 and len(main[0]) == len(MESSAGES) + 1, sessions  # not split by the compaction
            assert len(side) == 1  # OpenClaw's own summarising call: recorded, never trained
            summariser, last = pool.get_steps([side[0]["step_id"], main[0][-1]["step_id"]])
            paired = pool.get_steps([main[0][-2]["step_id"]])[0]
        assert summariser.messages[0]["content"].startswith("You are a context summarization assistant.")
        assert "was compacted into the following summary" in json.dumps(last.messages)  # the compacted request
        assert main[0][-2]["next_step_id"] == main[0][-1]["step_id"]  # the turn before it got its next state
        assert after in json.dumps(paired.next_state)
        stored = sum(len(turns) for turns in sessions.values())

        # OpenClaw's own full prompt: a 400 context_length_exceeded it reports, nothing stored, server fine.
        full = json.loads(clawr1("openclaw-config", "--model", str(model), "--data-dir", str(data_dir), "--port",
                                 str(port), "--prompt", "full", "--workspace", str(tmp_path / "ws-full")).stdout)
        overflow = OpenClaw(folder, node, tmp_path / "home-full", full).say("conversation-2", "Hello!")
        assert any(p.get("isError") and "context" in p["text"].lower() for p in overflow["payloads"]), overflow
        with SQLitePool(data_dir) as pool:
            assert pool.stats()["steps"] == stored
        assert healthy(base)
    finally:
        interrupt(up)
    assert up.returncode == 0, log.read_text()[-3000:]



# A reply with a run that OpenClaw's transcript redaction masks before it resends it (its
# `maskToken`: the first six characters, `…`, the last four), and one whose whitespace it may trim.
SECRETIVE = ("Sure. Log in with sk-live-teeth-with-braces-2024 and open the settings page; "
             "then choose a new password there.  ")


def test_openclaw_resends_a_masked_reply_and_the_conversation_stays_one_session(engine, tmp_path):
    scripted = ScriptedEngine(engine, SECRETIVE)
    scripted.max_context = 8192  # scripted: no model runs, so OpenClaw's lean prompt may be longer than the tiny one's
    node = node_bin()
    folder = npm_install("openclaw", OPENCLAW, node=node)
    with live_gateway(scripted, tmp_path / "data", 'engine.model="smollm2-135m-instruct"') as (base, pool):
        config = load_config(None, ['engine.model="smollm2-135m-instruct"'])
        claw = OpenClaw(folder, node, tmp_path / "home", openclaw_config(
            config, base_url=f"{base}/v1", context=8192, max_tokens=48, lean=True, workspace=str(tmp_path / "ws")))
        for message in MESSAGES:
            claw.say("masked", message)
        wait_for(lambda: pool.stats()["steps"] >= len(MESSAGES), what="every turn recorded")
        [session] = pool.sessions()  # one conversation, one session: the masked resend still matched
        turns = pool.show(session["session_id"], session["tenant"], "session")["steps"]
        steps = pool.get_steps([t["step_id"] for t in turns])
    resent = [m for m in steps[1].messages if m["role"] == "assistant"]
    assert resent and all("sk-live-teeth-with-braces-2024" not in json.dumps(m) for m in resent), resent  # it did mask
    assert [t["turn_index"] for t in turns] == list(range(len(MESSAGES)))
    assert all(t["next_step_id"] == u["step_id"] for t, u in itertools.pairwise(turns))
