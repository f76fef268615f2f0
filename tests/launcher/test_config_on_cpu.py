"""The launcher's pure parts: .env parsing, YAML checks that name the bad key, placeholders, services, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

import json

from envservice.childproc import ChildProcess
from launch.config import LaunchConfigError, parse_config, parse_dotenv
from launch.services import activated, plan_service
from launch.training import MetricsFollower, step_summary, substitute, train_command

pytestmark = pytest.mark.timeout(30)
CONF = Path("launch.yaml")


def test_dotenv_comments_quotes_and_export():
    text = "# comment\n\nexport A=1\nB='two words'\nC=\"x=y\"\nEMPTY=\n"
    assert parse_dotenv(text) == {"A": "1", "B": "two words", "C": "x=y", "EMPTY": ""}


def test_dotenv_bad_line_names_the_line():
    with pytest.raises(LaunchConfigError, match=r"\.env:2: expected KEY=VALUE"):
        parse_dotenv("A=1\nnot a pair\n")


def test_unknown_top_level_key_lists_valid_keys():
    with pytest.raises(LaunchConfigError, match=r"unknown key\(s\) \['trian'\]; valid keys: experiment, envservice"):
        parse_config({"trian": {}}, CONF, {})


def test_unknown_service_key_names_section_and_choices():
    with pytest.raises(LaunchConfigError, match=r"envservice has unknown key\(s\) \['env'\]; valid keys: envs, env_config, host"):
        parse_config({"envservice": {"env": ["babyai"]}, "train": {}}, CONF, {})


def test_train_is_required_and_command_excludes_module():
    with pytest.raises(LaunchConfigError, match="train: required"):
        parse_config({}, CONF, {})
    with pytest.raises(LaunchConfigError, match="train.command cannot be combined with train.module"):
        parse_config({"train": {"command": ["true"], "module": "x"}}, CONF, {})


def test_dotenv_supplies_service_defaults_and_appworld_activation():
    dotenv = {"ENVSERVICE_HOST": "127.0.0.2", "ENVSERVICE_PORT": "8123", "APPWORLD_ACTIVATION": "conda activate aw",
              "APPWORLD_PATH": "/data/aw"}
    appworld = {"command": ["{python}", "-m", "envservice", "--envs", "appworld", "--port", "{port}"],
                "activate": "$APPWORLD_ACTIVATION", "env": {"APPWORLD_ROOT": "${APPWORLD_PATH}"}, "env_url": True}
    config = parse_config({"envservice": {"envs": ["babyai"]}, "services": {"appworld": appworld}, "train": {}},
                          CONF, dotenv)
    envservice = config.services["envservice"]
    assert (envservice.host, envservice.port, envservice.activate) == ("127.0.0.2", 8123, None)
    assert list(config.services) == ["envservice", "appworld", "viewer"]  # the viewer is built in
    planned = plan_service(config.services["appworld"], {"python": "/venv/bin/python"}, dotenv, port=9001)
    assert planned.command[:2] == ["bash", "-c"] and "conda activate aw" in planned.command[2]
    assert planned.command[4:] == ["-m", "envservice", "--envs", "appworld", "--port", "9001"]
    assert planned.env["APPWORLD_ROOT"] == "/data/aw" and planned.url == "http://127.0.0.1:9001"
    assert planned.health_url == "http://127.0.0.1:9001/healthz"


def test_a_service_without_activation_runs_our_python_and_its_env_file(tmp_path):
    env_file = tmp_path / "svc.env"
    env_file.write_text("SVC_TOKEN=abc\nDATA=/d\n")
    entry = {"command": ["{python}", "server.py", "--port", "{port}"], "env_file": str(env_file),
             "env": {"WHERE": "$DATA/x"}, "activate": "$UNSET_ACTIVATION"}
    config = parse_config({"services": {"svc": entry}, "train": {}}, CONF, {})
    planned = plan_service(config.services["svc"], {"python": "/venv/bin/python"}, {}, port=7)
    assert planned.command == ["/venv/bin/python", "server.py", "--port", "7"]  # an empty activation is none
    assert planned.env == {"SVC_TOKEN": "abc", "DATA": "/d", "WHERE": "/d/x"}
    assert config.redacted()["services"]["svc"]["env"] == {"WHERE": "$DATA/x"}


def test_bad_service_entries_name_the_key():
    with pytest.raises(LaunchConfigError, match=r"services.svc: give a command \(a list: program and arguments\)"):
        parse_config({"services": {"svc": {"port": 1}}, "train": {}}, CONF, {})
    with pytest.raises(LaunchConfigError, match=r"services.svc has unknown key\(s\) \['cmd'\]; valid keys: command, "):
        parse_config({"services": {"svc": {"cmd": ["x"]}}, "train": {}}, CONF, {})
    with pytest.raises(LaunchConfigError, match=r"services.svc.startup_timeout_s: expected a number, got 'soon'"):
        parse_config({"services": {"svc": {"command": ["x"], "startup_timeout_s": "soon"}}, "train": {}}, CONF, {})


def test_secrets_are_redacted_in_the_record():
    config = parse_config({"train": {"env": {"MY_TOKEN": "t0p"}}}, CONF, {"WANDB_API_KEY": "k3y", "APPWORLD_PATH": "/a"})
    record = config.redacted()
    assert record["dotenv"] == {"WANDB_API_KEY": "***", "APPWORLD_PATH": "/a"}
    assert record["train"]["env"] == {"MY_TOKEN": "***"}


def test_placeholders_fill_known_names_and_leave_hydra_interpolations():
    values = {"experiment_dir": "/x", "env_url": "http://h:1"}
    assert substitute("a={experiment_dir}/d b=${trainer.x}", values, "w") == "a=/x/d b=${trainer.x}"
    with pytest.raises(LaunchConfigError, match=r"train.overrides: unknown placeholder \{exp_dir\}; valid: "):
        substitute("{exp_dir}", values, "train.overrides")


def test_module_command_adds_url_token_reference_and_cli_overrides_last():
    config = parse_config({"train": {"config_name": "c", "overrides": ["a=1"]}}, CONF, {})
    values = {"env_url": "http://127.0.0.1:9", "experiment_dir": "/e"}
    command = train_command(config.train, values, ["a=2"], token=True)
    assert command[1:6] == ["-m", "recipe.multiturn_rl.main", "--config-name=c", "hydra.run.dir=/e/hydra",
                            "a=1"]
    assert command[6:] == ["beyond_agent.env.url=http://127.0.0.1:9",
                           "beyond_agent.env.token=${oc.env:ENVSERVICE_TOKEN}", "a=2"]


def test_metrics_follower_reads_verl_file_tracker_lines_as_they_arrive(tmp_path):
    path, said = tmp_path / "metrics.jsonl", []
    follow = MetricsFollower(path, said.append)
    follow()  # no file yet
    path.write_text(json.dumps({"step": 0, "data": {"val-core/frozenlake/reward/mean@1": 0.5625}}) + "\n"
                    + json.dumps({"step": 1, "data": {"critic/score/mean": 0.5, "actor/pg_loss": -0.25,
                                                      "note": "abc"}}) + "\n" + '{"step": 2, "da')
    follow()
    assert said == ["step 0: frozenlake_val=0.5625", "step 1: score=0.5, pg_loss=-0.25"] and follow.steps == 2
    with path.open("a") as out:  # the half-written line is completed later
        out.write('ta": {"actor/pg_loss": -1.5e-05}}\nnot json\n')
    follow()
    assert said[2:] == ["step 2: pg_loss=-1.5e-05", "metrics.jsonl: a line is not verl's file-tracker format: 'not json'"]


def test_step_summary_of_a_step_without_the_usual_keys():
    assert step_summary(4, {"timing_s/step": 2.0, "x": 1}) == "step 4: step_s=2"
    assert step_summary(5, {"x": "text"}) == "step 5: 1 metrics"


def test_step_summary_names_the_integrity_monitors_that_fired_at_the_step():
    metrics = {"timing_s/step": 2.0, "beyond_agent/integrity/no_signal": 1.0, "beyond_agent/integrity/reward_hack": 0.0,
               "beyond_agent/integrity/prefix": 1.0, "beyond_agent/integrity/signal_groups": 1.0}
    assert step_summary(9, metrics) == "step 9: step_s=2, INTEGRITY ALARM: no_signal, prefix"
    assert step_summary(9, {**metrics, "beyond_agent/integrity/no_signal": 0.0,
                            "beyond_agent/integrity/prefix": 0.0}) == "step 9: step_s=2"


def test_activation_execs_python_so_the_pid_is_the_service(tmp_path):
    script = tmp_path / "act.sh"
    script.write_text("true\n")
    command = activated(["/venv/bin/python", "-m", "envservice", "--envs", "appworld"], str(script))
    assert command[:2] == ["bash", "-c"] and command[2] == f'{{ source {script}; }} >&2 && exec python "$@"'
    assert command[4:] == ["-m", "envservice", "--envs", "appworld"]
    assert activated(["py", "-m", "x"], "conda activate aw")[2] == '{ conda activate aw; } >&2 && exec python "$@"'


def test_last_log_line_is_the_error_line_of_a_traceback(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("Traceback (most recent call last):\n  File \"x\", line 1\nFileNotFoundError: no data at /d\n\n")
    assert ChildProcess(None, "service", log).last_log_line() == "FileNotFoundError: no data at /d"


def test_a_service_without_command_is_the_users_own_server_and_needs_a_health_url():
    config = parse_config({"services": {"shop": {"health_url": "$WEBSHOP_URL/", "hint": "start it"}}, "train": {}},
                          CONF, {})
    assert config.services["shop"].external and config.services["shop"].hint == "start it"
    assert not config.services["viewer"].external
    with pytest.raises(LaunchConfigError, match=r"services.shop: give a command .* or only a health_url"):
        parse_config({"services": {"shop": {"port": 3}}, "train": {}}, CONF, {})


def test_envservice_env_config_becomes_the_flag():
    config = parse_config({"envservice": {"envs": ["webshop"], "env_config": "examples/webshop/envs.yaml"},
                           "train": {}}, CONF, {})
    command = config.services["envservice"].command
    assert command[command.index("--env-config") + 1] == "examples/webshop/envs.yaml"
    with pytest.raises(LaunchConfigError, match=r"envservice.env_config: expected the path"):
        parse_config({"envservice": {"envs": ["x"], "env_config": ["a"]}, "train": {}}, CONF, {})
