"""`clawr1` command line: a thin layer over the roles. Each subcommand is one small function."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clawr1.cli import export as export_cli
from clawr1.cli import memory as memory_cli
from clawr1.cli import openclaw as openclaw_cli
from clawr1.cli import tasks as tasks_cli
from clawr1.cli import versions as versions_cli
from clawr1.core.config import Config, load_config, to_toml
from clawr1.core.types import EngineError, SamplingParams
from clawr1.entrypoints.serve import cmd_serve
from clawr1.entrypoints.train import cmd_train
from clawr1.entrypoints.up import cmd_up

console = Console()
err_console = Console(stderr=True)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted override, e.g. --set engine.max_batch=16 (repeatable)")
    parser.add_argument("--data-dir", type=Path, help="where models, adapters and data live")
    parser.add_argument("--model", help="'smollm2-135m-instruct' (embedded) or a local HF model directory")
    parser.add_argument("--threads", type=int, help="torch threads for this process (0 = torch default)")


# Dedicated flags and the config key each one sets (a flag absent from a subcommand is skipped).
FLAGS = {"data_dir": "data_dir", "model": "engine.model", "threads": "engine.threads",
         "host": "gateway.host", "port": "gateway.port", "method": "trainer.method",
         "batch_size": "trainer.batch_size", "prm_m": "reward.prm_m", "w_opd": "trainer.w_opd",
         "w_rl": "trainer.w_rl", "log_format": "log_format"}


def resolve(args: argparse.Namespace) -> Config:
    """Config from file, then --set overrides, then the dedicated flags."""
    overrides = list(args.overrides)
    for flag, key in FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(str(value) if isinstance(value, Path) else value)}")
    return load_config(args.config, overrides)


def cmd_config(args: argparse.Namespace, config: Config) -> int:
    sys.stdout.write(to_toml(config))  # plain: rich would wrap long comment lines into invalid TOML
    return 0


def cmd_models(args: argparse.Namespace, config: Config) -> int:
    from clawr1.engine.models import list_models

    table = Table("name", "status", "path", title="Local models (never downloaded from a hub)")
    for info in list_models(config.data_dir):
        table.add_row(info.name, info.status, info.path)
    console.print(table)
    return 0


def cmd_chat(args: argparse.Namespace, config: Config) -> int:
    from clawr1.engine import load_engine

    async def run() -> int:
        with err_console.status(f"Loading {config.engine.model} ..."):
            engine = load_engine(config)
        try:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            e = config.engine  # unset: the model's recommended sampling, as the gateway serves it
            chosen = engine.sampling_defaults.overridden(e.temperature, e.top_p, e.top_k).overridden(args.temperature,
                                                                                                  None, None)
            sampling = SamplingParams(max_tokens=args.max_tokens or config.engine.default_max_tokens, seed=args.seed,
                                      temperature=chosen.temperature, top_p=chosen.top_p, top_k=chosen.top_k)
            stream = engine.generate(engine.render(messages), sampling)
            async for event in stream:
                console.out(event.text, end="", highlight=False)
            gen = await stream.final()
            console.out("")
            err_console.print(f"[dim]{len(gen.token_ids)} tokens, finish={gen.finish_reason}, "
                              f"policy version v{gen.version}[/dim]")
            return 0
        finally:
            await engine.close()

    return asyncio.run(run())


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from clawr1.demo.run import DemoSettings, run_demo

    # Only what the user set: trainer settings the demo is not told stay the product's defaults.
    fields = {k: getattr(args, k) for k in DemoSettings.model_fields if getattr(args, k, None) is not None}
    fields["method"] = config.trainer.method
    settings = DemoSettings(**fields)
    if args.from_runs:
        return _plot_saved(args.from_runs, args.plot, Path(str(config.engine.model)).name)
    if args.plot:
        from clawr1.demo.plot import plot_runs

        results = [asyncio.run(run_demo(config, settings.model_copy(update={"method": m}), console))
                   for m in args.methods.split(",")]
        plot_runs(results, args.plot, Path(str(config.engine.model)).name)
        err_console.print(f"plot written to {args.plot}")
        return 0
    asyncio.run(run_demo(config, settings, console))
    return 0


def _plot_saved(paths: list[Path], out: Path | None, model: str) -> int:
    """`clawr1 demo --from-runs`: plot saved runs (`demo.json`) without running anything; a run made
    with `--memory` gets the memory's four-way figure, beside the first run made without it."""
    from clawr1.demo.plot import plot_memory, plot_runs

    if out is None:
        raise SystemExit("--from-runs needs --plot OUT.png")
    runs = [json.loads(Path(p).read_text()) for p in paths]
    with_memory = [r for r in runs if r["settings"].get("memory")]
    without = [r for r in runs if not r["settings"].get("memory")]
    if with_memory:
        plot_memory(with_memory[0], without[0] if without else None, out, model)
    else:
        plot_runs(runs, out, model)
    err_console.print(f"plot written to {out}")
    return 0


def cmd_eval(args: argparse.Namespace, config: Config) -> int:
    from openai import AsyncOpenAI

    from clawr1.demo.evaluate import evaluate
    from clawr1.demo.preferences import parse_preferences
    from clawr1.demo.report import rate
    from clawr1.demo.users import HELD_OUT, make_users

    base = args.base_url or f"{config.gateway.scheme}://{config.gateway.host}:{config.gateway.port}"
    key = args.api_key or (config.gateway.api_keys[0] if config.gateway.api_keys else "none")
    if args.tasks:
        args.max_tokens = args.max_tokens or 128
        try:
            return tasks_cli.eval_tasks(args, config, base, key)
        except ValueError as exc:
            err_console.print(f"[red]error:[/red] {exc}")
            return 2
    args.max_tokens = args.max_tokens or 64
    preferences = parse_preferences(args.preferences)

    async def measure():  # the client closes inside the loop that opened its connections
        async with AsyncOpenAI(base_url=f"{base.rstrip('/')}/v1", api_key=key, max_retries=0, timeout=600) as client:
            return await evaluate(client, make_users(len(preferences), args.seed + 7919, preferences),
                                  max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                  questions=HELD_OUT)

    result = asyncio.run(measure()).as_dict()
    title = (f"held-out evaluation ({', '.join(preferences)}): the served version and the base on the same "
             "prompts and seeds")
    table = Table("replies of", "n", "preferred and sane", "... and substantive", "preference score", "sane rate",
                  "substantive", "relevance", "fluency", "KL", "words", title=title)
    rows = [(f"served {v}", s) for v, s in result["by_version"].items()]
    rows.append(("base (X-Policy-Version: 0)", result["base"]))
    for label, s in rows:
        table.add_row(label, str(s["n"]), rate(s["preferred_and_sane"]), rate(s["preferred_sane_substantive"]),
                      rate(s["score"]), rate(s["sane_rate"]), rate(s["substantive"]), rate(s["relevance"]),
                      rate(s["fluency"]), rate(s["kl"]), f"{s['mean_words']:.0f}")
    console.print(table)
    console.print("by preference (served): " + ", ".join(f"{k} {v:.2f}" for k, v in result["by_preference"].items()))
    if result["quality_error"]:
        console.print(f"[yellow]quality not measured:[/yellow] {result['quality_error']}")
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_train_flow(args: argparse.Namespace, config: Config) -> int:
    from clawr1.entrypoints.whitebox import train_flow
    from clawr1.envs import task_set
    from clawr1.flows import load_flow
    from clawr1.flows.rollouts import results_table, summary

    try:
        flow_class, tasks = load_flow(args.flow), task_set(args.tasks)
        heldout = task_set(args.heldout, n=args.heldout_n, default_split="heldout") if args.heldout else None
    except (ValueError, TypeError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    flow = flow_class(config) if args.max_turns is None else flow_class(config, max_turns=args.max_turns)
    result = train_flow(config, flow, tasks, group=args.group, epochs=args.epochs, steps=args.steps,
                        tasks_per_step=args.tasks_per_step, concurrency=args.concurrency, heldout=heldout,
                        eval_every=args.eval_every, console=err_console)
    numbers = summary(result.rollouts)
    if args.plot and result.curve:
        from clawr1.flows.plot import plot_curve

        plot_curve(result.curve, args.plot, f"train-flow {args.flow} on {args.tasks}: held-out {args.heldout}")
        err_console.print(f"curve written to {args.plot}")
    if args.json:
        print(json.dumps({"run_id": result.run_id, "version": result.version, "summary": numbers,
                          "steps": result.steps, "curve": result.curve,
                          "rollouts": [r.as_dict() for r in result.rollouts]}))
    else:
        console.print(results_table(result.rollouts, f"train-flow {Path(args.flow).name} ({result.run_id})"))
        console.print(f"{len(result.steps)} optimizer steps, policy v{result.version}; {json.dumps(numbers)}")
    return 0


def cmd_run_agent(args: argparse.Namespace, config: Config) -> int:
    from clawr1.entrypoints.blackbox import run_agent
    from clawr1.envs import task_set
    from clawr1.flows.rollouts import results_table, summary

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        err_console.print("[red]error:[/red] give the agent command after --, e.g. run-agent --tasks T -- python agent.py")
        return 2
    try:
        tasks = task_set(args.tasks)
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    try:
        results = run_agent(config, command, tasks, group=args.group, base_url=args.base_url, serve=args.serve,
                            api_key=args.api_key, timeout_s=args.timeout, concurrency=args.concurrency,
                            console=err_console)
    except ConnectionError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 1
    if args.json:
        print(json.dumps({"summary": summary(results), "rollouts": [r.as_dict() for r in results]}))
    else:
        console.print(results_table(results, f"run-agent {' '.join(command)}"))
        console.print(json.dumps(summary(results)))
    return 0


def cmd_pool(args: argparse.Namespace, config: Config) -> int:
    from clawr1.datapool import open_existing_pool

    pool = open_existing_pool(config)
    try:
        if args.action == "stats":
            from clawr1.engine import adapters

            newest = adapters.latest(Path(config.data_dir) / "adapters", "policy")
            stats = {**pool.stats(args.tenant), "versions": newest[0] if newest else 0}  # newest published policy version
            if args.json:
                print(json.dumps(stats))
            else:
                table = Table("metric", "value", title=f"Data pool at {config.data_dir}")
                for key, value in stats.items():
                    table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
                console.print(table)
        elif args.action == "sessions":
            print(json.dumps(pool.sessions(), indent=2))
        elif args.action == "show":
            if not args.ident:
                err_console.print("[red]error:[/red] pool show needs a session or step id")
                return 2
            try:
                shown = pool.show(args.ident, tenant=args.tenant)
            except KeyError as exc:  # no such step or session
                err_console.print(f"[red]error:[/red] {exc.args[0]}")
                return 1
            except ValueError as exc:  # a session id several tenants use: `--tenant` names one
                err_console.print(f"[red]error:[/red] {exc} (--tenant NAME)")
                return 2
            print(json.dumps(shown, indent=2, default=str))
        elif args.action == "export":
            out = args.out or Path(f"clawr1-export.{args.format}")
            with err_console.status(f"Exporting to {out} ..."):
                rows = pool.export(out, args.format, rewarded_only=args.rewarded_only)
            err_console.print(f"{rows} rows -> {out} (load with datasets.load_dataset("
                              f"{'json' if args.format == 'jsonl' else 'parquet'!r}, data_files={str(out)!r}))")
    finally:
        pool.close()
    return 0


def benchmark(name: str) -> Any:
    """`benchmarks.<name>` from the checkout this clawr1 runs from (the benchmarks are not in the
    installed package: `pip install -e .` from a clone has them beside `src/`)."""
    import importlib

    import clawr1

    root = Path(clawr1.__file__).resolve().parents[2]
    if (root / "benchmarks" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", f"benchmarks.{name}"):
            raise
        raise ValueError(f"`clawr1 bench` runs from a checkout of Claw-R1 (benchmarks/ beside src/, installed "
                         f"with pip install -e .); {root} has no benchmarks/{name}.py") from exc


def cmd_bench(args: argparse.Namespace, config: Config) -> int:
    try:
        bench = benchmark(args.what.replace("-", "_"))
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 2
    if args.what == "engine":
        numbers = bench.run(config, max_tokens=args.max_tokens, console=console)
    elif args.what == "pool":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="clawr1-bench-pool-") as tmp:  # never the user's pool
            numbers = bench.bench_pool(Path(tmp), steps=args.steps, config=config.pool)
    elif args.what == "gateway":
        if args.rounds < 1:
            err_console.print(f"[red]error:[/red] --rounds must be at least 1, got {args.rounds}")
            return 2
        numbers = bench.run(config, console, requests=args.requests, include_litellm=not args.no_litellm,
                            durable_both=args.durable == "both", workers=args.workers, fronts=args.fronts,
                            rounds=args.rounds, profile=args.profile)
    elif args.what == "trainer":
        numbers = bench.run(config, console, device=args.device, dtype=args.dtype, shape=args.shape,
                            samples=args.samples, reply_tokens=args.reply_tokens,
                            micro_batches=tuple(int(m) for m in args.micro_batches.split(",")),
                            grad_checkpointing=args.grad_checkpointing, nproc=args.nproc,
                            finetune=args.finetune)
    elif args.what == "judge-tools":
        numbers = bench.run(config, console, llm=args.llm, per_split=args.per_split)
    else:  # judge, swap, latency, scale, crash, precision: each module's run(config, console)
        numbers = bench.run(config, console)
    if args.json:
        print(json.dumps(numbers))
    return 0


def log_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-json", dest="log_format", action="store_const", const="json",
                        help="log one JSON object a line (time, level, logger, message, extras); "
                             "the same as --set log_format=\"json\"")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawr1", description="Runtime RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="print the resolved configuration as TOML")
    _common(p)
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("models", help="list the models available locally")
    _common(p)
    p.set_defaults(fn=cmd_models)

    p = sub.add_parser("chat", help="one chat turn on the engine, streamed to the terminal")
    _common(p)
    p.add_argument("prompt")
    p.add_argument("--system", help="a system message")
    p.add_argument("--max-tokens", type=int, help="default: engine.default_max_tokens")
    p.add_argument("--temperature", type=float, help="default: the model's recommended one (engine.temperature)")
    p.add_argument("--seed", type=int)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible gateway: serve and record (no training)")
    _common(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    log_flag(p)
    p.set_defaults(fn=cmd_serve)

    def loop_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--method", choices=["rl", "opd", "combine"], help="training objective (default combine)")
        p.add_argument("--batch-size", type=int, help="samples per optimizer step (default 16)")
        p.add_argument("--prm-m", type=int, help="judge votes per turn (default 3; 1 for opd)")
        p.add_argument("--w-opd", type=float, help="combine: weight of the OPD advantage")
        p.add_argument("--w-rl", type=float, help="combine: weight of the reward")

    p = sub.add_parser("up", help="the main job: gateway + engine + pool + judge + trainer")
    _common(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--ray", action="store_true", help="the roles as Ray actors on a local Ray instance "
                   "(ray.replicas engine replicas, pool service, trainer, judges)")
    p.add_argument("--ray-address", help="the same on an existing Ray cluster (e.g. 127.0.0.1:6379)")
    p.add_argument("--trainer-procs", type=int, default=1,
                   help="data-parallel trainer ranks (`clawr1 train --nproc`): one per GPU, or CPU processes")
    loop_flags(p)
    log_flag(p)
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("train", help="the trainer alone: lease samples, train LoRA, publish versions")
    _common(p)
    loop_flags(p)
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint (the trainer always continues from one when it exists)")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel trainer ranks on this host (one per GPU, or CPU processes with gloo)")
    log_flag(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("demo", help="simulated users teach the main job their style preferences, live")
    _common(p)
    loop_flags(p)
    p.add_argument("--steps", type=int, help="optimizer steps (policy versions) to reach (default 16)")
    p.add_argument("--users", type=int, help="simulated users talking at once (default 9)")
    p.add_argument("--turns", type=int, help="user messages per conversation (default 3)")
    p.add_argument("--lr", type=float, help="LoRA learning rate (default: the product's trainer.lr)")
    p.add_argument("--preferences", help="the users' preferences, comma-separated (default short,no-bold,no-steps; "
                   "also no-exclamation, no-first-person, by-name)")
    p.add_argument("--max-tokens", type=int, help="reply length cap the users set (default 64)")
    p.add_argument("--temperature", type=float, help="sampling temperature the users set (default: none, as "
                   "stock clients: the model's recommended sampling applies)")
    p.add_argument("--seed", type=int, help="seeds users and evaluation (default 0)")
    p.add_argument("--max-minutes", type=float, help="stop talking after this long (default 14)")
    p.add_argument("--eval-questions", type=int, help="held-out questions per preference, before and after (default 8)")
    p.add_argument("--eval-every", type=int, help="also evaluate on held-out prompts every K versions (a curve)")
    p.add_argument("--plot", type=Path, help="run each of --methods in turn and plot preference and quality "
                   "per version to this PNG")
    p.add_argument("--methods", default="rl,opd,combine", help="with --plot: the methods to compare")
    p.add_argument("--from-runs", type=Path, nargs="+", metavar="DEMO_JSON",
                   help="with --plot: plot these saved runs (demo.json) instead of running; a --memory run "
                   "is drawn four ways beside a run without memory")
    p.add_argument("--users-want-substance", action="store_true", default=None,
                   help="the users also complain about an answer that says nothing the question did not")
    p.add_argument("--memory", action="store_true", default=None,
                   help="the users name themselves (X-User-Id), so their corrections reach their next turns "
                   "through the memory; the held-out evaluation asks as the same users")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("eval", help="preference score and reply quality of the served version and the base on "
                       "held-out prompts (side turns: never trained)")
    _common(p)
    p.add_argument("--scenario", choices=["personal"], default="personal")
    p.add_argument("--base-url", help="the gateway (default: the config's gateway host and port)")
    p.add_argument("--api-key", help="an agent key (default: the first of gateway.api_keys)")
    p.add_argument("--max-tokens", type=int, help="reply length cap (default 64; with --tasks 128)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preferences", help="the users' preferences, comma-separated (default short,no-bold,no-steps)")
    tasks_cli.eval_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_eval)
    tasks_cli.add_arguments(sub, _common)

    p = sub.add_parser("train-flow", help="white-box offline: G rollouts per task of a Python flow, GRPO, LoRA")
    _common(p)
    p.add_argument("flow", help="'tool-agent', package.module:Class or path/to/file.py:Class (an AgentFlow)")
    p.add_argument("--tasks", required=True, help="a tasks JSONL file, a shipped set (terminal, toolcall, swe) or "
                   "a task family (clawr1 tasks; family:NAME:heldout for its held-out split)")
    p.add_argument("--group", type=int, default=4, help="G: rollouts per task, one GRPO group (default 4)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the tasks (default 1)")
    p.add_argument("--steps", type=int, help="exactly N rounds (one optimizer step each), cycling over the tasks")
    p.add_argument("--tasks-per-step", type=int, help="tasks per round (default all)")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts at once (default 8)")
    p.add_argument("--max-turns", type=int, help="tool-agent: model calls per rollout (default 8)")
    p.add_argument("--method", choices=["rl", "opd", "combine"], help="training objective (default combine)")
    p.add_argument("--prm-m", type=int, help="judge votes per intermediate turn")
    p.add_argument("--heldout", help="tasks evaluated (side turns) at v0, every --eval-every versions and at the end: "
                   "families (comma-separated, their held-out split; 'all'), a file or a set")
    p.add_argument("--heldout-n", type=int, help="with family --heldout: tasks per family (default: the split's size)")
    p.add_argument("--eval-every", type=int, default=4, help="with --heldout: versions between evaluations (default 4)")
    p.add_argument("--plot", type=Path, help="with --heldout: the curve (success and sane rate per version) as a PNG")
    p.add_argument("--json", action="store_true", help="print the rollouts and step metrics as JSON")
    p.set_defaults(fn=cmd_train_flow)

    p = sub.add_parser("run-agent", help="black-box offline: run an external agent command over a task set")
    _common(p)
    p.add_argument("--tasks", required=True, help="a tasks JSONL file, or a shipped set: terminal, toolcall, swe")
    p.add_argument("--group", type=int, default=1, help="rollouts per task, sharing a group id (default 1)")
    p.add_argument("--base-url", help="a running gateway (default: the config's gateway host and port)")
    p.add_argument("--serve", action="store_true", help="serve a gateway (with the judge) in-process for the run")
    p.add_argument("--api-key", help="an agent key (default: the first of gateway.api_keys)")
    p.add_argument("--timeout", type=float, default=600.0, help="wall-time limit per agent run in seconds")
    p.add_argument("--concurrency", type=int, default=1, help="agent runs at once (default 1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: the agent (reads OPENAI_BASE_URL, "
                   "CLAWR1_TASK_PROMPT, ...; its last stdout line is its answer)")
    p.set_defaults(fn=cmd_run_agent)

    p = sub.add_parser("pool", help="inspect the data pool")
    _common(p)
    p.add_argument("action", choices=["stats", "sessions", "show", "export"])
    p.add_argument("ident", nargs="?", help="a session or step id (for show)")
    p.add_argument("--tenant", help="stats: that tenant's counts only; show: the tenant whose session or step it is")
    p.add_argument("--json", action="store_true")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="export format")
    p.add_argument("--out", type=Path, help="export file (default clawr1-export.FORMAT)")
    p.add_argument("--rewarded-only", action="store_true", help="export only samples with a reward")
    p.set_defaults(fn=cmd_pool)

    p = sub.add_parser("export", help="main turns as a TRL training set (jsonl, parquet, hf) with filters")
    _common(p)
    export_cli.add_arguments(p)
    p.set_defaults(fn=export_cli.cmd_export)

    p = sub.add_parser("openclaw-config", help="an openclaw.json that points the real OpenClaw at this gateway")
    _common(p)
    p.add_argument("--host", help="the gateway's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the gateway's port (default 8000)")
    openclaw_cli.add_arguments(p)
    p.set_defaults(fn=openclaw_cli.cmd_openclaw_config)

    versions_cli.add_arguments(sub, _common)
    memory_cli.add_arguments(sub, _common)

    p = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    _common(p)
    p.add_argument("what", choices=["engine", "pool", "gateway", "judge", "judge-tools", "trainer", "swap", "latency", "scale", "models",
                                      "crash", "precision"])
    p.add_argument("--max-tokens", type=int, default=64, help="engine: tokens per request")
    p.add_argument("--steps", type=int, default=20_000, help="pool: steps to write")
    p.add_argument("--requests", type=int, default=2000, help="gateway: requests per measurement at 64 clients")
    p.add_argument("--no-litellm", action="store_true", help="gateway: skip the LiteLLM comparison")
    p.add_argument("--durable", choices=["config", "both"], default="config",
                   help="gateway: `both` also runs it with gateway.durable_reply off, to price the commit")
    p.add_argument("--workers", type=int, default=1,
                   help="gateway: also run it with gateway.workers = N (front + N processes), for the scaling")
    p.add_argument("--fronts", type=int, default=1, help="gateway, with --workers: gateway.fronts (front processes)")
    p.add_argument("--rounds", type=int, default=3,
                   help="gateway: measure every target N times, taking turns; each number the median of its rounds")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="gateway: afterwards, profile one more gateway process and print its N costliest functions")
    p.add_argument("--llm", action="store_true", help="judge-tools: also the configured model as an LLM judge")
    p.add_argument("--per-split", type=int, default=16, help="judge-tools: tasks per family and split")
    p.add_argument("--device", default="cpu", help="trainer: torch device of both sides (cpu, cuda, cuda:N)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="trainer: base weights' dtype (LoRA stays float32)")
    p.add_argument("--shape", help="trainer: a random model of this architecture instead of the configured "
                                   "model (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, llama-3.1-8b)")
    p.add_argument("--samples", type=int, default=8, help="trainer: replies per step")
    p.add_argument("--reply-tokens", type=int, default=256, help="trainer: tokens per reply")
    p.add_argument("--micro-batches", default="8,4,2", help="trainer: our micro-batch sizes to measure")
    p.add_argument("--grad-checkpointing", action="store_true", help="trainer: ours with gradient checkpointing")
    p.add_argument("--nproc", type=int, default=1,
                   help="trainer: also run ours as N data-parallel ranks, beside one process (threads split)")
    p.add_argument("--finetune", choices=["lora", "full"], default="lora",
                   help="trainer: full = every weight trains (FSDP2 over --nproc ranks); ours only")
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train --nproc N` relaunches itself as ranks
    try:
        config = resolve(args)
    except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        err_console.print(f"[red]config error:[/red] {escape(str(exc))}")  # its [..] is text, not markup
        return 2
    if args.command in ("up", "serve", "train"):  # long-running: their events (swaps, judge errors) are logged
        from clawr1.entrypoints import logs

        logs.configure(config.log_format, logs.secrets_of(config), console=err_console)
    try:
        return args.fn(args, config)
    except (EngineError, FileNotFoundError, ImportError) as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
