"""Argument types shared by the command-line programs (argparse `type=` functions; nothing else uses them).

    parser.add_argument("--tasks", type=task_indices, default=task_indices("0:8"))
    parser.add_argument("--params", type=json_object, default={})
"""

from __future__ import annotations

import argparse
import json


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
