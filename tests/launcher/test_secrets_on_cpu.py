"""Secrets never leave the launcher in clear (launch/secrets.py): the redactor by hand, then a real launch
whose `.env`, `train.env`, envservice arguments, Hydra overrides and a `user:pass@` URL all carry secrets,
none of which may appear in the experiment folder's files, the teed training log or the launcher's output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch.secrets import HIDDEN, MIN_SECRET_LENGTH, collect_secrets, is_secret_name, secrets_in_arguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_launcher_on_cpu import started_pids  # noqa: E402


def test_secret_values_are_found_by_name_flag_key_and_env_file(tmp_path):
    env_file = tmp_path / "svc.env"
    env_file.write_text("export SVC_TOKEN='from-env-file'\nDATA=/d\n")
    redactor = collect_secrets(
        [{"HF_TOKEN": "hf_abc123", "DB_PASS": "pa55word", "PLAIN": "visible", "WANDB_API_KEY": "k"}],
        [["serve", "--token", "tok-flag-1"], ["--api-key=key-joined-2", "+beyond_agent.env.token=tok-hydra-3",
                                             "data.path=/not/secret"]], env_files=[str(env_file), None])
    assert redactor.secrets == {"hf_abc123", "pa55word", "tok-flag-1", "key-joined-2", "tok-hydra-3",
                                "from-env-file"}  # "k" is shorter than MIN_SECRET_LENGTH: hidden by name only
    assert MIN_SECRET_LENGTH == 4
    line = "run --token tok-flag-1 with hf_abc123 at https://me:hunter22@host.example/x and visible /not/secret"
    assert redactor.text(line) == (f"run --token {HIDDEN} with {HIDDEN} at https://me:{HIDDEN}@host.example/x and "
                                   "visible /not/secret")
    assert redactor.data({"a": ["pa55word", 3], "b": {"c": "x-from-env-file-y"}}) == {
        "a": [HIDDEN, 3], "b": {"c": f"x-{HIDDEN}-y"}}


def test_a_flag_at_the_end_and_plain_arguments_give_nothing():
    assert secrets_in_arguments(["--token"]) == set()
    assert secrets_in_arguments(["--port", "8000", "trainer.keyword=x", "model.path=/m"]) == set()


SECRETS = {"dotenv": "hf_dotenv_secret_1", "train_env": "db-pass-secret-2", "service_arg": "svc-token-secret-3",
           "override": "wandb-key-secret-4", "url_password": "url-password-5"}


def test_no_secret_reaches_the_experiment_folder_or_the_terminal(launch, conf, fake_train, tmp_path, helpers):
    dotenv = tmp_path / "run.env"
    dotenv.write_text(f"HF_TOKEN={SECRETS['dotenv']}\n")
    path = conf({"experiment": {"name": "t"},
                 "envservice": {"envs": ["babyai"], "args": ["--token", SECRETS["service_arg"]]},
                 "train": {"command": ["{python}", str(fake_train), str(tmp_path), "1", "exit"],
                           "env": {"DB_PASS": SECRETS["train_env"], "PLAIN": "plain-value"}}})
    backup = tmp_path / "exp"
    overrides = [f"+trainer.wandb_api_key={SECRETS['override']}",
                 f"data.url=https://me:{SECRETS['url_password']}@data.example/x"]
    run = launch("--conf", str(path), "--env-file", str(dotenv), "--with-envservice", "--backup-dir", str(backup),
                 "--", *overrides)
    assert run.wait(120) == 0, run.text()
    folder = run.experiment_dir(backup)
    written = {str(file.relative_to(folder)): file.read_text(errors="replace")
               for file in folder.rglob("*") if file.is_file()}
    # The fake trainer printed its arguments (the overrides) into the teed log; the service got its token.
    assert "fake trainer sees" in written["logs/train.log"] and f"me:{HIDDEN}@data.example" in written["logs/train.log"]
    assert f"--token {HIDDEN}" in run.text() and "envservice is healthy" in run.text()
    for where, text in [*written.items(), ("launcher output", run.text())]:
        leaked = [name for name, secret in SECRETS.items() if secret in text]
        assert not leaked, f"{where} holds {leaked}"
    assert "plain-value" in written["config.yaml"] and "babyai" in written["launcher.yaml"]  # only secrets go
    assert not [pid for pid in started_pids(folder, tmp_path) if helpers.is_alive(pid)]


def test_the_dry_run_hides_them_too(launch, conf, fake_train, tmp_path):
    path = conf({"experiment": {"name": "t"}, "envservice": {"envs": ["babyai"], "args": ["--token", "svc-tok-dry"]},
                 "train": {"command": ["{python}", str(fake_train), str(tmp_path), "1", "exit"],
                           "env": {"DB_PASS": "abc", "PLAIN": "plain-value"}}})
    run = launch("--conf", str(path), "--with-envservice", "--dry-run", "--", "+x.api_key=dry-key-123")
    assert run.wait(60) == 0, run.text()
    text = run.text()
    assert "svc-tok-dry" not in text and "dry-key-123" not in text and "DB_PASS=abc" not in text
    assert f"DB_PASS={HIDDEN}" in text and "PLAIN=plain-value" in text


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("ENVSERVICE_TOKEN", True), ("beyond_agent.env.token", True), ("--token", True),
    ("access_token_v2", True), ("WANDB_API_KEY", True), ("DB_PASS", True),
    ("TOKENIZERS_PARALLELISM", False), ("beyond_agent.max_tokens_per_turn", False),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", False), ("keyword", False),
])
def test_secret_names_by_hand(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_what_the_attack_found_is_hidden_and_numbers_are_not(tmp_path, monkeypatch, conf):
    """Issue #51's findings: secrets missed by name, and a count taken for one."""
    from launch.config import load_config

    dotenv = tmp_path / "run.env"
    dotenv.write_text("SENTRY_DSN=https://abc123def@o1.ingest.sentry.io/42\nSLACK_WEBHOOK_URL=hooks-slack-secret\n"
                      "MY_AUTH=Bearer auth-bearer-secret\nDB_PASS=pa'ss-word-9\n")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hub-token-from-the-shell")
    path = conf({"experiment": {"name": "t"}, "train": {"command": ["{python}", "-c", "pass"]}})
    config = load_config(path, dotenv)
    redactor = config.redactor(["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=18432",
                                "+data.cache=redis://:redis-pw-77@cache:6379/0"])
    log = ("dsn https://abc123def@o1.ingest.sentry.io/42 hook hooks-slack-secret auth Bearer auth-bearer-secret "
           "shell 'pa'\"'\"'ss-word-9' hub hub-token-from-the-shell cache redis://:redis-pw-77@cache:6379/0 "
           "url https://api.example/v1?user=me&access_token=tok-in-query-5 header Authorization: Bearer "
           "other-bearer-6 response_length/max: 18432 ppo_max_token_len_per_gpu=18432 inside xhooks-slack-secrety")
    hidden = redactor.text(log)
    for secret in ("abc123def", "hooks-slack-secret ", "auth-bearer-secret", "ss-word-9", "hub-token-from-the-shell",
                   "redis-pw-77", "tok-in-query-5", "other-bearer-6"):
        assert secret not in hidden, (secret, hidden)
    assert "?user=me&access_token=***" in hidden and "Bearer ***" in hidden and "redis://:***@cache" in hidden
    assert "response_length/max: 18432 ppo_max_token_len_per_gpu=18432" in hidden  # a count is not a secret
    assert "xhooks-slack-secrety" in hidden  # a value is hidden where it stands as a whole token only
    assert not is_secret_name("ppo_max_token_len_per_gpu") and not is_secret_name("max_token_budget")
    assert set(config.redacted()["dotenv"].values()) == {HIDDEN}
    # Plain settings in .env stay readable: a host, a port, a path (hiding every 127.0.0.1 would ruin logs).
    plain = collect_secrets([], [], all_secret=[{"ENVSERVICE_HOST": "127.0.0.1", "ENVSERVICE_PORT": "8000",
                                                 "APPWORLD_PATH": "/data/appworld", "FLAG": "true"}])
    assert plain.secrets == frozenset() and plain.text("http://127.0.0.1:8000 /data/appworld") == \
        "http://127.0.0.1:8000 /data/appworld"
