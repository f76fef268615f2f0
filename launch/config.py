"""The launcher's inputs: the `.env` file and the launcher YAML, checked into small dataclasses.

The YAML (every key optional except `train`):

    experiment: {name: quickstart, root: outputs/experiments}
    envservice: {envs: [babyai], host: 127.0.0.1, port: 0, args: [], startup_timeout_s: 120}
    appworld:   {host: 127.0.0.1, port: 0, args: [], startup_timeout_s: 300}
    prepare:    [{name: data, command: [...], skip_if_exists: path}]
    train:      {module: ..., config_path: ..., config_name: ..., cpu: false, overrides: [...], env: {}}
                # or {command: [...], env: {}}

Unknown keys are errors that name the key and list the valid ones. `.env` supplies host, port and token
defaults (ENVSERVICE_HOST/PORT/TOKEN), AppWorld's Python environment (APPWORLD_PATH, APPWORLD_ACTIVATION)
and tracker keys, which are passed on to every process we start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TRAIN_MODULE = "recipe.beyond_agent.main_beyond_agent"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


class LaunchConfigError(ValueError):
    """The launcher YAML or `.env` is wrong; the message names the key and what is valid."""


@dataclass
class ServiceConfig:
    """One env service to start: `python -m envservice --envs ...` with these settings."""

    name: str
    envs: list[str]
    host: str = "127.0.0.1"
    port: int = 0
    args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 120.0
    activation: str | None = None  # a script sourced first (AppWorld's own Python environment)


@dataclass
class PrepareStep:
    """A command run after the services are up and before training (e.g. writing the dataset)."""

    name: str
    command: list[str]
    skip_if_exists: str | None = None


@dataclass
class TrainConfig:
    """How training is run: a Hydra module with overrides, or a raw `command`."""

    module: str = DEFAULT_TRAIN_MODULE
    config_path: str | None = None
    config_name: str | None = None
    cpu: bool = False
    overrides: list[str] = field(default_factory=list)
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LaunchConfig:
    """Everything the launcher needs, resolved from the YAML and `.env`."""

    conf_path: Path
    experiment_name: str
    experiment_root: str
    envservice: ServiceConfig | None
    appworld: ServiceConfig
    prepare: list[PrepareStep]
    train: TrainConfig
    dotenv: dict[str, str]

    def redacted(self) -> dict[str, Any]:
        """A plain dict for the experiment folder, with secret-looking `.env` values hidden."""
        from dataclasses import asdict

        data = asdict(self)
        data["conf_path"] = str(self.conf_path)
        data["dotenv"] = {key: redact(key, value) for key, value in self.dotenv.items()}
        data["train"]["env"] = {key: redact(key, value) for key, value in self.train.env.items()}
        return data


def redact(name: str, value: str) -> str:
    """Hide the value of anything named like a token or key."""
    return "***" if value and SECRET_NAME.search(name) else value


def parse_dotenv(text: str, source: str = ".env") -> dict[str, str]:
    """KEY=VALUE lines; `#` comments, blank lines, `export ` prefixes and surrounding quotes allowed."""
    values = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise LaunchConfigError(f"{source}:{number}: expected KEY=VALUE, got {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def load_dotenv(path: Path) -> dict[str, str]:
    """The `.env` values, or {} when the file does not exist (it is optional)."""
    return parse_dotenv(path.read_text(), str(path)) if path.exists() else {}


def _section(data: dict, key: str, valid: tuple[str, ...], where: str) -> dict:
    """`data[key]` as a dict (empty if absent) whose keys are all in `valid`."""
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise LaunchConfigError(f"{where}{key}: expected a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise LaunchConfigError(f"{where}{key}: unknown key(s) {unknown}; valid keys: {', '.join(valid)}")
    return section


def _str_list(value: Any, key: str) -> list[str]:
    """A list of strings (numbers are converted); anything else names the key."""
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(item, (dict, list)) for item in value):
        raise LaunchConfigError(f"{key}: expected a list of strings, got {value!r}")
    return [str(item) for item in value]


SERVICE_KEYS = ("envs", "host", "port", "args", "startup_timeout_s")
TRAIN_KEYS = ("module", "config_path", "config_name", "cpu", "overrides", "command", "env")
TOP_KEYS = ("experiment", "envservice", "appworld", "prepare", "train")


def _service(data: dict, name: str, dotenv: dict[str, str], default_envs: list[str] | None) -> ServiceConfig | None:
    """The `envservice:` or `appworld:` section, with host/port defaults from `.env`."""
    section = _section(data, name, SERVICE_KEYS, "")
    envs = _str_list(section.get("envs"), f"{name}.envs") or default_envs
    if not envs:
        return None
    try:
        port_key = "APPWORLD_PORT" if name == "appworld" else "ENVSERVICE_PORT"
        port = int(section.get("port", dotenv.get(port_key) or 0))
        timeout = float(section.get("startup_timeout_s", 300.0 if name == "appworld" else 120.0))
    except (TypeError, ValueError) as error:
        raise LaunchConfigError(f"{name}.port / {name}.startup_timeout_s: expected numbers ({error})") from None
    return ServiceConfig(name=name, envs=envs, host=str(section.get("host", dotenv.get("ENVSERVICE_HOST") or "127.0.0.1")),
                         port=port, args=_str_list(section.get("args"), f"{name}.args"), startup_timeout_s=timeout,
                         activation=(dotenv.get("APPWORLD_ACTIVATION") or None) if name == "appworld" else None)


def _prepare(data: dict) -> list[PrepareStep]:
    """The `prepare:` list of {name, command, skip_if_exists}."""
    steps = data.get("prepare") or []
    if not isinstance(steps, list):
        raise LaunchConfigError("prepare: expected a list of {name, command, skip_if_exists}")
    result = []
    for index, step in enumerate(steps):
        if not isinstance(step, dict):
            raise LaunchConfigError(f"prepare[{index}]: expected a mapping with keys name, command, skip_if_exists")
        step = _section({"step": step}, "step", ("name", "command", "skip_if_exists"), f"prepare[{index}].")
        command = _str_list(step.get("command"), f"prepare[{index}].command")
        if not command:
            raise LaunchConfigError(f"prepare[{index}].command: required (a list: program and arguments)")
        result.append(PrepareStep(name=str(step.get("name", f"step{index}")), command=command,
                                  skip_if_exists=step.get("skip_if_exists")))
    return result


def _train(data: dict) -> TrainConfig:
    """The `train:` section: a module (Hydra) or a raw command, not both."""
    if "train" not in data:
        raise LaunchConfigError(f"train: required; give either train.module (default {DEFAULT_TRAIN_MODULE}) "
                                "with overrides, or train.command")
    section = _section(data, "train", TRAIN_KEYS, "")
    command = _str_list(section.get("command"), "train.command") or None
    module_keys = sorted(set(section) & {"module", "config_path", "config_name", "cpu"})
    if command and module_keys:
        raise LaunchConfigError(f"train.command cannot be combined with train.{module_keys[0]}: "
                                "choose a module (Hydra) or a raw command")
    env = section.get("env") or {}
    if not isinstance(env, dict):
        raise LaunchConfigError("train.env: expected a mapping of NAME: value")
    return TrainConfig(module=str(section.get("module", DEFAULT_TRAIN_MODULE)), config_path=section.get("config_path"),
                       config_name=section.get("config_name"), cpu=bool(section.get("cpu", False)),
                       overrides=_str_list(section.get("overrides"), "train.overrides"), command=command,
                       env={str(key): str(value) for key, value in env.items()})


def parse_config(data: Any, conf_path: Path, dotenv: dict[str, str]) -> LaunchConfig:
    """Check the YAML's structure and build a LaunchConfig."""
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{conf_path}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise LaunchConfigError(f"{conf_path}: unknown key(s) {unknown}; valid keys: {', '.join(TOP_KEYS)}")
    experiment = _section(data, "experiment", ("name", "root"), "")
    return LaunchConfig(
        conf_path=conf_path, experiment_name=str(experiment.get("name", conf_path.stem)),
        experiment_root=str(experiment.get("root", "outputs/experiments")),
        envservice=_service(data, "envservice", dotenv, None),
        appworld=_service(data, "appworld", dotenv, ["appworld"]),
        prepare=_prepare(data), train=_train(data), dotenv=dotenv,
    )


def load_config(conf_path: Path, dotenv_path: Path) -> LaunchConfig:
    """Read `.env` and the launcher YAML."""
    if not conf_path.exists():
        raise LaunchConfigError(f"--conf {conf_path}: no such file")
    try:
        data = yaml.safe_load(conf_path.read_text())
    except yaml.YAMLError as error:
        raise LaunchConfigError(f"{conf_path}: not valid YAML: {error}") from None
    return parse_config(data, conf_path, load_dotenv(dotenv_path))
