"""Injected env latency (`python -m envservice --step-delay SPEC`, envservice/latency.py): the spec parser and
its messages, the seeded distributions, the delay counted toward `--step-timeout` (in-process and in a
worker process), and a real service whose delayed steps from several sessions overlap."""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from envservice.__main__ import parse_args
from envservice.backends import InProcessBackend
from envservice.client import EnvClient
from envservice.errors import EnvTimeoutError
from envservice import registry
from envservice.envs.base import Task
from envservice.envs.testing import ENTRY_POINT as FAULTY
from envservice.host import EnvHost
from envservice.latency import (
    DelayedEnv,
    InjectedLatency,
    LatencySampler,
    LatencySpec,
    LatencySpecError,
    parse_latency_spec,
)
from envservice.process import EnvServiceProcess
from envservice.protocol import ErrorCode, ErrorResponse

pytestmark = pytest.mark.timeout(120)

VALID_FORMS = "valid specs: fixed:SECONDS, uniform:min=A,max=B, lognormal:median=M,sigma=S[,max=X]"


# ---- the parser ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, params", [
    ("fixed:0.1", "fixed", {"seconds": 0.1}),
    ("fixed:0", "fixed", {"seconds": 0.0}),
    (" FIXED: 2 ", "fixed", {"seconds": 2.0}),
    ("uniform:min=0.1,max=0.5", "uniform", {"min": 0.1, "max": 0.5}),
    ("uniform:max=1, min=1", "uniform", {"min": 1.0, "max": 1.0}),
    ("lognormal:median=0.2,sigma=1.0,max=5", "lognormal", {"median": 0.2, "sigma": 1.0, "max": 5.0}),
    ("lognormal:sigma=0.5,median=1", "lognormal", {"median": 1.0, "sigma": 0.5}),
])
def test_valid_specs_parse(text: str, kind: str, params: dict) -> None:
    assert parse_latency_spec(text) == LatencySpec(kind, params)


@pytest.mark.parametrize("text, reason", [
    ("gauss:1", "unknown kind 'gauss'"),
    ("0.1", "expected KIND:PARAMETERS"),
    ("fixed:", "fixed needs parameters, e.g. fixed:SECONDS"),
    ("fixed:fast", "fixed='fast' is not a number"),
    ("fixed:-1", "fixed=-1 must be a finite number >= 0"),
    ("fixed:nan", "fixed=nan must be a finite number >= 0"),
    ("fixed:seconds=1", "fixed takes one number of seconds, not 'seconds=1'"),
    ("uniform:min=2,max=1", "max=1 is below min=2"),
    ("uniform:min=1", "uniform needs max=..."),
    ("lognormal:median=0.2", "lognormal needs sigma=..."),
    ("lognormal:median=0.2,sigma=1,mean=3", "lognormal has no parameter 'mean' (its parameters: median, sigma, max)"),
    ("lognormal:median=0.2,median=0.3,sigma=1", "median is given twice"),
    ("lognormal:median,sigma=1", "'median' is not NAME=VALUE"),
    ("lognormal:median=0,sigma=1", "median must be > 0 (use fixed:0 for no delay)"),
    ("lognormal:median=1,sigma=1,max=0.5", "max=0.5 is below median=1"),
    ("lognormal:median=1,sigma=inf", "sigma=inf must be a finite number >= 0"),
])
def test_bad_specs_name_the_flag_the_bad_part_and_the_valid_forms(text: str, reason: str) -> None:
    with pytest.raises(LatencySpecError) as failure:
        parse_latency_spec(text, "--create-delay")
    assert str(failure.value) == f"--create-delay {text!r}: {reason}; {VALID_FORMS}"


def test_command_line_refuses_a_bad_spec_and_builds_the_samplers(capsys) -> None:
    with pytest.raises(SystemExit) as failure:
        parse_args(["--step-delay", "lognormal:median=0.2"])
    assert str(failure.value) == (f"envservice: --step-delay 'lognormal:median=0.2': lognormal needs sigma=...; "
                                  f"{VALID_FORMS}")
    assert parse_args([]).latency is None
    latency = parse_args(["--step-delay", "fixed:0.1", "--create-delay", "uniform:min=0,max=1",
                          "--step-delay-seed", "7"]).latency
    assert latency.step.spec == LatencySpec("fixed", {"seconds": 0.1}) and latency.step_delay() == 0.1
    assert latency.create.spec.kind == "uniform" and 0 <= latency.create_delay() <= 1
    only_create = parse_args(["--create-delay", "fixed:1"]).latency
    assert only_create.step is None and only_create.step_delay() == 0.0 and only_create.create_delay() == 1.0


def test_describe_gives_the_shape_and_its_figures() -> None:
    spec = parse_latency_spec("lognormal:median=0.2,sigma=1.0,max=5")
    assert spec.describe() == ("lognormal(median=0.2 s, sigma=1, max=5 s): mean 0.329 s, p50 0.2 s, p90 0.72 s, "
                               "p99 2.05 s")
    latency = InjectedLatency.from_specs(parse_latency_spec("fixed:0.3"), parse_latency_spec("fixed:1"))
    assert latency.describe() == "fixed 0.3 s; create: fixed 1 s"


# ---- the distributions -----------------------------------------------------------------------------


def test_seeded_draws_are_reproducible_and_the_seed_matters() -> None:
    spec = parse_latency_spec("lognormal:median=0.2,sigma=1.0,max=5")
    first, again, other = (LatencySampler(spec, seed) for seed in (0, 0, 1))
    draws = [first.draw() for _ in range(100)]
    assert draws == [again.draw() for _ in range(100)]
    assert draws != [other.draw() for _ in range(100)]
    latency = InjectedLatency.from_specs(spec, spec, seed=0)
    assert [latency.step_delay() for _ in range(5)] != [latency.create_delay() for _ in range(5)]  # own streams


def test_lognormal_median_mean_and_cap_over_many_draws() -> None:
    spec = parse_latency_spec("lognormal:median=0.2,sigma=1.0,max=1.5")
    rng = random.Random(123)
    draws = [spec.draw(rng) for _ in range(40_000)]
    assert statistics.median(draws) == pytest.approx(0.2, rel=0.04)
    assert statistics.fmean(draws) == pytest.approx(spec.mean(), rel=0.03)
    assert max(draws) == 1.5 and min(draws) > 0  # capped, and the cap is reached (P(X > 1.5) ~ 2 %)
    assert sum(d == 1.5 for d in draws) / len(draws) == pytest.approx(1 - statistics.NormalDist().cdf(2.015), abs=0.005)
    assert spec.quantile(0.5) == pytest.approx(0.2) and spec.quantile(0.999) == 1.5


def test_fixed_and_uniform_draws() -> None:
    rng = random.Random(0)
    assert {parse_latency_spec("fixed:0.25").draw(rng) for _ in range(10)} == {0.25}
    uniform = parse_latency_spec("uniform:min=0.1,max=0.3")
    draws = [uniform.draw(rng) for _ in range(10_000)]
    assert 0.1 <= min(draws) < 0.11 and 0.29 < max(draws) <= 0.3
    assert statistics.fmean(draws) == pytest.approx(uniform.mean(), rel=0.02)


# ---- where the delay is slept: inside the call's time limit ----------------------------------------


def _fixed(step: float | None = None, create: float | None = None) -> InjectedLatency:
    return InjectedLatency.from_specs(LatencySpec("fixed", {"seconds": step}) if step is not None else None,
                                      LatencySpec("fixed", {"seconds": create}) if create is not None else None)


def test_inprocess_delay_counts_toward_the_step_timeout(make_client, test_envs) -> None:
    client = make_client(backend=InProcessBackend(step_timeout_s=0.5, latency=_fixed(step=3.0)))
    session = client.post("/create", json={"env_id": "counting"}).json()["session_id"]
    started = time.monotonic()
    response = client.post("/step", json={"session_id": session, "action": "inc"})
    assert time.monotonic() - started < 2.0  # answered at the limit, not after the whole delay
    error = ErrorResponse.model_validate(response.json())
    assert (response.status_code, error.code) == (504, ErrorCode.env_timeout)
    assert "did not finish step within 0.5 s (--step-timeout)" in error.message


def test_inprocess_create_delay_counts_toward_the_limit_and_steps_wait_theirs(make_client, test_envs) -> None:
    client = make_client(backend=InProcessBackend(step_timeout_s=0.5, latency=_fixed(create=3.0)))
    response = client.post("/create", json={"env_id": "counting"})
    assert (response.status_code, response.json()["code"]) == (504, "env_timeout")
    unlimited = make_client(backend=InProcessBackend(step_timeout_s=0, latency=_fixed(step=0.2)))
    session = unlimited.post("/create", json={"env_id": "counting"}).json()["session_id"]
    started = time.monotonic()
    assert unlimited.post("/step", json={"session_id": session, "action": "inc"}).json()["observation"] == "value 1"
    assert time.monotonic() - started >= 0.2


def test_delayed_env_passes_everything_else_through(test_envs) -> None:
    env = InProcessBackend(step_timeout_s=0, latency=_fixed(step=0.0)).build(registry.get("counting"))
    assert isinstance(env, DelayedEnv)
    env.reset(None)
    assert env.step("inc")[0] == "value 1" and env.evaluate() == (0.0, False) and env.value == 1


def test_worker_host_sleeps_the_delay_before_the_env_call() -> None:
    host = EnvHost()
    started = time.monotonic()
    ok, (observation, _) = host.handle("reset", "k", (FAULTY, Task(split="train", index=0, name="count", seed=0), 0.2))
    assert ok and observation == "value 0" and time.monotonic() - started >= 0.2
    started = time.monotonic()
    ok, result = host.handle("step", "k", ("inc", 0.2))
    assert ok and result[0] == "value 1" and time.monotonic() - started >= 0.2
    assert host.handle("step", "k", ("inc",))[1][0] == "value 2"  # no delay argument: none slept


# ---- a real service --------------------------------------------------------------------------------

DELAY_S = 0.3
SESSIONS = 8


@pytest.fixture(scope="module")
def delayed_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServiceProcess]:
    log = tmp_path_factory.mktemp("envservice") / "service.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--step-delay", f"fixed:{DELAY_S}"], log_path=log,
                           startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""}) as service:
        yield service


@pytest.mark.slow
def test_real_service_logs_the_delay_and_steps_take_it(delayed_service) -> None:
    assert f"injecting step latency: fixed {DELAY_S:g} s (seed 0;" in delayed_service.log_tail(50)
    with EnvClient(delayed_service.url, retries=0) as client:
        created = client.create("frozenlake", task_id=0, seed=0)
        started = time.monotonic()
        client.step(created.session_id, "right")
        assert time.monotonic() - started >= DELAY_S
        client.release(created.session_id)


@pytest.mark.slow
def test_real_service_overlaps_delayed_steps_of_many_sessions(delayed_service) -> None:
    with EnvClient(delayed_service.url, retries=0) as client:
        sessions = [client.create("frozenlake", task_id=task, seed=0).session_id for task in range(SESSIONS)]

        def timed_step(session_id: str) -> float:
            started = time.monotonic()
            client.step(session_id, "down")
            return time.monotonic() - started

        with ThreadPoolExecutor(SESSIONS) as pool:
            started = time.monotonic()
            steps = [pool.submit(timed_step, session_id) for session_id in sessions]
            time.sleep(DELAY_S / 3)  # every step is asleep in its delay now
            health_started = time.monotonic()
            assert client.health().sessions == SESSIONS
            health_s = time.monotonic() - health_started
            durations = [step.result() for step in steps]
            wall = time.monotonic() - started
        for session_id in sessions:
            client.release(session_id)
    assert min(durations) >= DELAY_S
    # Serialized, the steps would take SESSIONS x DELAY_S = 2.4 s; overlapped, a little over one delay.
    assert wall < SESSIONS * DELAY_S / 3, (wall, durations)
    # The service answers other requests while they sleep: the delay blocks neither its loop nor its threads.
    assert health_s < DELAY_S / 2, health_s


@pytest.mark.slow
def test_real_worker_process_counts_the_delay_toward_the_step_timeout(tmp_path) -> None:
    with EnvServiceProcess(["faulty"], backend="process", workers=1, step_timeout_s=0.5,
                           extra_args=["--register", f"faulty={FAULTY}", "--step-delay", "fixed:3"],
                           log_path=tmp_path / "service.log", startup_timeout_s=60,
                           env={"ENVSERVICE_TOKEN": ""}) as service:
        with EnvClient(service.url, retries=0, timeout=30) as client:
            created = client.create("faulty")
            started = time.monotonic()
            with pytest.raises(EnvTimeoutError) as failure:
                client.step(created.session_id, "inc")
            assert time.monotonic() - started < 2.5
    assert failure.value.code == ErrorCode.env_timeout and "within 0.5 s (--step-timeout)" in failure.value.message


def test_inprocess_limit_counts_from_the_call_start_not_from_its_wait_for_a_thread(test_envs, step_all_at_once) -> None:
    """#33 finding 4, in-process backend: with every call thread busy, a call queued for one is waiting, not
    hanging. One thread, four 1 s steps at once and a 2.5 s limit: the last starts 3 s after it was sent, and
    the limit used to count from then (`env_timeout` for the third and fourth); now each has 2.5 s from its start."""
    backend = InProcessBackend(step_timeout_s=2.5, threads=1, latency=_fixed(step=1.0))
    assert step_all_at_once(backend, "counting")[1] == ["value 1"] * 4
