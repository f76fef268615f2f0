"""`launcher.py` run for real: a real envservice, fake trainers and services, real signals.

Every test checks what the launcher started is gone afterwards, and the signal tests also check that
processes the test started itself (one in pytest's process group, one in its own session) survive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from envservice.childproc import ChildProcess, answers_200, free_port

pytestmark = pytest.mark.timeout(180)
QUICKSTART = "examples/quickstart/cpu_tiny.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]


def train_conf(conf, fake_train: Path, out: Path, steps: int, then: str, **extra) -> Path:
    """A launcher YAML serving babyai and training with the fake trainer."""
    return conf({"experiment": {"name": "t"}, "envservice": {"envs": ["babyai"]}, **extra,
                 "train": {"command": ["{python}", str(fake_train), str(out), str(steps), then]}})


def started_pids(folder: Path, tmp_path: Path) -> list[int]:
    """Every pid the launcher started (processes.json) plus the fake trainer's own child."""
    pids = [record["pid"] for record in json.loads((folder / "processes.json").read_text())]
    train_pids = tmp_path / "train_pids.txt"
    if train_pids.exists():
        pids += [int(pid) for pid in train_pids.read_text().split()]
    return pids


@pytest.mark.startup  # a fresh entry process importing verl: the full run only
def test_dry_run_prints_services_and_training_command_and_starts_nothing(launch, tmp_path):
    run = launch("--conf", QUICKSTART, "--with-envservice", "--dry-run", "--backup-dir", str(tmp_path / "exp"),
                 "--", "trainer.total_training_steps=1")
    assert run.wait(60) == 0, run.text()
    text = run.text()
    assert "would start envservice: " in text and "-m envservice --host 127.0.0.1 --port '<free port>' --envs babyai" in text
    command = next(line for line in text.splitlines() if line.startswith("training command: "))
    assert "-m recipe.multiturn_rl.main trainer.device=cpu" in command  # CPU overrides first
    assert command.endswith("trainer.total_training_steps=1")  # the CLI override comes last and wins
    assert "beyond_agent.env.url=http://127.0.0.1:<free port>" in command
    assert "VERL_PLATFORM=cpu" in text
    assert "training config: recipe.multiturn_rl.main composes it and it passes its checks" in text
    assert not (tmp_path / "exp").exists()


@pytest.mark.startup  # a fresh entry process importing verl: the full run only
def test_dry_run_refuses_a_config_verl_would_refuse_and_names_why(launch, tmp_path):
    # 3 prompts x rollout.n=2 cannot be split into mini-batches of 4: verl's validate_config refuses it in
    # the TaskRunner, minutes into a run; the dry run says so at once.
    run = launch("--conf", QUICKSTART, "--dry-run", "--backup-dir", str(tmp_path / "exp"), "--", "data.train_batch_size=3")
    assert run.wait(120) == 1, run.text()
    assert "training config: REFUSED by recipe.multiturn_rl.main" in run.text()
    assert "train_batch_size (3) must be >= actor.ppo_mini_batch_size (4)" in run.text()
    run = launch("--conf", QUICKSTART, "--dry-run", "--", "beyond_agent.rounds.type=growing")
    assert run.wait(120) == 1 and "beyond_agent.rounds.type='growing' is not valid" in run.text(), run.text()
    assert not (tmp_path / "exp").exists()


def test_with_envservice_trains_and_writes_the_experiment_folder(launch, conf, fake_train, tmp_path, helpers):
    backup = tmp_path / "exp"
    run = launch("--conf", str(train_conf(conf, fake_train, tmp_path, 2, "exit")), "--with-envservice",
                 "--backup-dir", str(backup), "--", "extra=1")
    assert run.wait(120) == 0, run.text()
    folder = run.experiment_dir(backup)
    text = run.text()
    assert "envservice is healthy at http://127.0.0.1:" in text
    assert "[launcher] step 2: score=0.2, pg_loss=-0.25" in text
    assert "fake trainer sees http://127.0.0.1:" in text and "args ['extra=1']" in text
    for name in ("config.yaml", "launcher.yaml", "command.txt", "git.txt", "git.diff", "verl.txt", "pip_freeze.txt",
                 "processes.json", "metrics.jsonl", "logs/envservice.log", "logs/train.log"):
        assert (folder / name).exists(), name
    assert "commit: " in (folder / "git.txt").read_text()
    assert "pinned: 0.9.0" in (folder / "verl.txt").read_text() and "installed: " in (folder / "verl.txt").read_text()
    assert "pyyaml" in (folder / "pip_freeze.txt").read_text().lower()
    assert "--with-envservice" in (folder / "command.txt").read_text()
    # The console names the training command in one short line (a recipe's runs to thousands of characters);
    # command.txt keeps all of it.
    line = next(line for line in text.splitlines() if line.startswith("[launcher] training: "))
    assert f"(the whole command: {folder / 'command.txt'}; its output: {folder / 'logs' / 'train.log'})" in line
    assert "extra=1" not in line and "extra=1" in (folder / "command.txt").read_text()
    assert "service_urls" in (folder / "config.yaml").read_text()
    assert [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "step:2" in (folder / "logs" / "train.log").read_text()
    assert not [pid for pid in started_pids(folder, tmp_path) if helpers.is_alive(pid)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_training_stops_exactly_what_it_started(sig, launch, conf, fake_train, tmp_path, helpers,
                                                             unrelated_processes):
    backup = tmp_path / "exp"
    run = launch("--conf", str(train_conf(conf, fake_train, tmp_path, 1, "hang")), "--with-envservice",
                 "--backup-dir", str(backup))
    helpers.wait_for(lambda: "[launcher] step 1:" in run.text(), 90, "the first step line")
    folder = run.experiment_dir(backup)
    pids = started_pids(folder, tmp_path)
    assert len(pids) == 4 and all(helpers.is_alive(pid) for pid in pids)  # envservice, trainer, its child
    run.process.send_signal(sig)
    assert run.wait(60) == 130, run.text()
    assert "stopped everything the launcher started" in run.text()
    assert not [pid for pid in pids if helpers.is_alive(pid)]
    assert all(process.poll() is None for process in unrelated_processes)


def test_sigint_during_startup_stops_the_starting_service(launch, conf, appworld, fake_service_env, tmp_path, helpers,
                                                          unrelated_processes):
    path = conf({"services": appworld(startup_timeout_s=120), "train": {"command": ["true"]}})
    run = launch("--conf", str(path), "--with-appworld", "--env-file", str(fake_service_env),
                 "--backup-dir", str(tmp_path / "exp"))
    service_pid = int(helpers.wait_for(lambda: _read(tmp_path / "service_pid.txt"), 60, "the fake service"))
    child_pid = int(helpers.wait_for(lambda: _read(tmp_path / "service_child_pid.txt"), 10, "its child"))
    run.process.send_signal(signal.SIGINT)
    assert run.wait(60) == 130, run.text()
    assert not helpers.is_alive(service_pid) and not helpers.is_alive(child_pid)
    assert all(process.poll() is None for process in unrelated_processes)


def test_second_sigint_forces_a_trainer_that_ignores_sigterm(launch, conf, fake_train, tmp_path, helpers,
                                                             unrelated_processes):
    backup = tmp_path / "exp"
    run = launch("--conf", str(train_conf(conf, fake_train, tmp_path, 1, "ignore-term")), "--with-envservice",
                 "--backup-dir", str(backup))
    helpers.wait_for(lambda: "[launcher] step 1:" in run.text(), 90, "the first step line")
    pids = started_pids(run.experiment_dir(backup), tmp_path)
    run.process.send_signal(signal.SIGINT)
    helpers.wait_for(lambda: "press Ctrl-C again" in run.text(), 10, "the first interrupt's message")
    time.sleep(1.0)
    assert run.process.poll() is None  # the trainer ignores SIGTERM: the graceful stop is still waiting
    forced_at = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    assert run.wait(60) == 130, run.text()
    assert time.monotonic() - forced_at < 8  # well under the 10 s grace period
    assert "killing every process group the launcher started" in run.text()
    assert not [pid for pid in pids if helpers.is_alive(pid)]
    assert all(process.poll() is None for process in unrelated_processes)


def test_service_that_never_becomes_healthy_gives_a_clear_error(launch, conf, appworld, fake_service_env, tmp_path,
                                                                helpers):
    path = conf({"services": appworld(startup_timeout_s=3), "train": {"command": ["true"]}})
    run = launch("--conf", str(path), "--with-appworld", "--env-file", str(fake_service_env),
                 "--backup-dir", str(tmp_path / "exp"))
    assert run.wait(60) == 3, run.text()
    text = run.text()
    errors = [line for line in text.splitlines() if line.startswith("[launcher] error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"\[launcher\] error: appworld service did not start: http://127\.0\.0\.1:\d+/healthz did not answer "
        r"within 3 s \(services\.appworld\.startup_timeout_s\); last log line: fake service: loading tasks from "
        r"/nonexistent/appworld/data", errors[0]), text
    assert "fake service: loading tasks from /nonexistent/appworld/data" in text  # the log's tail follows
    assert not helpers.is_alive(int((tmp_path / "service_pid.txt").read_text()))
    assert not helpers.is_alive(int((tmp_path / "service_child_pid.txt").read_text()))
    assert "secret-123" not in (next((tmp_path / "exp").glob("*/")) / "command.txt").read_text()


def test_with_appworld_error_reaches_the_user_in_one_line(launch, conf, appworld, tmp_path):
    """Without an `appworld` env the service exits listing the valid ids; with one (and no data here) the
    service starts and the first session (the dataset step) fails with AppWorld's missing-data error."""
    from envservice.registry import registered_ids

    missing = tmp_path / "no-appworld-data"
    dotenv = tmp_path / "aw.env"
    dotenv.write_text(f"APPWORLD_PATH={missing}\n")
    data_step = {"name": "data", "command": ["{python}", "-m", "beyond_agent.data", "--env", "appworld",
                                             "--train-tasks", "0:1", "--val-tasks", "0:1", "--envservice-url",
                                             "{env_url}", "--out", "{experiment_dir}/data"]}
    path = conf({"services": appworld(startup_timeout_s=60), "prepare": [data_step], "train": {"command": ["true"]}})
    run = launch("--conf", str(path), "--with-appworld", "--env-file", str(dotenv), "--backup-dir", str(tmp_path / "x"))
    code = run.wait(120)
    errors = [line for line in run.text().splitlines() if line.startswith("[launcher] error:")]
    assert len(errors) == 1, run.text()
    if "appworld" not in registered_ids():
        assert code == 3 and errors[0].startswith(
            "[launcher] error: appworld service did not start: exited with code 1 after ")
        # the service's own last line, whatever envs are registered when it runs
        assert re.search(r": envservice: --envs has unknown id\(s\) \['appworld'\]; valid ids: [a-z, ]*babyai", errors[0])
    else:
        assert code == 1 and "appworld is healthy at http://127.0.0.1:" in run.text()
        assert errors[0].startswith("[launcher] error: prepare data failed with code 1: ")
        assert "not found" in errors[0].lower() and str(missing) in errors[0]  # APPWORLD_PATH reached the service


def test_bad_yaml_key_is_named_before_anything_starts(launch, conf, tmp_path):
    path = conf({"envservice": {"envs": ["babyai"], "prot": 1}, "train": {"command": ["true"]}})
    run = launch("--conf", str(path), "--with-envservice", "--backup-dir", str(tmp_path / "exp"))
    assert run.wait(60) == 2
    assert "[launcher] error: envservice has unknown key(s) ['prot']; valid keys: envs, env_config, host, port" in run.text()
    assert not (tmp_path / "exp").exists()


def test_with_envservice_needs_envs_in_the_yaml(launch, conf, tmp_path):
    run = launch("--conf", str(conf({"train": {"command": ["true"]}})), "--with-envservice", "--dry-run")
    assert run.wait(60) == 2
    assert "--with-envservice needs envservice.envs in" in run.text()
    assert re.search(r"valid env ids: [a-z, ]*babyai", run.text())


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() and path.read_text().strip() else None


def test_failed_preparation_step_is_one_line_and_training_never_starts(launch, conf, tmp_path):
    failing = ["{python}", "-c", "import sys; print('writing tasks'); sys.exit('no tasks for env xyz')"]
    path = conf({"prepare": [{"name": "data", "command": failing}],
                 "train": {"command": ["{python}", "-c", "print('TRAINING RAN')"]}})
    run = launch("--conf", str(path), "--backup-dir", str(tmp_path / "exp"))
    assert run.wait(60) == 1, run.text()
    assert "[launcher] error: prepare data failed with code 1: no tasks for env xyz (log: " in run.text()
    assert "TRAINING RAN" not in run.text() and "Traceback" not in run.text()


def test_skip_prepare_leaves_out_the_named_step_and_refuses_a_name_the_yaml_lacks(launch, conf, tmp_path):
    # The GPU checks train a shaped model given as an override, so the YAML's tiny-model step is left out (it built
    # a model nothing used, 15 s on the H200); the other steps still run, in order.
    steps = [{"name": name, "command": ["{python}", "-c", f"open({str(tmp_path / name)!r}, 'w').write('made')"]}
             for name in ("model", "data")]
    path = conf({"prepare": steps, "train": {"command": ["{python}", "-c", "print('TRAINING RAN')"]}})
    run = launch("--conf", str(path), "--skip-prepare", "model", "--backup-dir", str(tmp_path / "exp"))
    assert run.wait(60) == 0, run.text()
    assert (tmp_path / "data").exists() and not (tmp_path / "model").exists()
    assert "prepare data: " in run.text() and "prepare model" not in run.text() and "TRAINING RAN" in run.text()
    plan = launch("--conf", str(path), "--skip-prepare", "data", "--plan")
    assert plan.wait(60) == 0 and "would prepare model: " in plan.text() and "would prepare data" not in plan.text()
    refused = launch("--conf", str(path), "--skip-prepare", "modle", "--backup-dir", str(tmp_path / "exp2"))
    assert refused.wait(60) == 2
    assert f"[launcher] error: --skip-prepare modle: {path} has no prepare step of that name (its steps: model, data)" \
        in refused.text()
    assert not (tmp_path / "exp2").exists()


def test_unknown_placeholder_is_named_before_anything_starts(launch, conf, tmp_path):
    path = conf({"envservice": {"envs": ["babyai"]}, "train": {"command": ["echo", "{envservice_url}"]}})
    run = launch("--conf", str(path), "--with-envservice", "--backup-dir", str(tmp_path / "exp"))
    assert run.wait(60) == 2
    assert ("[launcher] error: train.command: unknown placeholder {envservice_url}; valid: {python}, {repo}, "
            "{experiment_dir}, {env_url}") in run.text()
    assert "starting envservice" not in run.text() and not (tmp_path / "exp").exists()


def webshop_conf(conf, fake_train: Path, out: Path, server_url: str) -> Path:
    """The WebShop example's shape: the user's own AgentGym server (no command) and envservice in front of it."""
    return conf({
        "experiment": {"name": "webshop"},
        "services": {"webshop_server": {"health_url": "$WEBSHOP_URL/", "startup_timeout_s": 3,
                                        "hint": "Start your WebShop server or set WEBSHOP_URL."}},
        "envservice": {"envs": ["webshop"], "env_config": str(REPO_ROOT / "examples/webshop/envs.yaml")},
        "train": {"command": ["{python}", str(fake_train), str(out), "1", "exit"]},
    }, name="webshop.yaml")


def test_the_users_own_server_is_waited_for_and_its_absence_is_one_clear_line(launch, conf, fake_train, tmp_path,
                                                                              helpers):
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / ".env").write_text(f"WEBSHOP_URL={url}\n")
    path = webshop_conf(conf, fake_train, tmp_path, url)
    run = launch("--conf", str(path), "--env-file", str(tmp_path / ".env"), "--with-envservice",
                 "--backup-dir", str(tmp_path / "a"))
    assert run.wait(60) != 0
    text = run.text()
    assert f"webshop_server is not running: nothing answered {url}/ with 200 within 3 s " \
           "(services.webshop_server.startup_timeout_s). Start your WebShop server or set WEBSHOP_URL." in text
    assert "starting envservice" not in text  # nothing was started for a run that cannot work

    server = ChildProcess.start([sys.executable, "-m", "envservice.remote.agentgym_example_server", "--env-type",
                                 "webshop", "--port", url.rsplit(":", 1)[1]], "webshop", tmp_path / "webshop.log")
    try:
        server.wait_until(lambda: answers_200(f"{url}/"), 60, "answering /")
        run = launch("--conf", str(path), "--env-file", str(tmp_path / ".env"), "--with-envservice",
                     "--backup-dir", str(tmp_path / "b"))
        assert run.wait(120) == 0, run.text()
        text = run.text()
        assert f"webshop_server answers at {url}" in text and "--env-config" in text
        assert "envservice is healthy at http://127.0.0.1:" in text and "step:1" in text
        folder = run.experiment_dir(tmp_path / "b")
        assert server.pid not in started_pids(folder, tmp_path)  # the launcher never owns the user's server
        assert server.group_alive() and os.path.exists(folder / "logs" / "envservice.log")
    finally:
        server.stop()
