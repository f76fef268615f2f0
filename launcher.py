"""One command from a launcher YAML to a running experiment.

    python launcher.py --conf examples/quickstart/cpu_tiny.yaml --with-envservice
    python launcher.py --conf CONF.yaml [--with-appworld] [--with-envservice] [--dry-run] [--backup-dir D] [-- overrides]

The logic lives in launch/ (see cli.py there).
"""

import sys

from launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
