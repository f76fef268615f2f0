"""Start-up preload: the served envs' classes are imported before the service reports ready, in the service
process (checked in-process: `create_app` under TestClient with its lifespan running) and in every worker of
a `ProcessBackend` (checked by asking the worker which modules it holds), outside the step time limit.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Iterator

import pytest

import envservice.envs
from envservice import registry
from envservice.__main__ import build_settings, parse_args
from envservice.backends import InProcessBackend, WorkerHandle
from envservice.client import EnvClient
from envservice.process import EnvServiceProcess
from envservice.workers import ProcessBackend

pytestmark = pytest.mark.timeout(60)

BABYAI_MODULE = "envservice.envs.babyai"
BABYAI = f"{BABYAI_MODULE}:BabyAIEnv"
MISSING = "no_such_module_for_the_preload_test:Env"

PROBE_SOURCE = '''
from envservice.envs.base import TextEnv


class ProbeEnv(TextEnv):
    description = "test env: preload probe"
    splits = {"train": ["only"]}
    params = {}

    def reset(self, task):
        return "start", {}

    def step(self, action):
        return "done", 1.0, True, False, {}

    def evaluate(self):
        return 1.0, True
'''


@pytest.fixture
def probe_env(tmp_path, monkeypatch) -> Iterator[str]:
    """A throw-away env `preloadprobe` in a module nothing imported before; yields the module name."""
    module = f"preload_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(PROBE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("preloadprobe", f"{module}:ProbeEnv", max_steps=5, max_sessions=3)
    yield module
    registry.unregister("preloadprobe")
    sys.modules.pop(module, None)


def _imported(worker: WorkerHandle, modules: list[str]) -> list[str]:
    """The modules of `modules` that `worker` has imported (the host's `imported` request)."""
    ok, payload = worker.request("imported", "", (modules,), 30)
    assert ok, payload
    return payload


# ---- in the service process ----------------------------------------------------------------------------


def test_startup_imports_the_served_envs_before_serving(make_client, monkeypatch, caplog) -> None:
    # Forget babyai's module for this test (both restored after it), so that only the start-up can import it.
    monkeypatch.delitem(sys.modules, BABYAI_MODULE, raising=False)
    monkeypatch.delattr(envservice.envs, "babyai", raising=False)
    caplog.set_level(logging.INFO, logger="envservice")
    client = make_client(env_ids=["babyai", "frozenlake"])
    assert BABYAI_MODULE in sys.modules  # no request was made: the lifespan imported it
    preload = client.app.state.preload
    assert sorted(preload.seconds) == ["babyai", "frozenlake"] and preload.failures == {}
    assert any("env 'babyai' imported in" in record.getMessage() for record in caplog.records)
    created = client.post("/create", json={"env_id": "babyai", "task_id": 0, "seed": 0})
    assert created.status_code == 200, created.text


@pytest.mark.parametrize("preload", [True, False])
def test_settings_preload_switches_the_import_at_startup(make_client, probe_env: str, preload: bool) -> None:
    client = make_client(env_ids=["preloadprobe"], preload=preload)
    assert (probe_env in sys.modules) is preload
    assert (client.app.state.preload is None) is not preload
    assert client.post("/create", json={"env_id": "preloadprobe"}).status_code == 200
    assert probe_env in sys.modules  # without a preload the first create imported it


def test_an_env_that_fails_to_import_is_logged_and_the_others_are_served(make_client, caplog) -> None:
    registry.register("brokenimport", MISSING, max_steps=5, max_sessions=3)
    try:
        caplog.set_level(logging.INFO, logger="envservice")
        client = make_client(env_ids=["brokenimport", "frozenlake"])
        assert client.get("/healthz").json()["status"] == "ok"
        warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert len(warnings) == 1 and "'brokenimport'" in warnings[0] and "ModuleNotFoundError" in warnings[0]
        assert list(client.app.state.preload.failures) == ["brokenimport"]
        response = client.post("/create", json={"env_id": "brokenimport"})
        usual = make_client(env_ids=["brokenimport"], preload=False).post("/create", json={"env_id": "brokenimport"})
        def without_request_id(answer) -> dict:
            return {key: value for key, value in answer.json().items() if key != "request_id"}

        assert (response.status_code, without_request_id(response)) == (usual.status_code, without_request_id(usual))
        # A clear env_error naming the env and the failed import, not a bare 500.
        assert response.status_code == 500 and response.json()["code"] == "env_error"
        assert "env 'brokenimport' cannot be loaded" in response.json()["message"]
        assert "ModuleNotFoundError" in response.json()["message"]
        assert client.post("/create", json={"env_id": "frozenlake"}).status_code == 200
        # The listing leaves the broken env out instead of failing for every env.
        assert [spec["id"] for spec in client.get("/envs").json()["envs"]] == ["frozenlake"]
    finally:
        registry.unregister("brokenimport")


def test_no_preload_flag_reaches_the_settings() -> None:
    backend = InProcessBackend(step_timeout_s=0)
    assert build_settings(parse_args([]), ["babyai"], None, backend).preload is True
    assert build_settings(parse_args(["--no-preload"]), ["babyai"], None, backend).preload is False


def test_cli_with_no_preload_starts_and_serves(tmp_path) -> None:
    with EnvServiceProcess(["frozenlake"], extra_args=["--no-preload"], log_path=tmp_path / "service.log",
                           startup_timeout_s=50, env={"ENVSERVICE_TOKEN": ""}) as service:
        with EnvClient(service.url, timeout=20, retries=0) as client:
            created = client.create("frozenlake", task_id=0, seed=0)
            client.release(created.session_id)


# ---- in worker processes ---------------------------------------------------------------------------------


def test_process_workers_import_the_preloaded_envs_outside_the_step_limit(wait_for) -> None:
    backend = ProcessBackend(1, step_timeout_s=0.5)  # babyai's import takes longer than this limit
    try:
        worker = backend.workers()[0]
        assert _imported(worker, [BABYAI_MODULE]) == []
        failures = backend.preload([BABYAI, MISSING])
        assert list(failures) == [MISSING] and "ModuleNotFoundError" in failures[MISSING]  # reported, not raised
        assert backend.workers() == [worker] and worker.alive  # not killed by the 0.5 s step limit
        assert _imported(worker, [BABYAI_MODULE]) == [BABYAI_MODULE]
        worker.kill("killed by the test")
        assert wait_for(lambda: backend.workers()[0] is not worker, 10)
        successor = backend.workers()[0]  # preloaded too, in the background
        assert wait_for(lambda: _imported(successor, [BABYAI_MODULE]) == [BABYAI_MODULE], 30)
    finally:
        backend.shutdown()


def test_a_worker_that_dies_importing_is_reported_and_not_preloaded_again(tmp_path, monkeypatch, wait_for) -> None:
    (tmp_path / "preload_exit_probe.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers start with this process's sys.path
    backend = ProcessBackend(1, step_timeout_s=5)
    try:
        first = backend.workers()[0]
        failures = backend.preload(["preload_exit_probe:Env"])
        assert "died while importing it" in failures["preload_exit_probe:Env"]
        assert "exited with exit code 3" in failures["preload_exit_probe:Env"]
        assert wait_for(lambda: backend.workers()[0] is not first, 10)
        successor = backend.workers()[0]
        # Its successor is not asked to import it again (that would kill it too, and so on in a loop).
        assert _imported(successor, ["preload_exit_probe"]) == [] and backend._preload_entry_points == ()
        assert not wait_for(lambda: backend.workers()[0] is not successor, 3) and successor.alive
    finally:
        backend.shutdown()
