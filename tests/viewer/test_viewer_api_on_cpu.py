"""The viewer's readers and JSON API over the recorded run: live metrics, paging, filters, errors, the PNG."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from beyond_agent.trajectories import TrajectoryFormatError, read_dump
from beyond_agent.curves import write_curves_png
from beyond_agent.run_folder import TEXT_LIMIT, MetricsLog, current_metric_key

TRAJECTORIES = Path("checkpoints") / "trajectories"


def metric_lines(folder: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


def dumped(folder: Path, name: str) -> list:
    return list(read_dump(folder / TRAJECTORIES / name))


def test_metrics_follow_appended_lines_and_wait_for_a_line_being_written(run_folder: Path):
    log = MetricsLog(run_folder)
    log.refresh()
    recorded = metric_lines(run_folder)
    assert sorted(log.steps) == [entry["step"] for entry in recorded]
    key, logged_as = "beyond_agent/success_rate", "timing_s/beyond_agent/success_rate"  # the recorded run's name
    assert log.series([key])[key] == [[entry["step"], entry["data"][logged_as]] for entry in recorded]
    assert not any(k.startswith("timing_s/beyond_agent/") for k in log.keys())  # read under today's names
    with (run_folder / "metrics.jsonl").open("a") as out:  # a step being written: half a line so far
        out.write('{"step": 99, "data": {"beyond_agent/success_rate": 0.5')
    log.refresh()
    assert 99 not in log.steps
    with (run_folder / "metrics.jsonl").open("a") as out:
        out.write(', "note": "text is skipped"}}\n')
    log.refresh()
    assert log.steps[99] == {key: 0.5}


def test_a_resumed_run_file_replaces_the_steps_it_logged_again(run_folder: Path):
    last = metric_lines(run_folder)[-1]["step"]
    (run_folder / "metrics.1.jsonl").write_text(
        json.dumps({"step": last, "data": {"actor/entropy": -1.0}}) + "\n"
        + json.dumps({"step": last + 1, "data": {"actor/entropy": -2.0}}) + "\n")
    log = MetricsLog(run_folder)
    log.refresh()
    assert log.series(["actor/entropy"])["actor/entropy"][-2:] == [[last, -1.0], [last + 1, -2.0]]


def test_episode_pages_filter_and_name_bad_parameters(viewer_url: str, run_folder: Path):
    steps = requests.get(f"{viewer_url}/api/steps", timeout=10).json()["steps"]
    assert {"step": 1, "kind": "train"} in steps and any(s["kind"] == "val" for s in steps)
    records = dumped(run_folder, "step_1.jsonl")
    page = requests.get(f"{viewer_url}/api/episodes", params={"step": 1, "limit": 3}, timeout=10).json()
    assert page["total"] == len(records) and [item["line"] for item in page["items"]] == [1, 2, 3]
    assert page["items"][0]["trained_tokens"] == sum(records[0].response_mask)
    second = requests.get(f"{viewer_url}/api/episodes", params={"step": 1, "limit": 3, "offset": 3}, timeout=10).json()
    assert [item["line"] for item in second["items"]] == [4, 5, 6]

    termination = records[-1].termination
    kept = requests.get(f"{viewer_url}/api/episodes", params={"step": 1, "termination": termination},
                        timeout=10).json()
    assert kept["matched"] == sum(r.termination == termination for r in records)
    assert {item["termination"] for item in kept["items"]} == {termination}
    assert sorted(kept["facets"]["termination"]) == sorted({r.termination for r in records})

    bad = requests.get(f"{viewer_url}/api/episodes", params={"step": 1, "sucess": "true"}, timeout=10)
    assert bad.status_code == 400 and "sucess" in bad.json()["error"] and "success" in bad.json()["error"]
    bad = requests.get(f"{viewer_url}/api/episodes", params={"step": 1, "kind": "eval"}, timeout=10)
    assert bad.status_code == 400 and "train, val" in bad.json()["error"]
    missing = requests.get(f"{viewer_url}/api/episodes", params={"step": 77}, timeout=10)
    assert missing.status_code == 404 and "train 1" in missing.json()["error"]


def test_one_episode_carries_every_token_with_its_mask_text_and_group(viewer_url: str, run_folder: Path):
    records = dumped(run_folder, "step_1.jsonl")
    episode = requests.get(f"{viewer_url}/api/episode", params={"step": 1, "line": 2}, timeout=60).json()
    record = records[1]
    response = episode["tokens"]["response"]
    assert [t["id"] for t in response] == record.response_ids
    assert [t["mask"] for t in response] == record.response_mask
    assert all(t["text"] is not None for t in response) and episode["tokenizer_problem"] is None
    assert [t["logprob"] for t in response] == record.response_logprobs
    assert episode["group_lines"] == [i + 1 for i, r in enumerate(records) if r.group == record.group]
    assert len(episode["group_lines"]) == 2  # rollout.n=2: GRPO compares these two


def test_the_run_s_config_and_versions_are_served(viewer_url: str, run_folder: Path):
    run = requests.get(f"{viewer_url}/api/run", timeout=10).json()
    assert run["name"] == run_folder.name and run["versions"]["verl"] == "0.9.0"
    assert run["versions"]["commit"] and "actor_rollout_ref:" in run["training_config"]
    assert run["launcher_config"] == (run_folder / "config.yaml").read_text()


def test_links_out_of_the_run_folder_are_not_followed_and_big_files_are_read_in_part(viewer_url: str,
                                                                                       run_folder: Path, tmp_path: Path):
    """#33 finding 5: `command.txt -> a secret file` and `verl.txt -> /proc/self/environ` were served whole, and a
    400 MB config was read whole before being cut."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOKEN=do-not-serve\n")
    (outside / "step_60.jsonl").write_text((run_folder / TRAJECTORIES / "step_1.jsonl").read_text())
    (run_folder / "command.txt").unlink()
    (run_folder / "command.txt").symlink_to(outside / "secret.txt")
    (run_folder / "verl.txt").unlink()
    (run_folder / "verl.txt").symlink_to("/proc/self/environ")
    (run_folder / TRAJECTORIES / "step_60.jsonl").symlink_to(outside / "step_60.jsonl")
    with (run_folder / "config.yaml").open("r+b") as config:
        config.truncate(400 << 20)  # sparse: 400 MB of zero bytes after the real text
    started = time.monotonic()
    run = requests.get(f"{viewer_url}/api/run", timeout=30).json()
    assert run["command"] == "[not shown: command.txt links outside the run folder]"
    assert run["versions"]["verl.txt"] == "[not shown: verl.txt links outside the run folder]"
    assert "do-not-serve" not in json.dumps(run) and "PATH=" not in json.dumps(run)
    assert run["launcher_config"].endswith(f"[cut at {TEXT_LIMIT} bytes of {400 << 20}]")
    assert len(run["launcher_config"]) < TEXT_LIMIT + 100 and time.monotonic() - started < 10
    steps = requests.get(f"{viewer_url}/api/steps", timeout=10).json()
    assert 60 not in [entry["step"] for entry in steps["steps"]]  # the linked dump is not listed
    assert requests.get(f"{viewer_url}/api/episodes", params={"step": 60}, timeout=10).status_code == 404


def test_the_integrity_alarms_name_each_monitor_and_the_steps_it_fired_at(viewer_url: str, run_folder: Path):
    """Issue #71: the run's banner reads which monitor fired at which step from the metrics (1.0 = fired)."""
    assert requests.get(f"{viewer_url}/api/integrity", timeout=10).json()["alarms"] == []  # a healthy run
    step = metric_lines(run_folder)[-1]["step"]
    with (run_folder / "metrics.jsonl").open("a") as out:
        for number, figures in enumerate([{"reward_hack": 0.0, "log_prob_drift": 1.0},
                                          {"reward_hack": 1.0, "log_prob_drift": 1.0}], start=step + 1):
            out.write(json.dumps({"step": number, "data": {f"beyond_agent/integrity/{name}": value
                                                         for name, value in figures.items()}}) + "\n")
    answer = requests.get(f"{viewer_url}/api/integrity", timeout=10).json()
    assert answer == {"alarms": [{"monitor": "reward_hack", "steps": [step + 2]},
                                 {"monitor": "log_prob_drift", "steps": [step + 1, step + 2]}],
                      "setting": "beyond_agent.integrity"}


def test_the_viewer_answers_only_to_loopback_host_names(viewer_url: str):
    """#33 finding 6 (DNS rebinding): a foreign Host gets 400, the loopback names the page."""
    port = viewer_url.rsplit(":", 1)[1]
    refused = requests.get(f"{viewer_url}/api/run", headers={"Host": "attacker.example"}, timeout=10)
    assert refused.status_code == 400 and "is not a name this viewer answers to" in refused.json()["error"]
    assert requests.get(f"{viewer_url}/api/run", headers={"Host": f"localhost:{port}"}, timeout=10).status_code == 200


def test_an_error_quotes_a_huge_parameter_clipped(viewer_url: str):
    """#33 finding 8: the viewer's 400s echoed the caller's input whole."""
    answer = requests.get(f"{viewer_url}/api/episodes", params={"step": "9" * 20_000 + "x"}, timeout=10)
    assert answer.status_code == 400 and len(answer.content) < 1_000 and "…[+" in answer.json()["error"]


def test_a_dump_line_that_is_not_a_record_is_named(viewer_url: str, run_folder: Path):
    (run_folder / TRAJECTORIES / "step_50.jsonl").write_text('{"schema": 1, "kind": "train"}\n')
    answer = requests.get(f"{viewer_url}/api/episodes", params={"step": 50}, timeout=10)
    assert answer.status_code == 422
    assert "step_50.jsonl:1" in answer.json()["error"] and "missing field" in answer.json()["error"]
    with pytest.raises(TrajectoryFormatError, match="step_50.jsonl:1: missing field"):
        dumped(run_folder, "step_50.jsonl")


def test_panels_have_one_unit_readable_labels_and_no_figure_twice(viewer_url: str):
    panels = {p["id"]: p for p in requests.get(f"{viewer_url}/api/panels", timeout=10).json()["panels"]}
    labels = {panel_id: [line["label"] for line in panel["lines"]] for panel_id, panel in panels.items()}
    assert labels["success"] == ["training episodes", "validation: babyai"]  # success only: reward has its own
    assert labels["reward"] == ["training episodes", "validation: babyai"]  # ours, not verl's critic/score too
    assert labels["rounds"] == ["training episodes"]  # our rounds, not verl's num_turns as well
    assert labels["terminations"] == ["token budget", "round limit"]
    assert "LLM server busy" in labels["time"] and labels["episode_time"] == ["environment calls",
                                                                             "waiting for the LLM"]
    assert panels["time"]["unit"] == "seconds (wall clock)" and panels["success"]["unit"] == "share of episodes"
    assert "tasks" not in panels  # one task: its success per task would be the success curve again
    [validation] = [line for line in panels["success"]["lines"] if line["points"]]
    assert validation["key"] == "val-aux/babyai/success/mean@1"


def test_two_tasks_get_a_success_per_task_panel_and_every_termination_a_label(run_folder: Path):
    from beyond_agent.curves import PANELS, TERMINATIONS
    from beyond_agent.rollout.handler import TERMINATION_REASONS

    assert set(TERMINATIONS) == set(TERMINATION_REASONS)
    tasks = next(panel for panel in PANELS if panel.id == "tasks")
    keys = [f"beyond_agent/task/{task}/{figure}" for task in ("babyai", "frozenlake")
            for figure in ("success_rate", "episodes")]
    assert [(line.key, line.label) for line in tasks.lines(keys)] == [
        ("beyond_agent/task/babyai/success_rate", "babyai"), ("beyond_agent/task/frozenlake/success_rate", "frozenlake")]


def test_the_curves_png_is_drawn_from_the_metrics(run_folder: Path, tmp_path: Path):
    written = write_curves_png(MetricsLog(run_folder), tmp_path / "curves.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written.stat().st_size > 20_000
    out = tmp_path / "cli.png"
    done = subprocess.run([sys.executable, "-m", "beyond_agent.viewer", str(run_folder), "--png", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", done.stderr
    (tmp_path / "empty").mkdir()
    empty = subprocess.run([sys.executable, "-m", "beyond_agent.viewer", str(tmp_path / "empty"), "--png",
                            str(tmp_path / "none.png")], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no metrics" in empty.stderr


def test_earlier_runs_keys_are_read_under_todays_names():
    """Runs before 2026-11-26 logged our figures in verl's timing channel, runs before 2026-11-28 the weight sync's
    outside our namespace; verl's own keys keep theirs."""
    assert current_metric_key("timing_s/beyond_agent/success_rate") == "beyond_agent/success_rate"
    assert current_metric_key("weight_sync/bytes_sent") == "beyond_agent/weight_sync/bytes_sent"
    assert current_metric_key("beyond_agent/weight_sync/bytes_sent") == "beyond_agent/weight_sync/bytes_sent"
    assert current_metric_key("timing_s/update_weights") == "timing_s/update_weights"
