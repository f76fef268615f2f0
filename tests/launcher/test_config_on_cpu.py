"""The launcher's pure parts: .env parsing, YAML checks that name the bad key, placeholders, step lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import LaunchConfigError, parse_config, parse_dotenv
from launch.services import activated, last_message
from launch.training import parse_step_line, step_summary, substitute, train_command

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
    with pytest.raises(LaunchConfigError, match=r"envservice: unknown key\(s\) \['env'\]; valid keys: envs, host"):
        parse_config({"envservice": {"env": ["babyai"]}, "train": {}}, CONF, {})


def test_train_is_required_and_command_excludes_module():
    with pytest.raises(LaunchConfigError, match="train: required"):
        parse_config({}, CONF, {})
    with pytest.raises(LaunchConfigError, match="train.command cannot be combined with train.module"):
        parse_config({"train": {"command": ["true"], "module": "x"}}, CONF, {})


def test_dotenv_supplies_service_defaults_and_appworld_activation():
    config = parse_config({"envservice": {"envs": ["babyai"]}, "train": {}}, CONF,
                          {"ENVSERVICE_HOST": "127.0.0.2", "ENVSERVICE_PORT": "8123", "APPWORLD_ACTIVATION": "act.sh"})
    assert (config.envservice.host, config.envservice.port, config.envservice.activation) == ("127.0.0.2", 8123, None)
    assert (config.appworld.envs, config.appworld.port, config.appworld.activation) == (["appworld"], 0, "act.sh")


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
    assert command[1:6] == ["-m", "recipe.beyond_agent.main_beyond_agent", "--config-name=c", "hydra.run.dir=/e/hydra",
                            "a=1"]
    assert command[6:] == ["beyond_agent.env.url=http://127.0.0.1:9",
                           "beyond_agent.env.token=${oc.env:ENVSERVICE_TOKEN}", "a=2"]


def test_step_line_from_a_ray_actor_is_parsed():
    line = "(TaskRunner pid=7) step:3 - critic/score/mean:0.5 - actor/pg_loss:-0.25 - note:abc\n"
    metrics = parse_step_line(line)
    assert metrics == {"step": 3, "critic/score/mean": 0.5, "actor/pg_loss": -0.25}
    assert step_summary(metrics) == "step 3: score=0.5, pg_loss=-0.25"
    assert parse_step_line("no metrics here") is None


def test_step_line_numpy_scalars_are_kept():
    # Regression: verl prints actor losses and validation scores as numpy reprs; they were dropped.
    line = ("step:0 - val-core/frozenlake/reward/mean@1:np.float64(0.5625) - num_turns/max:np.int32(8) "
            "- actor/pg_loss:np.float64(-1.5e-05) - bad:np.float64(abc)\n")
    assert parse_step_line(line) == {"step": 0, "val-core/frozenlake/reward/mean@1": 0.5625, "num_turns/max": 8.0,
                                     "actor/pg_loss": -1.5e-05}
    assert step_summary(parse_step_line(line)) == "step 0: pg_loss=-1.5e-05, frozenlake_val=0.5625"


def test_activation_execs_python_so_the_pid_is_the_service(tmp_path):
    script = tmp_path / "act.sh"
    script.write_text("true\n")
    command = activated(["/venv/bin/python", "-m", "envservice", "--envs", "appworld"], str(script))
    assert command[:2] == ["bash", "-c"] and command[2] == f'{{ source {script}; }} >&2 && exec python "$@"'
    assert command[4:] == ["-m", "envservice", "--envs", "appworld"]
    assert activated(["py", "-m", "x"], "conda activate aw")[2] == '{ conda activate aw; } >&2 && exec python "$@"'


def test_last_message_is_the_error_line_of_a_traceback(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("Traceback (most recent call last):\n  File \"x\", line 1\nFileNotFoundError: no data at /d\n\n")
    assert last_message(log) == "FileNotFoundError: no data at /d"
