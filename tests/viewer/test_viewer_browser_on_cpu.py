"""The viewer in a real headless Chromium (Debian's package, driven by Playwright) over the recorded run.

The page is served by the real `python -m beyond_agent.viewer` process on loopback; plotly.js
comes from the installed plotly package. What the browser shows is checked against the run's own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beyond_agent.trajectories import read_dump

pytestmark = pytest.mark.slow
TRAJECTORIES = Path("checkpoints") / "trajectories"
LOAD_MS = 30_000


def open_route(page, url: str, route: str) -> None:
    """Go to a route and wait until the page says it has drawn it."""
    page.goto(f"{url}/{route}")
    page.wait_for_function("(route) => document.body.dataset.loaded === route", arg=route, timeout=LOAD_MS)


def plotted(page, panel: str) -> dict[str, list]:
    """{metric key: [[step, value], ...]} of a dashboard panel, read from plotly's own data on the page."""
    return page.evaluate("""(id) => Object.fromEntries(document.getElementById(id).data.map(
        trace => [trace.meta, trace.x.map((x, i) => [x, trace.y[i]])]))""", f"panel-{panel}")


def legend(page, panel: str) -> list[str]:
    """The legend texts plotly drew for a panel."""
    return [text.text_content() for text in page.locator(f"#panel-{panel} .legendtext").all()]


def assert_tick_labels_apart(page, panel: str) -> None:
    """No two x-axis labels of a panel overlap on the page."""
    boxes = sorted((box["x"], box["width"]) for box in
                   (tick.bounding_box() for tick in page.locator(f"#panel-{panel} .xtick text").all()) if box)
    assert len(boxes) >= 2 and all(x + width < next_x for (x, width), (next_x, _) in zip(boxes, boxes[1:])), \
        f"{panel}: {boxes}"


def test_the_dashboard_draws_the_run_s_success_curve_and_follows_new_steps(page, viewer_url: str, run_folder: Path):
    open_route(page, viewer_url, "#/dashboard")
    logged = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    key, logged_as = "beyond_agent/success_rate", "timing_s/beyond_agent/success_rate"  # an earlier run's name
    success = plotted(page, "success")
    assert success[key] == [[entry["step"], entry["data"][logged_as]] for entry in logged]
    val_keys = [k for k in success if k.startswith("val-")]  # validation points on the same chart
    assert val_keys and all(points for points in (success[k] for k in val_keys))
    for panel in ("reward", "rounds", "terminations", "time", "episode_time", "entropy", "losses", "grad_norm"):
        assert plotted(page, panel), f"panel {panel} has no data"
        assert_tick_labels_apart(page, panel)
    assert legend(page, "success") == ["training episodes", "validation: babyai"]
    assert page.locator("#panel-time .g-ytitle").text_content() == "seconds (wall clock)"
    assert page.locator("#run-name").inner_text() == run_folder.name

    next_step = logged[-1]["step"] + 1  # training goes on: the open page picks the new step up
    with (run_folder / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({"step": next_step, "data": {key: 0.75}}) + "\n")
    page.wait_for_function("(step) => document.getElementById('panel-success').dataset.drawn === String(step)",
                           arg=next_step, timeout=LOAD_MS)
    assert plotted(page, "success")[key][-1] == [next_step, 0.75]

    last_step = next_step + 60  # a longer run: still whole steps, and labels that do not overlap
    with (run_folder / "metrics.jsonl").open("a") as out:
        out.writelines(json.dumps({"step": step, "data": {key: 0.5}}) + "\n" for step in range(next_step + 1, last_step + 1))
    page.wait_for_function("(step) => document.getElementById('panel-success').dataset.drawn === String(step)",
                           arg=last_step, timeout=LOAD_MS)
    assert_tick_labels_apart(page, "success")
    ticks = [tick.text_content() for tick in page.locator("#panel-success .xtick text").all()]
    assert all(tick.replace(",", "").isdigit() for tick in ticks), ticks


def test_a_monitor_that_fired_puts_a_banner_on_every_view(page, viewer_url: str, run_folder: Path):
    """Issue #71: no banner on a healthy run; once a step logs that the reward-hack monitor fired, the open
    dashboard shows it (at its next poll), as text, and so does every other view."""
    open_route(page, viewer_url, "#/dashboard")
    banner = page.locator("#integrity-banner")
    assert banner.is_hidden()
    step = json.loads((run_folder / "metrics.jsonl").read_text().splitlines()[-1])["step"] + 1
    with (run_folder / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({"step": step, "data": {"beyond_agent/integrity/reward_hack": 1.0,
                                                     "beyond_agent/integrity/log_prob_drift": 0.0}}) + "\n")
    page.wait_for_function("() => document.getElementById('integrity-banner').dataset.monitors === 'reward_hack'",
                           timeout=LOAD_MS)
    assert banner.is_visible()
    assert banner.inner_text().startswith(f"Integrity monitor reward_hack fired at step {step} (")
    open_route(page, viewer_url, "#/config")
    assert banner.is_visible()


def test_an_episode_marks_exactly_the_mask_1_tokens_trained(page, viewer_url: str, run_folder: Path):
    records = list(read_dump(run_folder / TRAJECTORIES / "step_1.jsonl"))
    line = next(number for number, r in enumerate(records, start=1) if 0 < sum(r.response_mask) < len(r.response_mask))
    record = records[line - 1]
    open_route(page, viewer_url, f"#/episode?step=1&kind=train&line={line}")
    pane = page.locator(".episode-pane")
    assert pane.count() == 1
    tokens = pane.locator(".tokens .tok[data-pos]")
    assert tokens.count() == len(record.response_ids)
    trained = pane.evaluate("""p => [...p.querySelectorAll('.tokens .tok.trained')].map(t => Number(t.dataset.pos))""")
    context = pane.evaluate("""p => [...p.querySelectorAll('.tokens .tok.context')].map(t => Number(t.dataset.pos))""")
    assert trained == [i for i, m in enumerate(record.response_mask) if m == 1]
    assert context == [i for i, m in enumerate(record.response_mask) if m == 0]
    # Trained tokens look different from context ones, and hovering shows the id and the log-prob.
    colours = pane.evaluate("""p => [p.querySelector('.tokens .tok.trained'), p.querySelector('.tokens .tok.context')].map(
        t => getComputedStyle(t).backgroundColor)""")
    assert colours[0] != colours[1]
    first = trained[0]
    title = tokens.nth(first).get_attribute("title")
    assert f"id {record.response_ids[first]}" in title and f"logprob {record.response_logprobs[first]:.4f}" in title
    assert pane.locator(".tokens .tok.prompt").count() == len(record.prompt_ids)
    pane.locator("input.show-ids").check()  # the exact ids, in place of their texts
    shown = pane.evaluate("p => [...p.querySelectorAll('.tokens .tok[data-pos]')].map(t => Number(t.textContent))")
    assert shown == record.response_ids
    assert pane.locator(".message.assistant").count() == record.rounds
    assert pane.locator(".turn-end").count() == sum(end >= 0 for end in record.turn_ends)


def test_the_list_filters_by_termination_and_two_of_a_group_show_side_by_side(page, viewer_url: str,
                                                                              run_folder: Path):
    records = list(read_dump(run_folder / TRAJECTORIES / "step_1.jsonl"))
    open_route(page, viewer_url, "#/episodes?step=1&kind=train")
    assert page.locator("tr.episode-row").count() == len(records)
    terminations = sorted({r.termination for r in records})
    chosen = terminations[-1]
    page.select_option("#filter-termination", chosen)
    page.click("#apply-filters")
    page.wait_for_function("(t) => document.body.dataset.loaded.includes('termination=' + t)", arg=chosen,
                           timeout=LOAD_MS)
    shown = page.locator("tr.episode-row").evaluate_all("rows => rows.map(r => r.dataset.termination)")
    assert shown == [r.termination for r in records if r.termination == chosen]

    group = records[0].group
    lines = [number for number, r in enumerate(records, start=1) if r.group == group]
    open_route(page, viewer_url, f"#/episode?step=1&kind=train&line={lines[0]}")
    page.click(f".compare-link[data-line='{lines[1]}']")
    page.wait_for_function("() => document.querySelectorAll('.episode-pane').length === 2", timeout=LOAD_MS)
    panes = page.locator(".episode-pane").evaluate_all("ps => ps.map(p => Number(p.dataset.line))")
    assert panes == lines[:2]
    boxes = [page.locator(".episode-pane").nth(i).bounding_box() for i in range(2)]
    assert boxes[0]["x"] + boxes[0]["width"] <= boxes[1]["x"]  # side by side, not stacked


def test_markup_in_a_metric_key_is_shown_as_text(page, viewer_url: str, run_folder: Path):
    """#33 finding 8: plotly renders HTML in titles and legends, so a metric key or task name holding markup
    became a link on the page. The run's names are data: shown as text."""
    link_key = 'x<a href="http:evil.example">click</a>'.replace("/", "")  # a key without slashes: one segment
    step = json.loads((run_folder / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    with (run_folder / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({"step": step, "data": {"beyond_agent/task/<b>bold/success_rate": 0.5,
                                                     "beyond_agent/task/plain/success_rate": 0.25,
                                                     link_key: 1.0}}) + "\n")
    open_route(page, viewer_url, "#/dashboard")
    assert sorted(legend(page, "tasks")) == ["<b>bold", "plain"]
    page.select_option("#any-metric", link_key)
    page.wait_for_function("() => document.getElementById('panel-any').data !== undefined", timeout=LOAD_MS)
    assert page.locator("#panel-any .gtitle a").count() == 0 and page.locator("#panel-tasks .legendtext b").count() == 0
    assert page.locator("#panel-any .gtitle").text_content() == link_key


def test_an_agent_episode_says_whether_its_calls_merged(page, viewer_url: str, run_folder: Path):
    """Episodes played by a user's agent behind the gateway (issue #31) carry their mode; the page says it."""
    dump = run_folder / TRAJECTORIES / "step_1.jsonl"
    lines = dump.read_text().splitlines()
    first = json.loads(lines[0])
    first["extra"] = {**first.get("extra", {}), "agent_mode": "per_call", "earlier_segments": 2}
    dump.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    open_route(page, viewer_url, "#/episode?step=1&kind=train&line=1")
    facts = page.locator(".episode-pane .facts").inner_text()
    assert "agent's samples" in facts and "per call: it rewrote its history" in facts and "(2 earlier, each trained as a sample of its own)" in facts
    open_route(page, viewer_url, "#/episode?step=1&kind=train&line=2")  # our own loop's episode: no such line
    assert "agent's samples" not in page.locator(".episode-pane .facts").inner_text()


def test_a_seat_of_a_game_names_its_opponent_and_links_the_games_other_seats(page, viewer_url: str,
                                                                             run_folder: Path):
    """Self-play (issue #57) dumps every seat of a game as a record of its own group (`<row>/seat<k>`): the page
    names the seat and the opponent, and links the game's other seat (same row, same sample index)."""
    dump = run_folder / TRAJECTORIES / "step_1.jsonl"
    original = dump.read_text()
    lines = original.splitlines()
    seats = [json.loads(line) for line in lines[:2]]
    for number, record in enumerate(seats):
        record.update(group=f"row-7/seat{number}", index=3)
        record["extra"] = {**record.get("extra", {}), "seat": number, "opponent": "self"}
    dump.write_text("\n".join([*map(json.dumps, seats), *lines[2:]]) + "\n")
    try:
        open_route(page, viewer_url, "#/episode?step=1&kind=train&line=1")
        facts = page.locator(".episode-pane .facts").inner_text()
        assert "seat" in facts and "0, against the policy itself" in facts
        page.click(".seat-link[data-line='2']")
        page.wait_for_function("() => document.querySelectorAll('.episode-pane').length === 2", timeout=LOAD_MS)
        assert "1, against the policy itself" in page.locator(".episode-pane").nth(1).locator(".facts").inner_text()
        open_route(page, viewer_url, "#/episode?step=1&kind=train&line=3")  # an episode of no game: no seat, no links
        assert page.locator(".game-links").count() == 0
        assert "against" not in page.locator(".episode-pane .facts").inner_text()
    finally:
        dump.write_text(original)  # the other tests' episodes as they were
