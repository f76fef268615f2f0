"""Which metrics make which curve: one table for the dashboard and for the PNG written after training.

Keys are matched by regular expression against what verl's tracker logged, so a panel shows whatever the
run has (our rollout figures are logged by verl as `timing_s/beyond_agent/...`), and a panel with no
matching key is left out. Validation keys (`val-core/...`, `val-aux/...`) are drawn as points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from beyond_agent.run_folder import MetricsLog

ROLLOUT = "timing_s/beyond_agent/"


@dataclass(frozen=True)
class Panel:
    """One chart: its id (the page element is `panel-<id>`), title and the key patterns it draws."""

    id: str
    title: str
    patterns: tuple[str, ...]
    """Regular expressions (searched) of the metric keys drawn as lines."""
    point_patterns: tuple[str, ...] = ()
    """Regular expressions of keys drawn as points only (validation)."""
    stacked: bool = False
    """Draw the lines as stacked bars (counts that add up, such as terminations)."""
    in_png: bool = True
    """Part of the curves PNG written at the end of training."""

    def keys(self, available: list[str]) -> tuple[list[str], list[str]]:
        """(line keys, point keys) of the available keys this panel draws."""
        return _matching(self.patterns, available), _matching(self.point_patterns, available)


def _matching(patterns: tuple[str, ...], available: list[str]) -> list[str]:
    return [key for key in available if any(re.search(pattern, key) for pattern in patterns)]


VALIDATION = (r"^val-(core|aux)/.+/(success|reward|score)/mean@\d+$",)
PANELS = (
    Panel("success", "Success rate", (f"^{ROLLOUT}success_rate$",), VALIDATION),
    Panel("reward", "Reward", (f"^{ROLLOUT}mean_reward$", r"^critic/score/mean$", r"^critic/rewards/mean$")),
    Panel("rounds", "Rounds per episode", (f"^{ROLLOUT}mean_rounds$", r"^num_turns/mean$")),
    Panel("terminations", "Terminations (episodes)", (f"^{ROLLOUT}termination/",), stacked=True),
    Panel("time", "Time per step (s)", (f"^{ROLLOUT}(env_time_s|llm_time_s|llm_busy_s|wall_time_s)$",
                                        r"^timing_s/(gen|update_actor|old_log_prob|step)$")),
    Panel("entropy", "Entropy", (r"^actor/entropy$",)),
    Panel("losses", "Losses", (r"^actor/(pg_loss|kl_loss|loss)$", r"^critic/vf_loss$", r"^actor/grad_norm$")),
    Panel("staleness", "Staleness", (r"stale",)),
    Panel("tasks", "Per task", (r"(^|/)(per_)?task/",), in_png=False),
)


def write_curves_png(metrics: MetricsLog, out: Path) -> Path | None:
    """Draw every PNG panel that has data into one image at `out`; None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the trainer and CI have none
    import matplotlib.pyplot as plt

    metrics.refresh()
    available = metrics.keys()
    drawn = [(panel, *panel.keys(available)) for panel in PANELS if panel.in_png]
    drawn = [(panel, lines, points) for panel, lines, points in drawn if lines or points]
    if not drawn:
        return None
    columns = 2 if len(drawn) > 1 else 1
    rows = -(-len(drawn) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 3.2 * rows), squeeze=False)
    for axis, (panel, lines, points) in zip(axes.flat, drawn):
        _draw_panel(axis, panel, metrics.series(lines), metrics.series(points))
    for axis in list(axes.flat)[len(drawn):]:
        axis.set_visible(False)
    figure.suptitle(out.parent.name)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out


def short_label(key: str) -> str:
    """A metric key without the prefixes every key of a panel shares."""
    return key.removeprefix(ROLLOUT).removeprefix("termination/")


def _draw_panel(axis, panel: Panel, lines: dict, points: dict) -> None:
    from matplotlib.ticker import MaxNLocator

    bottom: dict[float, float] = {}
    for key, values in lines.items():
        steps, ys = [v[0] for v in values], [v[1] for v in values]
        if panel.stacked:
            base = [bottom.get(step, 0.0) for step in steps]
            axis.bar(steps, ys, bottom=base, label=short_label(key))
            bottom.update({step: b + y for step, b, y in zip(steps, base, ys)})
        else:
            axis.plot(steps, ys, marker="." if len(steps) < 50 else None, label=short_label(key))
    for key, values in points.items():
        axis.scatter([v[0] for v in values], [v[1] for v in values], marker="D", label=key)
    axis.set_title(panel.title)
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
