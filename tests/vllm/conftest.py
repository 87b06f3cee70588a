"""Fixtures of the two-process vLLM engine tests (`test_connector`, `test_router_params`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtopo_worker.vllm import offline as harness

    return harness.write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def engines(tmp_path: Path, model_dir: str) -> Iterator[object]:
    from tests.vllm.test_connector import Engines

    e = Engines(tmp_path, model_dir)
    try:
        yield e
    finally:
        e.close()
