"""What the command-line programs share: argparse `type=` functions and the dry-run switch of the training entries.

    parser.add_argument("--tasks", type=task_indices, default=task_indices("0:8"))
    parser.add_argument("--params", type=json_object, default={})
"""

from __future__ import annotations

import argparse
import json
import os

DRY_RUN_VARIABLE = "BEYOND_AGENT_DRY_RUN"
"""Set to 1 by `launcher.py --dry-run`: a training entry (the recipes' Hydra mains)
composes its config, checks it as it would before training, prints DRY_RUN_MARKER and exits; nothing trains."""
DRY_RUN_MARKER = "[beyond_agent] dry run: the training config composes and passes its checks"


def is_dry_run() -> bool:
    """Whether this process is a training entry's dry run (`DRY_RUN_VARIABLE`)."""
    return os.environ.get(DRY_RUN_VARIABLE) == "1"


def task_indices(text: str) -> list[int]:
    """Task indices from "START:STOP" (half-open) or "I,J,K"."""
    try:
        if ":" in text:
            start, stop = (int(part) for part in text.split(":"))
            tasks = list(range(start, stop))
        else:
            tasks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tasks must look like 0:64 or 3,5,7; got {text!r}") from None
    if not tasks or min(tasks) < 0:
        raise argparse.ArgumentTypeError(f"--tasks must name at least one task index >= 0; got {text!r}")
    return tasks


def json_object(text: str) -> dict:
    """--params: a JSON object of env task parameters, e.g. '{"around": true}'."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--params must be a JSON object; got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--params must be a JSON object; got {text!r}")
    return value
