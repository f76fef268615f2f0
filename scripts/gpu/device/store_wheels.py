"""Copy wheels with their members stored, not deflated, so that one xz stream over all of them compresses the
contents themselves (build_chunks.sh). A wheel is a zip; pip installs a stored one exactly as a deflated one (its
RECORD hashes the members' contents, which do not change).

    python scripts/gpu/device/store_wheels.py SOURCE_DIR DEST_DIR WHEEL...

xz over deflated members finds almost nothing to take out; over stored ones it took vLLM 0.24.0's 279 MB wheel to
201 MB (2026-12-01).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def store_wheel(source: Path, dest: Path) -> None:
    """Write `source`'s members into `dest` in the same order, names, dates and modes, stored."""
    with zipfile.ZipFile(source) as inside, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as outside:
        for member in inside.infolist():
            copy = zipfile.ZipInfo(member.filename, member.date_time)
            copy.external_attr = member.external_attr
            copy.create_system = member.create_system
            copy.compress_type = zipfile.ZIP_STORED
            with inside.open(member) as data:
                outside.writestr(copy, data.read())


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: store_wheels.py SOURCE_DIR DEST_DIR WHEEL...", file=sys.stderr)
        return 2
    source, dest = Path(argv[0]), Path(argv[1])
    for wheel in argv[2:]:
        store_wheel(source / wheel, dest / wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
