"""Fixtures for the multi-process pipeline tests: tiny model directories on disk (every rank loads one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.tiny_dir import write_tiny_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0, layers=4)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", seed=1, layers=5)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dir(tmp_path_factory.mktemp("tiny") / "qwen3_moe", "qwen3_moe", seed=2, layers=4)
