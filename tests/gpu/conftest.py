"""Fixtures of the GPU checks: run an example launcher YAML on a real GPU, as a user would, and keep its output.

The checks need CUDA and are skipped without it (the reason names what to run instead). On the lent GPU machine
they run through `bash scripts/gpu/checks.sh training` (docs/gpus.md, "Running the GPU checks on a machine
without network"); on a GPU node with `bash scripts/install.sh --gpu` done, `.venv/bin/python -m pytest tests/gpu`.

Where flash-attn is not installed (the lent machine has only scripts/gpu/device/shim/flash_attn), the runs use
PyTorch's sdpa attention and no remove-padding, since both of verl's defaults call flash-attn kernels.
`BEYOND_GPU_OVERRIDES` (space-separated Hydra overrides) is appended to every run, to try a setting on the
device without editing a file. `BEYOND_GPU_REPORT_DIR` keeps each run's launcher output as `<name>.log` there
(scripts/gpu/checks.sh points it into $OUT); otherwise it goes to the test's temporary folder.

`BEYOND_GPU_CHECKS_ON_CPU=1` runs the same checks on CPU with verl_cpu's overrides, to rehearse them before
spending GPU time (a CPU run proves the checks' logic, not the GPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from beyond_agent.run_folder import MetricsLog

REPO_ROOT = Path(__file__).resolve().parents[2]
REHEARSE_ON_CPU = os.environ.get("BEYOND_GPU_CHECKS_ON_CPU") == "1"
NO_FLASH_ATTN = ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                 "actor_rollout_ref.model.use_remove_padding=false"]


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (False where torch is the CPU build)."""
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every check of this folder is skipped, with what to run instead, unless CUDA is here or a CPU rehearsal."""
    if cuda_available() or REHEARSE_ON_CPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run bash scripts/gpu/checks.sh on a GPU machine "
                                   "(docs/gpus.md), or BEYOND_GPU_CHECKS_ON_CPU=1 to rehearse on CPU")
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(skip)


def has_flash_attn_kernels() -> bool:
    """Whether the real flash-attn is installed (the lent machine's stand-in has no flash_attn_interface)."""
    return (importlib.util.find_spec("flash_attn") is not None
            and importlib.util.find_spec("flash_attn.flash_attn_interface") is not None)


def machine_overrides() -> list[str]:
    """What this machine needs on top of a YAML: sdpa without flash-attn and vLLM's worker in its engine core's
    process on a GPU, verl_cpu's overrides when rehearsing."""
    from verl_cpu.overrides import IN_PROCESS_WORKER, cpu_overrides

    if REHEARSE_ON_CPU:  # verl_cpu's overrides ask for sdpa, no remove-padding and the in-process worker themselves
        overrides = cpu_overrides()
    else:
        # verl 0.9.0 starts vLLM's worker in a process of its own (`mp`) even at TP 1: on the H200 (2026-11-28) that
        # process took 25 s from the engine core's first line to its own. `uni`, vLLM's own choice at TP 1, runs it
        # in the engine core's process (verl's worker extension reaches it the same way, through collective_rpc).
        overrides = [IN_PROCESS_WORKER] + ([] if has_flash_attn_kernels() else list(NO_FLASH_ATTN))
    return overrides + shlex.split(os.environ.get("BEYOND_GPU_OVERRIDES", ""))


@pytest.fixture(scope="session")
def rehearsing() -> bool:
    """Whether this is a CPU rehearsal (BEYOND_GPU_CHECKS_ON_CPU=1): vLLM then serves float32, not bf16."""
    return REHEARSE_ON_CPU


@dataclass
class LaunchedRun:
    """One launcher run: its experiment folder, its whole output and its per-step metrics."""

    folder: Path
    """The experiment folder the launcher wrote (`<root>/<name>-<timestamp>`)."""
    output: str
    """Everything the launcher printed, training's output included."""
    steps: dict[int, dict[str, float]]
    """step -> {metric key -> value}, from the folder's metrics files (run_folder.MetricsLog)."""


GPU_STATE = os.environ.get("BEYOND_GPU_STATE")
"""A folder kept between device calls on one warm machine (scripts/gpu/checks.sh points it under /root): the shaped
model is built there once, and each finished run is kept there for a later call to reuse (`launch(reuse=True)`)."""
REQUIRE_KEPT = os.environ.get("BEYOND_GPU_REQUIRE_KEPT") == "1"
"""A call that only continues an earlier call's run (`checks.sh train-async`) must find it kept, not train it again."""
MODEL_SHAPE = os.environ.get("BEYOND_GPU_MODEL", "tiny")
"""The training checks' model: `tiny` (the test model) or a random-weight model of Qwen2.5's `0.5b` or `1.5b` shape
(dev_tools.tiny_model.SHAPES), built into the state folder once."""


def model_overrides(state: Path) -> list[str]:
    """The training checks' model path when a shaped model is asked for (`BEYOND_GPU_MODEL`), built on first use
    into the state folder's `models/<shape>`, where the rollout bench finds it too (`checks.sh bench-0.5b`)."""
    if MODEL_SHAPE == "tiny":
        return []
    from dev_tools.tiny_model import build_shaped_model

    return [f"actor_rollout_ref.model.path={build_shaped_model(MODEL_SHAPE, state / 'models' / MODEL_SHAPE)}"]


def launcher_options() -> list[str]:
    """With a shaped model the YAML's tiny-model step would build a model nothing uses (15.2 s on the H200)."""
    return [] if MODEL_SHAPE == "tiny" else ["--skip-prepare", "tiny_model"]


@pytest.fixture(scope="session")
def gpu_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`BEYOND_GPU_STATE`, else a folder of this session."""
    folder = Path(GPU_STATE) if GPU_STATE else tmp_path_factory.mktemp("gpu-state")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def timed_run(command: list[str], environment: dict, log: Path, timeout_s: float) -> tuple[int, list[tuple[float, str]]]:
    """Run the command, its output written to `log` as it comes (a run stopped by a time limit leaves what it
    printed) and each line stamped with the seconds since the start (for `dev_tools.run_phases`)."""
    started = time.monotonic()
    lines: list[tuple[float, str]] = []
    with log.open("w") as sink, subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, env=environment, text=True,
                                                 errors="replace") as process:
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                sink.write(line)
                sink.flush()
                lines.append((round(time.monotonic() - started, 2), line.rstrip("\n")))
        finally:
            timer.cancel()
        returncode = process.wait()
    return returncode, lines


@pytest.fixture(scope="module")
def launch(gpu_state: Path):
    """launch(name, yaml, overrides, reuse=False) -> LaunchedRun; fails with the output's tail on a non-zero exit.
    Module-scoped: a module's runs are shared by its tests (one start-up, many checks). Each run's phases (where its
    time went, `dev_tools.run_phases`) are printed and kept beside its log. `reuse=True`: a run of that name kept
    finished in the state folder by an earlier call is taken as it is."""
    report_dir = Path(os.environ.get("BEYOND_GPU_REPORT_DIR") or gpu_state / "reports")
    report_dir.mkdir(parents=True, exist_ok=True)

    def run(name: str, yaml: str, overrides: list[str] = (), timeout_s: float = 900, reuse: bool = False) -> LaunchedRun:
        from dev_tools.run_phases import phase_table

        root, finished = gpu_state / "runs" / name, gpu_state / "runs" / f"{name}.done.json"
        if reuse and finished.exists():
            kept = json.loads(finished.read_text())
            print(f"[gpu checks] {name}: reusing the run kept by an earlier call ({kept['folder']})", flush=True)
            return launched(Path(kept["folder"]), Path(kept["log"]).read_text(errors="replace"))
        if reuse and REQUIRE_KEPT:
            pytest.fail(f"{name}: no finished run kept under {gpu_state} (BEYOND_GPU_STATE); this call continues "
                        f"it: run its predecessor first on the same warm machine (docs/gpus.md)", pytrace=False)
        shutil.rmtree(root, ignore_errors=True)
        command = [sys.executable, "launcher.py", "--conf", yaml, "--with-envservice", "--backup-dir", str(root),
                   *launcher_options(), "--", *model_overrides(gpu_state), *overrides, *machine_overrides()]
        environment = dict(os.environ)
        if REHEARSE_ON_CPU:
            from verl_cpu.overrides import CPU_ENV

            environment.update(CPU_ENV)
        log = report_dir / f"{name}.log"
        returncode, lines = timed_run(command, environment, log, timeout_s)
        (report_dir / f"{name}.times.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        table = phase_table(lines, f"{name} ({MODEL_SHAPE} model{', CPU rehearsal' if REHEARSE_ON_CPU else ''})")
        (report_dir / f"{name}.phases.md").write_text(table + "\n")
        print(table, flush=True)
        output = log.read_text(errors="replace")
        assert returncode == 0, output[-6000:]
        (folder,) = root.iterdir()
        kept_log = shutil.copy(log, gpu_state / "runs" / f"{name}.log")  # a call's report folder is its own
        finished.write_text(json.dumps({"folder": str(folder), "log": str(kept_log)}))
        return launched(folder, output)

    return run


def launched(folder: Path, output: str) -> LaunchedRun:
    metrics = MetricsLog(folder)
    metrics.refresh()
    return LaunchedRun(folder, output, metrics.steps)
