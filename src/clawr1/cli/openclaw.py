"""`clawr1 openclaw-config`: an `openclaw.json` that points the real, unmodified OpenClaw at this
gateway (`../shared/OPENCLAW.md` and OpenClaw's own `docs/gateway/local-models.md` are the sources).

How OpenClaw's prompt meets a small model's context, decided here and documented in docs/gateway.md (Clients):
OpenClaw's default system prompt (~38-47k characters: workspace bootstrap files, skills, tool
guidance) plus 12 tool schemas is ~12.7k tokens in SmolLM2's tokenizer, more than its 8,192-token
context. Below `LEAN_BELOW` tokens of context this config makes the prompt lean on the client side,
with OpenClaw's own documented switches: no bootstrap files and no context injection, no skills,
and the `minimal` tool profile (which also keeps a model under training away from `exec` and file
writes). That prompt is ~7.5k characters plus 3 tools, ~2.5k tokens. The gateway never truncates:
whatever still does not fit gets OpenAI's 400 `context_length_exceeded`, which OpenClaw reports as
"Context overflow" and tries to compact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clawr1.core.config import Config

PROVIDER = "clawr1"
KEY_ENV = "CLAWR1_API_KEY"
LOCAL_MARKER = "clawr1-local"  # OpenClaw accepts a non-secret marker for a loopback provider
LEAN_BELOW = 32_768  # tokens of context under which OpenClaw's full prompt and tools cannot fit with a history


def model_id(config: Config) -> str:
    return Path(config.engine.model).name


def provider(config: Config, *, base_url: str, context: int, max_tokens: int) -> dict[str, Any]:
    """The `models.providers.clawr1` entry: OpenAI chat completions with streaming, an idle timeout
    that the gateway's empty-delta keep-alives reset, and the model's real context window (OpenClaw
    sizes its prompt, output budget and compaction from it)."""
    return {
        "baseUrl": base_url,
        # A key is never printed: with agent keys configured OpenClaw reads it from the environment.
        "apiKey": f"${{{KEY_ENV}}}" if config.gateway.api_keys else LOCAL_MARKER,
        "api": "openai-completions",
        "timeoutSeconds": 300,
        "models": [{
            "id": model_id(config), "name": f"Claw-R1 ({model_id(config)})", "reasoning": False, "input": ["text"],
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            "contextWindow": context, "maxTokens": max_tokens,
        }],
    }


def openclaw_config(config: Config, *, base_url: str, context: int, max_tokens: int, lean: bool,
                    workspace: str | None = None) -> dict[str, Any]:
    """A whole `openclaw.json`: the provider as the only model source, and OpenClaw's offline hygiene
    (no update checks, telemetry, mDNS, catalog refresh, cron or heartbeat model calls, which would
    otherwise arrive as turns nobody asked for)."""
    defaults: dict[str, Any] = {"model": {"primary": f"{PROVIDER}/{model_id(config)}"}, "heartbeat": {"every": "0m"}}
    if workspace:
        defaults["workspace"] = workspace
    out: dict[str, Any] = {
        "models": {"mode": "replace", "catalogRefresh": {"enabled": False},
                   "providers": {PROVIDER: provider(config, base_url=base_url, context=context, max_tokens=max_tokens)}},
        "agents": {"defaults": defaults},
        "update": {"checkOnStart": False}, "telemetry": {"enabled": False},
        "discovery": {"mdns": {"mode": "off"}}, "cron": {"enabled": False},
    }
    if lean:
        defaults.update(skipBootstrap=True, contextInjection="never", skills=[])
        out["tools"] = {"profile": "minimal"}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="the gateway as OpenClaw reaches it (default http://HOST:PORT/v1 from the config)")
    p.add_argument("--max-tokens", type=int, help="OpenClaw's reply cap (default: a quarter of the context, at most 1024)")
    p.add_argument("--prompt", choices=["auto", "lean", "full"], default="auto",
                   help=f"lean: OpenClaw's small prompt and minimal tools; auto = lean below {LEAN_BELOW} tokens of context")
    p.add_argument("--workspace", help="OpenClaw's agent workspace directory (default: OpenClaw's own)")
    p.add_argument("--provider-only", action="store_true",
                   help="print only the models.providers.clawr1 entry, to merge into an existing openclaw.json")


def cmd_openclaw_config(args: argparse.Namespace, config: Config) -> int:
    from clawr1.engine.models import context_window

    context = context_window(config.engine.model, config.data_dir, config.engine.max_context)
    max_tokens = args.max_tokens or min(1024, context // 4)
    if not 1 <= max_tokens < context:
        print(f"error: --max-tokens must be between 1 and the context ({context})", file=sys.stderr)
        return 2
    base_url = args.base_url or f"{config.gateway.scheme}://{config.gateway.host}:{config.gateway.port}/v1"
    if args.provider_only:
        out: dict[str, Any] = provider(config, base_url=base_url, context=context, max_tokens=max_tokens)
    else:
        lean = args.prompt == "lean" or (args.prompt == "auto" and context < LEAN_BELOW)
        out = openclaw_config(config, base_url=base_url, context=context, max_tokens=max_tokens, lean=lean,
                              workspace=args.workspace)
    print(json.dumps(out, indent=2))
    where = "merge it under models.providers.clawr1" if args.provider_only else \
        "save it as ~/.openclaw/openclaw.json (or point OPENCLAW_CONFIG_PATH at it)"
    key = f"; export {KEY_ENV}=<one of gateway.api_keys>" if config.gateway.api_keys else ""
    print(f"# {where}{key}; context {context} tokens, replies up to {max_tokens}", file=sys.stderr)
    return 0
