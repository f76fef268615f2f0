"""The async bench's `--trainer-cores`: the trainer's process (and every thread of it) moved to its cores, nothing
else of the run moved, and a bad CPU list named (bench/async_cpu.py, issue #72)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

CPUS = sorted(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="placing the trainer on cores of its own needs 2 CPUs")


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("async_cpu")


@pytest.fixture
def run_tree():
    """A stand-in for a training run: a shell whose children are a process titled as Ray titles verl's actor worker
    (with a second thread, started before the placement) and one titled as vLLM's server."""
    threads = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    script = (f"(exec -a 'ray::WorkerDict.actor_rollout_update_actor' {sys.executable} -c '{threads}') & "
              f"(exec -a 'ray::vLLMHttpServer' sleep 60) & wait")
    root = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    yield root
    os.killpg(root.pid, 9)
    root.wait()


def children_titled(root: int, prefix: str) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(root).children(recursive=True)
            if " ".join(child.cmdline()).startswith(prefix)]


def test_the_trainer_process_and_all_its_threads_move_and_nothing_else(bench, run_tree):
    trainer_cores = frozenset(CPUS[-1:])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # both children started, the trainer's second thread too
        trainers = children_titled(run_tree.pid, "ray::WorkerDict")
        if trainers and len(os.listdir(f"/proc/{trainers[0]}/task")) == 2 and children_titled(run_tree.pid, "ray::vLLM"):
            break
        time.sleep(0.1)
    (trainer,), (server,) = children_titled(run_tree.pid, "ray::WorkerDict"), children_titled(run_tree.pid, "ray::vLLM")

    placer = bench.CorePlacer(trainer_cores, run_tree.pid)
    placer.poll()

    assert placer.trainer_pids == {trainer}
    assert {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{trainer}/task")} == {
        int(tid): set(trainer_cores) for tid in os.listdir(f"/proc/{trainer}/task")}
    assert os.sched_getaffinity(server) == set(CPUS)  # inherited, left as it was
    assert os.sched_getaffinity(0) == set(CPUS)  # the bench's own placement is main()'s, not the placer's


def test_a_bad_cpu_list_is_named_with_the_cpus_there_are(bench):
    with pytest.raises(ValueError, match=r"'x' is not a CPU id"):
        bench.parse_cores("x")
    everything = ",".join(map(str, CPUS))
    with pytest.raises(ValueError, match=re.escape(f"some, not all, of the CPUs this process may run on, {CPUS}")):
        bench.parse_cores(everything)
    assert bench.parse_cores(f"{CPUS[-1]}") == frozenset(CPUS[-1:])
    assert bench.parse_cores(f"{CPUS[0]}-{CPUS[0]}") == frozenset(CPUS[:1])
