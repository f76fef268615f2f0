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
import os
import shlex
import subprocess
import sys
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
    """What this machine needs on top of a YAML: sdpa without flash-attn, verl_cpu's when rehearsing."""
    if REHEARSE_ON_CPU:  # verl_cpu's overrides ask for sdpa and no remove-padding themselves
        from verl_cpu.overrides import cpu_overrides

        overrides = cpu_overrides()
    else:
        overrides = [] if has_flash_attn_kernels() else list(NO_FLASH_ATTN)
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


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory):
    """launch(name, yaml, overrides) -> LaunchedRun; fails with the output's tail on a non-zero exit. Module-scoped:
    a module's runs are shared by its tests (one start-up, many checks)."""
    tmp_path = tmp_path_factory.mktemp("gpu-runs")
    report_dir = Path(os.environ.get("BEYOND_GPU_REPORT_DIR") or tmp_path)
    report_dir.mkdir(parents=True, exist_ok=True)

    def run(name: str, yaml: str, overrides: list[str] = (), timeout_s: float = 900) -> LaunchedRun:
        root = tmp_path / name
        command = [sys.executable, "launcher.py", "--conf", yaml, "--with-envservice", "--backup-dir", str(root),
                   "--", *overrides, *machine_overrides()]
        environment = dict(os.environ)
        if REHEARSE_ON_CPU:
            from verl_cpu.overrides import CPU_ENV

            environment.update(CPU_ENV)
        log = report_dir / f"{name}.log"
        with log.open("w") as sink:  # written as it runs: a run stopped by a time limit leaves what it printed
            done = subprocess.run(command, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT, env=environment,
                                  timeout=timeout_s)
        output = log.read_text(errors="replace")
        assert done.returncode == 0, output[-6000:]
        (folder,) = root.iterdir()
        metrics = MetricsLog(folder)
        metrics.refresh()
        return LaunchedRun(folder, output, metrics.steps)

    return run
