"""Which metrics make which curve: one table for the dashboard and for the PNG written after training.

Keys are matched by regular expression against what verl's tracker logged (read under today's names,
`run_folder.current_metric_key`), so a panel shows whatever the run has, and a panel with no matching key is
left out. Each panel has one unit on its y axis, and each line a readable label instead of its metric key.
A `Curve` lists alternatives in order of preference, so a metric logged twice (our success rate and verl's
score, our rounds and verl's turn count) is drawn once. Validation keys are drawn as points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from beyond_agent.run_folder import METRICS_PREFIX, MetricsLog

OURS = "^" + re.escape(METRICS_PREFIX)


@dataclass(frozen=True)
class Curve:
    """One line of a panel (or one per match, when its label names a group of the pattern)."""

    patterns: tuple[str, ...]
    """Regular expressions (searched) in order of preference: the first that matches a logged key is drawn,
    the others are the same metric logged by someone else and are left out."""
    label: str
    """Legend text; `{name}` is filled with the pattern's group `(?P<name>...)` of each matched key."""
    points: bool = False
    """Drawn as points only (validation, measured every `trainer.test_freq` steps)."""
    readable: Mapping[str, str] = field(default_factory=dict)
    """Text for a group's values in the label (others are shown as logged)."""

    def line(self, key: str, match: re.Match) -> "Line":
        """The line of one matched key."""
        groups = {name: self.readable.get(value, value) for name, value in match.groupdict().items()}
        return Line(key, self.label.format(**groups), self.points)


@dataclass(frozen=True)
class Line:
    """One metric key a panel draws, with its legend text."""

    key: str
    label: str
    points: bool = False


@dataclass(frozen=True)
class Panel:
    """One chart: its id (the page element is `panel-<id>`), title, y-axis unit and curves."""

    id: str
    title: str
    unit: str
    """The y axis's title: every line of the panel is in this unit."""
    curves: tuple[Curve, ...]
    stacked: bool = False
    """Draw the lines as stacked bars (counts that add up, such as terminations)."""
    in_png: bool = True
    """Part of the curves PNG written at the end of training."""
    min_lines: int = 1
    """Shown only with at least this many lines (per-task success says nothing new about one task)."""
    y_range: tuple[float, float] | None = None
    """Fixed y-axis limits (a share is drawn from 0 to 1 even when a run's values are all 0)."""

    def lines(self, available: list[str]) -> list[Line]:
        """The lines this panel draws from the available keys (none: fewer than `min_lines` matched)."""
        drawn: list[Line] = []
        for curve in self.curves:
            drawn.extend(_curve_lines(curve, available))
        return drawn if len(drawn) >= self.min_lines else []


def _curve_lines(curve: Curve, available: list[str]) -> list[Line]:
    for pattern in curve.patterns:
        matches = [(key, match) for key in available if (match := re.search(pattern, key))]
        if matches:
            return [curve.line(key, match) for key, match in matches]
    return []


def validation(metric: str) -> Curve:
    """verl's validation mean of `metric` (`val-core/<task>/reward/mean@N`, `val-aux/<task>/success/mean@N`)."""
    return Curve((rf"^val-(core|aux)/(?P<task>.+)/{metric}/mean@\d+$",), "validation: {task}", points=True)


def wall_time(timer: str, label: str) -> Curve:
    """One of verl's step timers (`timing_s/<timer>`), wall-clock seconds."""
    return Curve((rf"^timing_s/{timer}$",), label)


SHARE, SHARE_RANGE = "share of episodes", (-0.02, 1.02)  # a little room for markers at 0 and 1
TERMINATIONS = {"done": "env finished", "max_rounds": "round limit", "truncated": "env's step limit",
                "length": "token budget", "max_calls": "call limit (gateway)", "env_error": "env error", "llm_error": "LLM error", "timeout": "timeout",
                "agent_error": "agent error"}
"""Legend text of each termination reason (beyond_agent/rollout/handler.py's TERMINATION_REASONS)."""

PANELS = (
    Panel("success", "Success rate", SHARE, (
        Curve((f"{OURS}success_rate$",), "training episodes"), validation("success")), y_range=SHARE_RANGE),
    Panel("reward", "Reward", "mean per episode", (
        Curve((f"{OURS}mean_reward$", r"^critic/score/mean$"), "training episodes"), validation("reward"))),
    Panel("rounds", "Rounds per episode", "rounds", (
        Curve((f"{OURS}mean_rounds$", r"^num_turns/mean$"), "training episodes"),
        Curve((f"{OURS}max_rounds$",), "round limit"))),
    Panel("terminations", "How episodes ended", "episodes", (
        Curve((f"{OURS}termination/(?P<kind>.+)$",), "{kind}", readable=TERMINATIONS),), stacked=True),
    Panel("time", "Time per step", "seconds (wall clock)", (
        wall_time("step", "whole step"), wall_time("gen", "rollout"),
        Curve((f"{OURS}dynamic_sampling/play_s$",), "rollout (dynamic sampling, before the step)"),
        Curve((f"{OURS}llm_busy_s$",), "LLM server busy"), wall_time("old_log_prob", "old log-probs"),
        wall_time("update_actor", "actor update"), wall_time("update_weights", "weight sync"))),
    Panel("episode_time", "Time inside episodes", "seconds, summed over a step's episodes", (
        Curve((f"{OURS}env_time_s$",), "environment calls"), Curve((f"{OURS}llm_time_s$",), "waiting for the LLM"))),
    Panel("entropy", "Entropy", "nats per token", (Curve((r"^actor/entropy$",), "policy"),)),
    Panel("losses", "Losses", "loss", (
        Curve((r"^actor/pg_loss$",), "policy gradient"), Curve((r"^actor/kl_loss$",), "KL to the reference"),
        Curve((r"^critic/vf_loss$",), "value"))),
    Panel("grad_norm", "Gradient norm", "L2 norm", (
        Curve((r"^actor/grad_norm$",), "actor"), Curve((r"^critic/grad_norm$",), "critic"))),
    Panel("staleness", "Staleness of trained episodes", "policy versions behind", (
        Curve((f"{OURS}async/staleness_mean$",), "mean"), Curve((f"{OURS}async/staleness_max$",), "max"))),
    Panel("dynamic_sampling", "Groups without signal", "groups per step", (
        Curve((f"{OURS}dynamic_sampling/dropped_groups$",), "dropped, replaced by new rows"),
        Curve((f"{OURS}dynamic_sampling/kept_without_signal_groups$",), "trained anyway (budget spent)"))),
    Panel("tasks", "Success per task", SHARE, (
        Curve((f"{OURS}task/(?P<task>[^/]+)/success_rate$",), "{task}"),), min_lines=2, y_range=SHARE_RANGE),
)


def write_curves_png(metrics: MetricsLog, out: Path) -> Path | None:
    """Draw every PNG panel that has data into one image at `out`; None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the trainer and CI have none
    import matplotlib.pyplot as plt

    metrics.refresh()
    available = metrics.keys()
    drawn = [(panel, lines) for panel in PANELS if panel.in_png and (lines := panel.lines(available))]
    if not drawn:
        return None
    columns = 2 if len(drawn) > 1 else 1
    rows = -(-len(drawn) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 3.4 * rows), squeeze=False)
    for axis, (panel, lines) in zip(axes.flat, drawn):
        _draw_panel(axis, panel, lines, metrics.series([line.key for line in lines]))
    for axis in list(axes.flat)[len(drawn):]:
        axis.set_visible(False)
    figure.suptitle(out.parent.name)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out


def _draw_panel(axis, panel: Panel, lines: list[Line], series: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    bottom: dict[float, float] = {}
    for line in lines:
        steps, ys = [v[0] for v in series.get(line.key, [])], [v[1] for v in series.get(line.key, [])]
        if line.points:
            axis.scatter(steps, ys, marker="D", label=line.label)
        elif panel.stacked:
            base = [bottom.get(step, 0.0) for step in steps]
            axis.bar(steps, ys, bottom=base, label=line.label)
            bottom.update({step: b + y for step, b, y in zip(steps, base, ys)})
        else:
            axis.plot(steps, ys, marker="." if len(steps) < 50 else None, label=line.label)
    axis.set_title(panel.title)
    axis.set_xlabel("step")
    axis.set_ylabel(panel.unit, fontsize=8)
    if panel.y_range:
        axis.set_ylim(*panel.y_range)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))  # whole steps, labels apart
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
