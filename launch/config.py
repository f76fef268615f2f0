"""The launcher's inputs: the `.env` file and the launcher YAML, checked into small dataclasses.

The YAML (every key optional except `train`) holds only what the launcher owns; the recipe's own keys go
in `train.overrides`, a plain Hydra override list, and the recipe validates them:

    experiment: {name: quickstart, root: outputs/experiments}
    envservice: {envs: [babyai], env_config: envs.yaml, host: 127.0.0.1, port: 0, args: [], startup_timeout_s: 120}
    services:                       # anything else the run needs; started with --with NAME
      appworld: {command: [...], activate: $APPWORLD_ACTIVATION, env: {APPWORLD_ROOT: $APPWORLD_PATH},
                 env_file: null, env_url: true, health_url: "http://{host}:{port}/healthz",
                 host: 127.0.0.1, port: 0, startup_timeout_s: 300}
      webshop:  {health_url: "$WEBSHOP_URL/", startup_timeout_s: 30, hint: "start your WebShop server: ..."}
                # no command: the user's own server; always waited for, never started
    prepare:    [{name: data, command: [...], skip_if_exists: path}]
    train:      {module: ..., config_path: ..., config_name: ..., cpu: false, overrides: [...], env: {}}
                # or {command: [...], env: {}}

`envservice:` is the short form of the service `python -m envservice --envs ... [--env-config FILE]`
(started with --with-envservice). A service with no `command` is the user's own (an AgentGym WebShop
server, say): the launcher never starts it, but waits for its `health_url` before anything else and, when
it does not answer, stops with `hint`. Unknown keys are errors that name the key and list the valid ones. `.env` supplies
envservice's host, port and token defaults (ENVSERVICE_HOST/PORT/TOKEN), the `$NAME` values of service
entries, and tracker keys; its values are passed on to every process we start.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from beyond_agent.sections import from_section, section_keys
from launch.secrets import Redactor, collect_secrets, redact_by_name, redact_dotenv

DEFAULT_TRAIN_MODULE = "recipe.multiturn_rl.main"


class LaunchConfigError(ValueError):
    """The launcher YAML or `.env` is wrong; the message names the key and what is valid."""


# ---- the YAML's sections as written (read by `beyond_agent.sections.from_section`: unknown keys are refused with
# the valid ones); their values are checked and defaulted where they are turned into the configs below.

@dataclass(frozen=True)
class ExperimentSectionConfig:
    """`experiment:`: where the run's folder goes."""

    name: str | None = None
    """The experiment's name (default: the YAML file's stem)."""
    root: str = "outputs/experiments"
    """The folder that holds the experiments."""


@dataclass(frozen=True)
class EnvserviceSectionConfig:
    """`envservice:`: our env service, `python -m envservice --envs ...` (started with --with-envservice)."""

    envs: Any = None
    """The env ids it serves (none: no envservice)."""
    env_config: Any = None
    """An env-config YAML (`--env-config`)."""
    host: Any = None
    """Where it listens (default: ENVSERVICE_HOST from `.env`, else 127.0.0.1)."""
    port: Any = None
    """Where it listens (default: ENVSERVICE_PORT from `.env`, else a free port)."""
    args: Any = None
    """More arguments for `python -m envservice`."""
    startup_timeout_s: Any = None
    """How long it may take to become healthy."""


@dataclass(frozen=True)
class LaunchFileSectionConfig:
    """The launcher YAML's top level (each section is read on its own, so that errors name it from the top:
    `envservice has unknown key(s) ...`)."""

    experiment: Any = None
    """An `ExperimentSectionConfig` mapping."""
    envservice: Any = None
    """An `EnvserviceSectionConfig` mapping."""
    services: Any = None
    """NAME -> a `ServiceSectionConfig` mapping each."""
    prepare: Any = None
    """A list of `PrepareStep` mappings."""
    train: Any = None
    """A `TrainConfig` mapping; required (checked with a hint of what to give)."""


def _mapping(value: Any, where: str) -> dict:
    """A section's value as a mapping (null: empty); anything else names the key."""
    if value is not None and not isinstance(value, dict):
        raise LaunchConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value or {}


def _read(cls: type, node: Any, where: str) -> Any:
    """`from_section`, its errors as LaunchConfigError."""
    try:
        return from_section(cls, node, where)
    except ValueError as error:
        raise LaunchConfigError(str(error)) from None


@dataclass
class ServiceSectionConfig:
    """One entry of `services:` as written (read by `from_section`; `ServiceConfig` adds its name).

    `command` and `health_url` may use the placeholders of `launch.training` plus `{host}` and `{port}`;
    `env` values and `activate` may use `$NAME` from `.env`, `env_file` or our environment.
    """

    command: list[str] = field(default_factory=list)
    """Program and arguments; `{python}` is this interpreter (with `activate`: the activated `python`)."""
    host: str = "127.0.0.1"
    """Where it listens."""
    port: int = 0
    """Where it listens; 0: a free port on `host`, picked by the launcher."""
    health_url: str = "http://{host}:{port}/healthz"
    """Answers 200 once the service is ready."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment additions (applied after `.env` and `env_file`)."""
    env_file: str | None = None
    """A KEY=VALUE file whose values this service gets (besides `.env`)."""
    activate: str | None = None
    """Sourced (a file) or run (a command) first, in the same shell: another Python environment, say."""
    startup_timeout_s: float = 120.0
    """How long it may take to become healthy."""
    env_url: bool = False
    """Training talks to this service: its URL becomes `{env_url}` and `beyond_agent.env.url`."""
    hint: str | None = None
    """For the user's own server (no `command`): what to do when it does not answer (how to start it)."""


@dataclass(kw_only=True)
class ServiceConfig(ServiceSectionConfig):
    """One service the launcher starts when asked (`--with NAME`): a command in its own process group, ready once
    `health_url` answers 200 (the fields of `ServiceSectionConfig`, checked, and its name)."""

    name: str
    """The service's name (`--with NAME`; its log is logs/NAME.log)."""
    where: str
    """Its key in the YAML, for messages: `envservice` or `services.NAME`."""

    @property
    def external(self) -> bool:
        """The user's own server (no `command`): waited for, never started or stopped by the launcher."""
        return not self.command

    @property
    def timeout_key(self) -> str:
        """The YAML key of the start-up deadline, for messages."""
        return f"{self.where}.startup_timeout_s"


@dataclass
class PrepareStep:
    """A command run after the services are up and before training (e.g. writing the dataset); one entry of
    `prepare:`."""

    name: str
    """Its name in the launcher's output (default: step<index>)."""
    command: list[str]
    """Program and arguments (required)."""
    skip_if_exists: str | None = None
    """A path: the step is skipped when it exists."""


@dataclass
class TrainConfig:
    """How training is run (`train:`, read by `from_section`): a Hydra module with overrides, or a raw `command`."""

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
    services: dict[str, ServiceConfig]
    """The services the YAML defines, by name, in start order (`envservice` first)."""
    prepare: list[PrepareStep]
    train: TrainConfig
    dotenv: dict[str, str]

    def redactor(self, cli_overrides: list[str] = ()) -> Redactor:
        """What hides this run's secret values wherever the launcher prints or writes them (launch/secrets.py)."""
        services = list(self.services.values())
        commands = [service.command for service in services] + [step.command for step in self.prepare]
        commands += [self.train.command or [], self.train.overrides, list(cli_overrides)]
        return collect_secrets([self.train.env, *(service.env for service in services), dict(os.environ)], commands,
                               env_files=[service.env_file for service in services], all_secret=[self.dotenv])

    def redacted(self) -> dict[str, Any]:
        """A plain dict for the experiment folder, secret-named values hidden; `experiment.write_config` then
        hides every secret value of `redactor()` wherever else it appears (arguments, URLs)."""
        data = asdict(self)
        data["conf_path"] = str(self.conf_path)
        data["dotenv"] = redact_dotenv(self.dotenv)
        data["train"]["env"] = redact_by_name(self.train.env)
        for service in data["services"].values():
            service["env"] = redact_by_name(service["env"])
        return data


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


def _str_list(value: Any, key: str) -> list[str]:
    """A list of strings (numbers are converted); anything else names the key."""
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(item, (dict, list)) for item in value):
        raise LaunchConfigError(f"{key}: expected a list of strings, got {value!r}")
    return [str(item) for item in value]


def _str_dict(value: Any, key: str) -> dict[str, str]:
    """A mapping of names to strings; anything else names the key."""
    if not isinstance(value or {}, dict):
        raise LaunchConfigError(f"{key}: expected a mapping of NAME: value")
    return {str(name): str(item) for name, item in (value or {}).items()}


def _number(value: Any, default: float, key: str) -> float:
    """`value` as a float (the default when absent or empty); anything else names the key."""
    try:
        return float(default if value in (None, "") else value)
    except (TypeError, ValueError):
        raise LaunchConfigError(f"{key}: expected a number, got {value!r}") from None


def _envservice(section: EnvserviceSectionConfig, dotenv: dict[str, str]) -> ServiceConfig | None:
    """The `envservice:` section: our own env service, with host/port defaults from `.env`."""
    envs = _str_list(section.envs, "envservice.envs")
    if not envs:
        return None
    env_config = section.env_config
    if env_config is not None and not isinstance(env_config, str):
        raise LaunchConfigError(f"envservice.env_config: expected the path of an env-config YAML, got {env_config!r}")
    command = ["{python}", "-m", "envservice", "--host", "{host}", "--port", "{port}", "--envs", ",".join(envs),
               *(["--env-config", env_config] if env_config else []),
               *_str_list(section.args, "envservice.args")]
    return ServiceConfig(name="envservice", where="envservice", command=command,
                         host=str(section.host or dotenv.get("ENVSERVICE_HOST") or ServiceConfig.host),
                         port=int(_number(section.port, float(dotenv.get("ENVSERVICE_PORT") or 0), "envservice.port")),
                         startup_timeout_s=_number(section.startup_timeout_s, ServiceConfig.startup_timeout_s,
                                                   "envservice.startup_timeout_s"),
                         env_url=True)


def _service(name: str, entry: Any) -> ServiceConfig:
    """One entry of `services:`."""
    where = f"services.{name}"
    written = _mapping(entry, where)
    entry = _read(ServiceSectionConfig, written, where)  # unknown keys refused; values checked below
    command = _str_list(entry.command, f"{where}.command")
    if not command and not written.get("health_url"):  # the default health URL is for a service we start
        raise LaunchConfigError(f"{where}: give a command (a list: program and arguments) to start it, or only a "
                                "health_url to wait for a server you run yourself")
    return ServiceConfig(
        name=name, where=where, command=command, host=str(entry.host or ServiceConfig.host),
        port=int(_number(entry.port, ServiceConfig.port, f"{where}.port")),
        health_url=str(entry.health_url or ServiceConfig.health_url),
        env=_str_dict(entry.env, f"{where}.env"), env_file=entry.env_file, activate=entry.activate,
        startup_timeout_s=_number(entry.startup_timeout_s, ServiceConfig.startup_timeout_s,
                                  f"{where}.startup_timeout_s"),
        env_url=bool(entry.env_url or False), hint=entry.hint)


def _services(data: LaunchFileSectionConfig, dotenv: dict[str, str]) -> dict[str, ServiceConfig]:
    """`envservice:` (first) and the `services:` mapping, by name."""
    section = data.services or {}
    if not isinstance(section, dict):
        raise LaunchConfigError("services: expected a mapping of NAME: {command: [...], health_url: ..., ...}")
    if "envservice" in section:
        raise LaunchConfigError("services.envservice: the name belongs to the `envservice:` section; "
                                "choose another name")
    written = _read(EnvserviceSectionConfig, _mapping(data.envservice, "envservice"), "envservice")
    envservice = _envservice(written, dotenv)
    services = {"envservice": envservice} if envservice else {}
    services.update({str(name): _service(str(name), entry) for name, entry in section.items()})
    services.setdefault("viewer", viewer_service())
    return services


def viewer_service() -> ServiceConfig:
    """The run viewer over this experiment folder (`--with-viewer`); a `services.viewer` entry replaces it."""
    command = ["{python}", "-m", "beyond_agent.viewer", "{experiment_dir}", "--host", "{host}", "--port", "{port}"]
    return ServiceConfig(name="viewer", where="services.viewer", command=command, startup_timeout_s=60.0)


def _prepare(data: LaunchFileSectionConfig) -> list[PrepareStep]:
    """The `prepare:` list of {name, command, skip_if_exists}."""
    steps = data.prepare or []
    if not isinstance(steps, list):
        raise LaunchConfigError("prepare: expected a list of {name, command, skip_if_exists}")
    result = []
    for index, step in enumerate(steps):
        if not isinstance(step, dict):
            raise LaunchConfigError(f"prepare[{index}]: expected a mapping with keys name, command, skip_if_exists")
        step = _read(PrepareStep, {"name": f"step{index}", "command": None, **step}, f"prepare[{index}]")
        command = _str_list(step.command, f"prepare[{index}].command")
        if not command:
            raise LaunchConfigError(f"prepare[{index}].command: required (a list: program and arguments)")
        result.append(PrepareStep(name=str(step.name if step.name is not None else f"step{index}"), command=command,
                                  skip_if_exists=step.skip_if_exists))
    return result


def _train(data: dict) -> TrainConfig:
    """The `train:` section: a module (Hydra) or a raw command, not both."""
    if "train" not in data:
        raise LaunchConfigError(f"train: required; give either train.module (default {DEFAULT_TRAIN_MODULE}) "
                                "with overrides, or train.command")
    written = _mapping(data["train"], "train")
    section = _read(TrainConfig, written, "train")  # unknown keys refused; values checked below
    command = _str_list(section.command, "train.command") or None
    module_keys = [key for key in ("module", "config_path", "config_name", "cpu") if written.get(key) is not None]
    if command and module_keys:
        raise LaunchConfigError(f"train.command cannot be combined with train.{module_keys[0]}: "
                                "choose a module (Hydra) or a raw command")
    return TrainConfig(module=str(section.module or TrainConfig.module), config_path=section.config_path,
                       config_name=section.config_name, cpu=bool(section.cpu or TrainConfig.cpu),
                       overrides=_str_list(section.overrides, "train.overrides"), command=command,
                       env=_str_dict(section.env, "train.env"))


def parse_config(data: Any, conf_path: Path, dotenv: dict[str, str]) -> LaunchConfig:
    """Check the YAML's structure and build a LaunchConfig."""
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{conf_path}: expected a mapping with keys "
                                f"{', '.join(section_keys(LaunchFileSectionConfig))}")
    sections = _read(LaunchFileSectionConfig, data, str(conf_path))
    experiment = _read(ExperimentSectionConfig, _mapping(sections.experiment, "experiment"), "experiment")
    return LaunchConfig(
        conf_path=conf_path, experiment_name=str(experiment.name or conf_path.stem),
        experiment_root=str(experiment.root), services=_services(sections, dotenv), prepare=_prepare(sections),
        train=_train(data), dotenv=dotenv,
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
