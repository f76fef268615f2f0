"""Where a launcher run's time goes: its output lines, each stamped with when it arrived, cut into phases by the first
line that marks each one (issue #74: the GPU checks must fit device calls of a few minutes, so each call's phases
are measured and printed, in a CPU rehearsal and on the GPU alike).

    python -m dev_tools.run_phases RUN.times.jsonl     # the table of a run recorded by tests/gpu's `launch`
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

PHASES: tuple[tuple[str, str], ...] = (
    ("envservice up", r"\[launcher\] envservice is healthy"),
    ("model and data prepared", r"\[launcher\] training: "),
    ("Ray up", r"Started a local Ray instance"),
    ("actor workers up (FSDP)", r"num_warmup_steps"),
    ("vLLM servers up", r"LLMServerManager: "),
    ("checkpoint loaded (or none)", r"Training from scratch|Load from checkpoint"),
    ("first weight sync done", r"update_weights done"),
    ("first rollout played", r"\[beyond_agent\] step \d+ training rollout"),
    ("first step done", r"\[launcher\] step \d+: "),
    ("training exited", r"\[launcher\] training exited"),
)
"""(phase, the regex of the line that ends it), in the order a run goes through them."""
STEP = re.compile(r"\[launcher\] step (\d+): ")


def phase_times(lines: Iterable[tuple[float, str]]) -> list[tuple[str, float]]:
    """(phase, seconds from the start at which it ended) for each phase whose line arrived, in the run's order;
    `lines`: (seconds since the start, line)."""
    patterns = [(name, re.compile(pattern)) for name, pattern in PHASES]
    ended: dict[str, float] = {}
    for at, line in lines:
        for name, pattern in patterns:
            if name not in ended and pattern.search(line):
                ended[name] = at
    return sorted(ended.items(), key=lambda item: item[1])


def step_times(lines: Iterable[tuple[float, str]]) -> dict[int, float]:
    """Training step -> seconds from the start at which the launcher printed its figures."""
    return {int(match.group(1)): at for at, line in lines if (match := STEP.search(line))}


def phase_rows(phases: Iterable[tuple[str, float]]) -> list[str]:
    """(phase, seconds from the start at which it ended) as a Markdown table: ended at, took."""
    rows = ["| phase | ended at (s) | took (s) |", "|---|---|---|"]
    before = 0.0
    for name, at in phases:
        rows.append(f"| {name} | {at:.1f} | {at - before:.1f} |")
        before = at
    return rows


def phase_table(lines: list[tuple[float, str]], title: str) -> str:
    """The phases as a Markdown table (ended at, took), then each step's seconds."""
    rows = [f"{title}", "", *phase_rows(phase_times(lines))]
    steps = step_times(lines)
    if steps:
        ordered = sorted(steps.items())
        gaps = [f"{step}: {at - (ordered[index - 1][1] if index else 0.0):.1f}" for index, (step, at) in
                enumerate(ordered)]
        rows.append("")
        rows.append("seconds to each step's figures (the first counts from the start): " + ", ".join(gaps))
    total = lines[-1][0] if lines else 0.0
    rows.append(f"whole run: {total:.1f} s")
    return "\n".join(rows)


def read_times(path: Path) -> list[tuple[float, str]]:
    """A `<run>.times.jsonl` written by tests/gpu's `launch`: one [seconds, line] per output line."""
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(arg) for arg in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    for path in paths:
        print(phase_table(read_times(path), path.name.removesuffix(".times.jsonl")))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
