"""`python -m envservice --backend ray --ray-address local`: the service starts its own Ray, plays an episode
through its actors, and stopping it ends that Ray too (quickly: no shutdown waiting on a signalled Ray)."""

from __future__ import annotations

import time

import psutil
import pytest

from envservice.client import EnvClient
from envservice.process import EnvServiceProcess

pytest.importorskip("ray")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.startup]  # Ray's start: the full run only


def test_local_ray_service_plays_an_episode_and_stops_its_ray(tmp_path, play_frozenlake_oracle) -> None:
    service = EnvServiceProcess(["frozenlake"], backend="ray", ray_address="local", workers=2,
                                log_path=tmp_path / "service.log", startup_timeout_s=240,
                                env={"ENVSERVICE_TOKEN": ""})
    with service:
        assert service.backend == "ray, 2 actors, address local"
        ray_processes = psutil.Process(service.process.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes)
        with EnvClient(service.url, timeout=60) as client:
            step, evaluation = play_frozenlake_oracle(client)
            assert step.terminated and step.reward == 1.0 and evaluation.success
        started = time.monotonic()
    assert time.monotonic() - started < 8.0, service.log_tail()
    assert not [p for p in ray_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
