"""The real embedded SmolLM2-135M-Instruct, converted once from its PyPI GGUF into a fresh data dir."""

import asyncio

import pytest

from clawr1.core.config import EngineConfig
from clawr1.engine.local import LocalEngine
from clawr1.engine.models import resolve_model


@pytest.fixture(scope="session")
def real_data_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("clawr1-data")
    resolve_model("smollm2-135m-instruct", data_dir)  # the real first-use conversion (~35 s)
    return data_dir


@pytest.fixture(scope="session")
def real_engine(real_data_dir):
    engine = LocalEngine.load(resolve_model("smollm2-135m-instruct", real_data_dir), EngineConfig(threads=2))
    yield engine
    asyncio.run(engine.close())
