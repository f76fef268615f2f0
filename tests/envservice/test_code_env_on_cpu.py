"""The `code` env (envservice/envs/code_env.py, issue #52): HumanEval's 164 problems, every solution run in the
real sandbox. The gold test runs all canonical solutions (and none), an episode is played over a real envservice
on loopback, and hostile solutions are contained with reward 0 while the service stays up."""

from __future__ import annotations

import json
import os

import psutil
import pytest

import envservice.envs.code_env as code_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY
from envservice.envs.code_env import CodeEnv, problems, program
from envservice.server import EnvServiceConfig, create_app
from sandbox import SandboxConfig, run_sandboxed

GOLD_DRIVER = """
import json, sys
results = []
for source in json.load(open(sys.argv[1])):
    try:
        exec(compile(source, "<solution>", "exec"), {"__name__": "__main__"})
        results.append(True)
    except BaseException:
        results.append(False)
print(json.dumps(results))
"""


def write(code: str) -> str:
    return json.dumps({"name": "write", "arguments": {"code": code}})


def test_every_canonical_solution_passes_and_an_empty_one_never(tmp_path):
    """HumanEval's gold: the same test programs the env runs (`program`), all 164 problems, in one sandboxed
    process (one Python start instead of 328)."""
    every = list(problems().values())
    sources = [program(p, p.canonical_solution, p.hidden_check) for p in every]
    sources += [program(p, "    pass\n", p.hidden_check) for p in every]
    (tmp_path / "programs.json").write_text(json.dumps(sources))
    done = run_sandboxed(["python", "-I", "-c", GOLD_DRIVER, str(tmp_path / "programs.json")],
                         SandboxConfig(writable=(str(tmp_path),), cpu_s=120), wall_s=300)
    assert done.returncode == 0, done.stderr.text()
    results = json.loads(done.stdout.text())
    assert len(every) == 164 and results[:164] == [True] * 164
    assert sum(results[164:]) == 0


def test_the_splits_are_disjoint_by_problem_text():
    train, test = CodeEnv.splits["train"], CodeEnv.splits["test"]
    assert len(train) + len(test) == 164 and not set(train) & set(test)
    fingerprints = {split: {CodeEnv.task_fingerprint(code_env.Task(split, i, name, 0))
                            for i, name in enumerate(names)} for split, names in CodeEnv.splits.items()}
    assert not fingerprints["train"] & fingerprints["test"] and len(fingerprints["test"]) == len(test) > 0


def test_the_state_key_is_the_solution_and_the_best_visible_share_it_passed():
    """GiGPO's anchor (#53): what the next action starts from. A refused action, a run that passes no more tests and
    another session writing the same code keep it or reach it; a write of other code or a better run change it."""
    name = next(name for name in CodeEnv.splits["train"] if problems()[name].visible_check)
    problem, task = problems()[name], CodeEnv.resolve_task(name, "train", 0, {})
    env, other = CodeEnv(), CodeEnv()
    start = env.reset(task)[1][STATE_KEY]
    assert other.reset(task)[1][STATE_KEY] == start
    assert env.step("just do it")[4][STATE_KEY] == start
    stub = write(f"def {problem.entry_point}(*args):\n    return None")
    written = env.step(stub)[4][STATE_KEY]
    assert written != start and other.step(stub)[4][STATE_KEY] == written
    assert env.step(json.dumps({"name": "run"}))[4][STATE_KEY] == written  # 0 passed: the best share stays 0
    solved = env.step(write(problem.prompt + problem.canonical_solution))[4][STATE_KEY]
    ran = env.step(json.dumps({"name": "run"}))
    assert ran[0] == f"All {problem.visible_count} visible test(s) passed."
    assert solved not in (start, written) and ran[4][STATE_KEY] not in (start, written, solved)


@pytest.fixture(scope="module")
def service(serve_app):
    with serve_app(create_app(EnvServiceConfig(env_ids=["code"], max_sessions=8))) as url, EnvClient(url) as client:
        yield client


def test_an_episode_write_run_fix_submit(service):
    name = CodeEnv.splits["train"][0]
    problem = problems()[name]
    created = service.create("code", task_id=name, params={"visible_reward": 0.5})
    assert f"```python\n{problem.prompt}```" in created.observation and "visible test" in created.observation
    session = created.session_id
    assert "Invalid action: write one tool call as JSON" in service.step(session, "just do it").observation
    assert "no tool 'compile'" in service.step(session, json.dumps({"name": "compile"})).observation
    assert "Nothing to run yet" in service.step(session, json.dumps({"name": "run"})).observation
    assert "over 20000" in service.step(session, write("x" * 20_001)).observation
    assert "lone surrogate" in service.step(session, write("x = '\ud800'")).observation
    stub = f"def {problem.entry_point}(*args):\n    return None"
    assert "Saved the solution (2 lines)" in service.step(session, write(stub)).observation
    failed = service.step(session, json.dumps({"name": "run"}))
    assert f"0 of {problem.visible_count} visible test(s) passed" in failed.observation
    assert "visible test 1 failed: assert candidate(" in failed.observation and failed.reward == 0.0
    fenced = f"```python\n{problem.prompt}{problem.canonical_solution}```"
    assert "Saved the solution" in service.step(session, fenced).observation  # a bare code block is a write
    passed = service.step(session, json.dumps({"name": "run"}))
    assert passed.observation == f"All {problem.visible_count} visible test(s) passed." and passed.reward == 0.5
    assert service.step(session, json.dumps({"name": "run"})).reward == 0.0  # no new visible test passed
    submitted = service.step(session, json.dumps({"name": "submit"}))
    assert submitted.terminated and submitted.reward == 1.0 and "hidden tests passed" in submitted.observation
    scored = service.evaluate(session)
    assert scored.success and scored.score == 1.0
    service.release(session)


HOSTILE = {
    "socket": "import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return 1",
    "environment": "import os\n    raise RuntimeError(sorted(os.environ))",
    "fork bomb": "import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass",
    "endless loop": "while True:\n        pass",
    "10 GB": "hoard = bytearray(10 << 30)\n    return hoard",
}


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_a_hostile_solution_scores_0_and_the_service_stays_up(service, attack, monkeypatch):
    monkeypatch.setattr(code_env, "RUN_TIMEOUT_S", 3.0)
    monkeypatch.setenv("CODE_ENV_SECRET", "secret-of-the-service")
    port = int(service.base_url.rsplit(":", 1)[1].strip("/"))
    name = CodeEnv.splits["train"][1]
    problem = problems()[name]
    body = HOSTILE[attack].format(port=port)
    session = service.create("code", task_id=name).session_id
    service.step(session, write(f"def {problem.entry_point}(*args):\n    {body}\n"))
    submitted = service.step(session, json.dumps({"name": "submit"}))
    assert submitted.terminated and submitted.reward == 0.0 and "hidden tests failed" in submitted.observation
    assert "secret-of-the-service" not in submitted.observation and "CODE_ENV_SECRET" not in submitted.observation
    if attack == "socket":
        assert "ConnectionRefusedError" in submitted.observation or "OSError" in submitted.observation
    if attack in ("endless loop", "fork bomb"):
        assert "stopped after 3 s" in submitted.observation
    if attack == "10 GB":
        assert "MemoryError" in submitted.observation
    assert service.evaluate(session).score == 0.0
    service.release(session)
    assert service.health().sessions == 0
    leftovers = [p for p in psutil.Process(os.getpid()).children(recursive=True) if "python" in " ".join(p.cmdline())
                 and "-I" in p.cmdline()]
    assert leftovers == []
