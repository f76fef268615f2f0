"""The one verl release BeyondAgent is built for, and the start-up check against the installed verl.

The pin lives in `beyond_agent/REQUIRED_VERL.txt` (version, tag, commit). scripts/install.sh
installs that version; `external/verl` is a git submodule at that commit; `ensure_pinned_verl()` runs
before anything starts training so a wrong verl fails in one sentence instead of deep inside Ray.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Mapping

PIN_FILE = Path(__file__).resolve().parent / "REQUIRED_VERL.txt"
INSTALL_HINT = "run `bash scripts/install.sh` in the BeyondAgent checkout"


class VerlVersionError(RuntimeError):
    """The installed verl is missing or is not the release in REQUIRED_VERL.txt."""


@dataclass(frozen=True)
class VerlPin:
    """A verl release: its PyPI `version`, its git `tag` and the `commit` that tag points at."""

    version: str
    tag: str
    commit: str


def read_pin(path: Path = PIN_FILE) -> VerlPin:
    """Parse `key=value` lines (comments with #) into a VerlPin; name any missing key."""
    fields = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip()
    missing = [key for key in ("version", "tag", "commit") if not fields.get(key)]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)} (expected lines version=, tag=, commit=)")
    return VerlPin(version=fields["version"], tag=fields["tag"], commit=fields["commit"])


def installed_verl_version() -> str | None:
    """The version of the installed `verl` distribution, or None when verl is not installed."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None


TRYING_VARIABLE = "BEYOND_AGENT_TRYING_VERL"
"""Set by scripts/try_verl.sh to the release it installed in its scratch venv: that version passes the start-up
check (with a warning), so that a training test can run against a release before the pin moves to it."""


def ensure_pinned_verl(pin: VerlPin | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """Return the installed verl version, or raise VerlVersionError saying what was expected and seen."""
    pin = pin or read_pin()
    installed = installed_verl_version()
    if installed is None:
        raise VerlVersionError(f"verl is not installed; BeyondAgent needs verl {pin.version}: {INSTALL_HINT}")
    if installed != pin.version and installed == environ.get(TRYING_VARIABLE):
        warnings.warn(f"verl {installed} instead of the pinned {pin.version}: trying a release "
                      f"({TRYING_VARIABLE}, scripts/try_verl.sh)", stacklevel=2)
        return installed
    if installed != pin.version:
        raise VerlVersionError(
            f"BeyondAgent needs verl {pin.version} ({PIN_FILE.name}) but verl {installed} is installed: "
            f"{INSTALL_HINT}, or change the pin together with the external/verl submodule"
        )
    return installed


def submodule_commit(repo_root: Path, path: str = "external/verl") -> str | None:
    """The commit the repository's gitlink at `path` points to (mode 160000), or None if there is none."""
    listing = subprocess.run(
        ["git", "ls-files", "-s", "--", path], cwd=repo_root, capture_output=True, text=True, check=True
    ).stdout.split()
    if len(listing) >= 2 and listing[0] == "160000":
        return listing[1]
    return None
