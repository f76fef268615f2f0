"""The GPU stack's lock (scripts/gpu/requirements.lock): it resolves again as committed, a changed pin is
caught, and the pins docs/gpus.md states are the lock's.

Resolve-only: uv resolves against PyPI for the GPU machines' platform; nothing is installed and no GPU is used.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "scripts/gpu/requirements.lock"
GPUS_PAGE = ROOT / "docs/gpus.md"
TABLE_MARKER = "<!-- gpu-pins:"


def pins(text: str) -> dict[str, str]:
    return {name.lower(): version for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M)}


def check(lock: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BEYOND_GPU_LOCK": str(lock)}
    return subprocess.run(["bash", "scripts/gpu/lock.sh", "--check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.startup  # uv's resolver over the whole GPU lock: the full run only
def test_the_committed_lock_resolves_again_and_a_changed_pin_is_caught(tmp_path: Path):
    done = check(LOCK)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resolves as committed" in done.stdout
    # A pin the inputs do not admit (vllm 0.30.0 needs another flashinfer than the lock's) fails the resolution.
    changed = tmp_path / "requirements.lock"
    changed.write_text(re.sub(r"^vllm==\S+$", "vllm==0.30.0", LOCK.read_text(), flags=re.M))
    done = check(changed)
    assert done.returncode == 1 and "vllm==0.30.0" in done.stderr and "is not a resolution of the inputs" in done.stderr
    # A pin left out comes back in the diff.
    changed.write_text(re.sub(r"^mpmath==\S+\n", "", LOCK.read_text(), flags=re.M))
    done = check(changed)
    assert done.returncode == 1 and "+mpmath==" in done.stdout and "is not a full resolution" in done.stderr


@pytest.mark.startup
def test_a_lock_older_than_the_index_still_passes(tmp_path: Path):
    """Releases appear on the index stamped before EXCLUDE_NEWER (ml-dtypes 0.7.0 failed CI on an unchanged lock):
    an older pin the inputs admit is still a resolution of them. Failed on the check that asked for equality."""
    older = tmp_path / "requirements.lock"
    locked = pins(LOCK.read_text())
    assert locked["mpmath"] == "1.3.0"  # sympy admits mpmath >= 1.1.0, < 1.4
    older.write_text(re.sub(r"^mpmath==\S+$", "mpmath==1.2.1", LOCK.read_text(), flags=re.M))
    done = check(older)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lock_pins_verl_as_required_verl_and_torch_as_the_cpu_stack():
    locked = pins(LOCK.read_text())
    required = dict(line.split("=", 1) for line in (ROOT / "beyond_agent/REQUIRED_VERL.txt").read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    assert locked["verl"] == required["version"]
    cpu_torch = importlib.metadata.version("torch")
    assert locked["torch"] == cpu_torch.split("+")[0]  # the same release: CUDA build there, CPU wheel here
    assert locked["tensordict"] == importlib.metadata.version("tensordict")


def test_the_gpus_page_states_the_lock_s_pins():
    page = GPUS_PAGE.read_text()
    assert TABLE_MARKER in page
    table = page[page.index(TABLE_MARKER):].split("\n\n")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[3:]]
    locked = pins(LOCK.read_text())
    stated = {package: gpu for package, gpu, *_ in rows}
    assert len(stated) >= 6
    for package, version in stated.items():
        assert locked.get(package) == version, f"docs/gpus.md says {package} {version}, the lock {locked.get(package)}"


def test_install_gpu_installs_the_lock_and_nothing_resolved_on_the_machine():
    script = (ROOT / "scripts/install.sh").read_text()
    gpu_branch = script[script.index('if [ "$flavour" = gpu ]'):script.index("else", script.index('if [ "$flavour" = gpu ]'))]
    installs = [line.strip() for line in gpu_branch.splitlines() if "pip install" in line]
    assert installs and all("--no-deps" in line for line in installs)  # the lock's pins, exactly
    assert 'lock="scripts/gpu/requirements.lock"' in gpu_branch
