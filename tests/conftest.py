"""Shared fixtures: a tiny random model with SmolLM2's real tokenizer and chat template.

The tiny model has SmolLM2's architecture (Llama), vocabulary and template but 2 layers of width
64, so engine maths is exact and fast. `tests/integration` uses the real embedded SmolLM2.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

# Tests never reach a model hub; everything loads from local files. Set before transformers loads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from clawr1.core.config import EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.engine.local import LocalEngine


def embedded_tokenizer(name: str = "smollm2-135m-instruct"):
    """An embedded model's tokenizer. Converting it from the GGUF takes 6 s (SmolLM2) to 20 s (Qwen,
    whose six chunks are assembled first), which every test worker paid; it is converted once per
    machine and kept under `$CLAWR1_TEST_CACHE` (default ~/.cache/clawr1-tests), keyed by the GGUF
    chunks and the transformers version, then read back in a fraction of a second. The engine under
    test always loads the copy saved in the model dir."""
    import tempfile

    import transformers

    from clawr1.engine.models import EMBEDDED, assemble, chunk_files

    files = chunk_files(EMBEDDED[name])
    assert not isinstance(files, str), f"tests need the embedded model packages: {files}"
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(f"{stats}:{transformers.__version__}".encode()).hexdigest()
    root = Path(os.environ.get("CLAWR1_TEST_CACHE") or Path.home() / ".cache" / "clawr1-tests")
    cache = root / f"{name}-tokenizer-{key[:16]}"
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        gguf = assemble(EMBEDDED[name], Path(scratch) / "model.gguf")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = root / f"{cache.name}.{os.getpid()}.partial"
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(cache)  # atomic: a reader sees the whole directory or none
    except OSError:  # another worker got there first
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


def smollm2_tokenizer():
    return embedded_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    # std 0.5 gives peaked, non-uniform distributions, so greedy/sampling/adapter effects are visible.
    config.initializer_range = 0.5
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-smollm2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model of Qwen2.5's shape (qwen2: attention biases, an untied head) with
    Qwen2.5-Coder's real tokenizer, chat template (tools included) and recommended sampling."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from clawr1.engine.models import EMBEDDED

    tokenizer = embedded_tokenizer("qwen2.5-coder-0.5b-instruct")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    config.initializer_range = 0.5  # peaked distributions, as the tiny SmolLM2's
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-qwen")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation,
                                                             **EMBEDDED["qwen2.5-coder-0.5b-instruct"].sampling}))
    return path


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8, score_from_prefix=False))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def fresh_engine(tiny_model_dir: Path):
    """An engine of the test's own (adapters loaded into it do not leak into other tests)."""
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8, score_from_prefix=False))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def served(tiny_model_dir: Path):
    """A fake SGLang server (`tests/sglang_fake.py`: SGLang's documented API over the real local
    engine): (url, its app, the engine behind it)."""
    from clawr1.entrypoints.server import in_thread, make_server
    from tests.sglang_fake import sglang_app

    backend = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8, score_from_prefix=False))
    app = sglang_app(backend)
    server = make_server(app)
    with in_thread(server, server.serve, name="fake-sglang", start_timeout_s=30) as background:
        yield f"http://127.0.0.1:{background.port}", app, backend
    asyncio.run(backend.close())


@pytest.fixture
def pool_later(monkeypatch):
    """`pool_later(s)`: the data pool's clock (`datapool.ops.clock`) jumps `s` seconds ahead and runs
    on from there: lease expiry and judge back-off without sleeping."""
    import time

    from clawr1.datapool import ops

    offset = [0.0]
    monkeypatch.setattr(ops, "clock", lambda: time.time() + offset[0])

    def advance(seconds: float) -> None:
        offset[0] += seconds

    return advance


def run(coro):
    """Run a coroutine to completion (tests stay plain functions)."""
    return asyncio.run(coro)


# Test tiers (markers): `integration` (the real embedded SmolLM2) and `system` (other processes and
# services: Ray, PostgreSQL, Chromium, npm, whole `clawr1 up` / demo runs, trainer ranks, crash and
# fault benchmarks, the fuzzer). The fast tier for the edit-test loop is everything else:
#   .venv/bin/python -m pytest -q -m "not system and not integration" tests
# `.ci/run` runs every tier.
SYSTEM_MODULES = {
    "test_ray", "test_postgres", "test_up", "test_up_server", "test_up_workers", "test_demo_run", "test_trainer_ranks",
    "test_bench_crash", "test_bench_trainer", "test_bench_swap", "test_bench_gateway", "test_faults",
    "test_clients", "test_dashboard", "test_schemathesis", "test_trainability", "test_gpu_check",
}


TIERS = ("system", "integration")


def _tier(path: Path) -> str | None:
    """The marker every test of a module gets for its tier (`system`, `integration`), if any."""
    if "integration" in path.parts:
        return "integration"
    return "system" if path.stem in SYSTEM_MODULES else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module whose tier `-m` deselects is not imported at all: deselecting happens after
    collection, and importing Ray, schemathesis and the real model's modules cost every fast-tier
    worker ~1.5 s for tests it never runs. A module is skipped only when the expression is false
    whatever its tests' other markers: with its tier's marker, with or without the `system` one
    its postgres-parametrised tests also get, and with every other marker absent or present."""
    is_test = collection_path.name.startswith("test_") and collection_path.suffix == ".py"
    tier = _tier(collection_path) if is_test else None
    if tier is None or not config.option.markexpr:
        return None
    from _pytest.mark.expression import Expression  # what `-m` evaluates (pytest's own)

    try:
        expression = Expression.compile(config.option.markexpr)
    except SyntaxError:
        return None  # pytest itself reports the malformed expression, once

    def selects(marks: set[str], others: bool) -> bool:
        return expression.evaluate(lambda name, /, **_: name in marks or (others and name not in TIERS))

    chances = [({tier}, False), ({tier}, True), ({tier, "system"}, False), ({tier, "system"}, True)]
    return None if any(selects(marks, others) for marks, others in chances) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(Path(str(item.fspath)))
        if tier is not None:
            item.add_marker(tier)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("open_test_pool") == "postgres":
            item.add_marker(pytest.mark.system)


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this test session (started on first use)."""
    from tests.pg_helpers import start

    server = start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def open_test_pool(request, tmp_path):
    """`open_test_pool(config=None, like=None)`: a pool on each backend the contract covers."""
    from clawr1.datapool import SQLitePool

    opened = []

    def make(config=None, like=None):
        """A new pool; `like=`: a second one on the same database, as another process would open."""
        if request.param == "postgres":
            from clawr1.datapool.postgres import PostgresPool

            pool = PostgresPool(like.dsn if like else request.getfixturevalue("postgres").fresh(), config)
        else:
            pool = SQLitePool(like.path.parent if like else tmp_path, config)
        opened.append(pool)
        return pool

    yield make
    for pool in opened:
        pool.close()


QUESTIONS = [f"Question number {i}: tell me something." for i in range(12)]


@pytest.fixture(scope="module")
def generations(engine):
    """Real sampled replies of the tiny engine (ids + behaviour logprobs)."""
    async def go():
        out = []
        for i, q in enumerate(QUESTIONS):
            messages = [{"role": "user", "content": q}]
            gen = await engine.generate(engine.render(messages), SamplingParams(max_tokens=12, temperature=1.0,
                                                                                seed=i)).final()
            out.append((messages, gen))
        return out
    return run(go())
