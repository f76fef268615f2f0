"""`python launcher.py --conf CONF.yaml [--with NAME]... [--with-envservice] [--with-appworld] [--with-viewer] [--dry-run | --plan] [--backup-dir D] [-- overrides]`

Reads `.env` and CONF.yaml, starts the services asked for (each in its own process group, logs in the
experiment folder), waits until each is healthy, writes the experiment folder, runs the preparation
steps and training with its output streamed, and on exit, error, Ctrl-C or SIGTERM stops exactly the
processes it started. A second Ctrl-C kills them at once. Everything after `--` is passed to training.
`--with-envservice`, `--with-appworld` and `--with-viewer` are short for `--with envservice`, `--with appworld`
and `--with viewer` (the run viewer, beyond_agent/viewer, built in unless the YAML defines its own).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from beyond_agent.cli_args import DRY_RUN_MARKER, DRY_RUN_VARIABLE
from beyond_agent.gpu_plan import GPU_PLAN_NOTE, GPU_PLAN_WARNING
from launch import experiment
from launch.config import LaunchConfig, LaunchConfigError, PrepareStep, ServiceConfig, load_config
from launch.secrets import Redactor, redact_by_name
from launch.services import PlannedService, ServiceStartError, plan_service, start_service, wait_for_external
from launch.signals import Interrupted, ProcessTracker, install_handlers
from launch.training import (METRICS_FILE, MetricsFollower, PrepareError, run_prepare, run_streamed, substitute,
                             train_command, train_env)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXIT_CONFIG, EXIT_SERVICE, EXIT_INTERRUPTED = 2, 3, 130
SHORTCUTS = {"with_envservice": "envservice", "with_appworld": "appworld", "with_viewer": "viewer"}
DRY_RUN_MODULES = ("recipe.",)
"""Training entries that honour BEYOND_AGENT_DRY_RUN (a copied recipe's main does too)."""
DRY_RUN_TIMEOUT_S = 300
FREE_PORT = "<free port>"
"""What a dry run shows for a port the launcher would pick when it starts the service."""


REDACTOR = Redactor()
"""Hides the run's secret values in everything the launcher prints and writes; `main` sets it once the
config is read (launch/secrets.py)."""


def say(message: str) -> None:
    """Launcher messages go to stderr, prefixed, so they stand out from training's output."""
    print(f"[launcher] {REDACTOR.text(message)}", file=sys.stderr, flush=True)


def show(message: str) -> None:
    """A dry run's lines, on stdout, secrets hidden."""
    print(REDACTOR.text(message), flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options, and the Hydra overrides after `--`."""
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="launcher.py", description=__doc__.splitlines()[0])
    parser.add_argument("--conf", required=True, type=Path, help="the launcher YAML")
    parser.add_argument("--with", dest="services", action="append", default=[], metavar="NAME",
                        help="start the service NAME of the YAML (envservice, or an entry of services:)")
    parser.add_argument("--with-envservice", action="store_true", help="same as --with envservice")
    parser.add_argument("--with-appworld", action="store_true", help="same as --with appworld")
    parser.add_argument("--with-viewer", action="store_true",
                        help="same as --with viewer: the run viewer on a free loopback port, stopped with training")
    preview = parser.add_mutually_exclusive_group()
    preview.add_argument("--dry-run", action="store_true",
                        help="print what would start and the training command, and check the training config "
                             "(composed by its entry, with ours and verl's checks); start nothing")
    preview.add_argument("--plan", action="store_true",
                        help="what --dry-run prints, without the training config check (which imports verl, "
                             "~15 s): the plan in about a second; start nothing")
    parser.add_argument("--skip-prepare", action="append", default=[], metavar="NAME",
                        help="do not run the prepare step NAME of the YAML (its output is given another way, e.g. "
                             "a model path among the overrides); repeatable")
    parser.add_argument("--backup-dir", type=Path, default=None,
                        help="folder for experiment folders (default: experiment.root in the YAML)")
    parser.add_argument("--env-file", type=Path, default=Path(".env"), help="the .env to read (default ./.env)")
    args = parser.parse_args(argv)
    args.services += [name for flag, name in SHORTCUTS.items() if getattr(args, flag)]
    return args, overrides


def services_to_start(config: LaunchConfig, names: list[str]) -> list[ServiceConfig]:
    """The user's own servers (always: training needs them), then the services named on the command line, in
    the YAML's order; unknown names list the defined ones."""
    for name in names:
        if name not in config.services:
            raise LaunchConfigError(unknown_service(config, name))
    chosen = [service for service in config.services.values() if service.external]
    chosen += [service for name, service in config.services.items() if name in names and not service.external]
    talking = [service.name for service in chosen if service.env_url]
    if len(talking) > 1:
        raise LaunchConfigError(f"services {', '.join(talking)} all set env_url: training talks to one env "
                                "service; start only one of them")
    return chosen


def unknown_service(config: LaunchConfig, name: str) -> str:
    """The error for `--with NAME` when the YAML defines no such service."""
    defined = ", ".join(config.services) or "none"
    if name == "envservice":
        from envservice.registry import registered_ids

        return (f"--with-envservice needs envservice.envs in {config.conf_path} "
                f"(valid env ids: {', '.join(registered_ids())})")
    hint = " (see services.appworld in examples/appworld/appworld.yaml)" if name == "appworld" else ""
    return f"--with {name}: {config.conf_path} defines no service {name!r}; defined services: {defined}{hint}"


def placeholder_values(folder: Path, env_url: str = "") -> dict[str, str]:
    """Values for `{...}` placeholders."""
    return {"python": sys.executable, "repo": str(REPO_ROOT), "experiment_dir": str(folder), "env_url": env_url}


def env_url_of(planned: list[PlannedService]) -> str:
    """The URL of the started service training talks to (`env_url: true`), or ''."""
    return next((service.url for service in planned if service.config.env_url), "")


def dry_run(config: LaunchConfig, args, overrides: list[str], services: list[ServiceConfig]) -> int:
    """Print the services, the folder, the preparation steps and the training command, then (unless `--plan`)
    check the training config (`check_training_config`); start nothing. Returns the exit code."""
    root = args.backup_dir or Path(config.experiment_root)
    folder = root / f"{config.experiment_name}-<timestamp>"
    planned = [plan_service(svc, placeholder_values(folder), config.dotenv, port=svc.port or FREE_PORT)
               for svc in services]
    for service in planned:
        if service.config.external:
            show(f"would wait for {service.config.name} (your own server) at {service.health_url}  "
                  f"(deadline {service.config.startup_timeout_s:.0f} s)")
            continue
        show(f"would start {service.config.name}: {shlex.join(service.command)}  "
              f"(deadline {service.config.startup_timeout_s:.0f} s)")
    show(f"would write the experiment folder {folder}")
    values = placeholder_values(folder, env_url_of(planned))
    for step in prepare_steps(config, args.skip_prepare):
        show(f"would prepare {step.name}: " + shlex.join(substitute(a, values, "prepare") for a in step.command))
    env = train_env(config.train, {}, values)
    command = train_command(config.train, values, overrides, bool(config.dotenv.get("ENVSERVICE_TOKEN")))
    show("training environment: " + " ".join(f"{key}={value}" for key, value in redact_by_name(env).items()))
    show(f"training command: {shlex.join(command)}")
    if args.plan:
        show("training config: not checked (--plan; --dry-run composes and checks it)")
        return 0
    return check_training_config(config, values, overrides)


def check_training_config(config: LaunchConfig, values: dict[str, str], overrides: list[str]) -> int:
    """Run the training entry in its dry-run mode (`BEYOND_AGENT_DRY_RUN=1`): it composes its Hydra config with
    the overrides and runs the checks it runs before training (ours and verl's `validate_config`), then exits.
    Its Hydra output goes to a scratch folder. A raw command or a module that is not a BeyondAgent entry (it
    would not know the switch and would train) is not run. Returns the exit code of the dry run."""
    module = config.train.module
    if config.train.command or not module.startswith(DRY_RUN_MODULES):
        why = "a raw command" if config.train.command else f"{module} is not a BeyondAgent training entry"
        show(f"training config: not checked ({why}; only those compose and check their config in a dry run)")
        return 0
    with tempfile.TemporaryDirectory(prefix="beyond_dry_run_") as scratch:
        # A port still to be picked ("<free port>") is not a valid override value: port 0 stands in for it.
        scratch_values = {**values, "experiment_dir": scratch,
                          "env_url": values.get("env_url", "").replace(FREE_PORT, "0")}
        command = train_command(config.train, scratch_values, overrides, bool(config.dotenv.get("ENVSERVICE_TOKEN")))
        env = {**os.environ, **train_env(config.train, config.dotenv, scratch_values), DRY_RUN_VARIABLE: "1"}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(f"training config: the dry run of {module} took over {DRY_RUN_TIMEOUT_S} s")
            return 1
    if done.returncode == 0 and DRY_RUN_MARKER in done.stdout:
        for line in done.stdout.splitlines():
            if line.startswith((GPU_PLAN_WARNING, GPU_PLAN_NOTE)):
                show(line)
        show(f"training config: {module} composes it and it passes its checks")
        return 0
    said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and "warn" not in line.lower()
            and not line.startswith(("  from ", "  use_critic"))]  # verl's import-time warnings say nothing here
    tail = "\n".join(said[-12:])
    print(REDACTOR.text(f"training config: REFUSED by {module} (exit {done.returncode}):\n{tail}"), file=sys.stderr)
    return done.returncode or 1


def prepare_steps(config: LaunchConfig, skipped: list[str]) -> list[PrepareStep]:
    """The YAML's prepare steps less those named by --skip-prepare; an unknown name fails, naming the steps."""
    names = [step.name for step in config.prepare]
    unknown = [name for name in skipped if name not in names]
    if unknown:
        raise LaunchConfigError(f"--skip-prepare {unknown[0]}: {config.conf_path} has no prepare step of that name "
                                f"(its steps: {', '.join(names) or 'none'})")
    return [step for step in config.prepare if step.name not in skipped]


def check_placeholders(config: LaunchConfig, services: list[ServiceConfig], values: dict[str, str],
                       overrides: list[str]) -> None:
    """Fail before anything starts when a command names an unknown placeholder."""
    for service in services:
        plan_service(service, values, config.dotenv, port=service.port or FREE_PORT)
    train_command(config.train, values, overrides, token=False)
    train_env(config.train, {}, values)
    for step in config.prepare:
        for arg in step.command:
            substitute(arg, values, f"prepare {step.name}.command")


def start_services(config: LaunchConfig, services: list[ServiceConfig], folder: Path,
                   tracker: ProcessTracker) -> list[PlannedService]:
    """Start each service in turn and wait until it is healthy."""
    planned = []
    for svc in services:
        service = plan_service(svc, placeholder_values(folder), config.dotenv)
        if svc.external:
            wait_for_external(service, say)
        else:
            start_service(service, folder / "logs" / f"{svc.name}.log", tracker.add, say)
        planned.append(service)
    return planned


def write_backup(folder: Path, config: LaunchConfig, planned: list[PlannedService], command: list[str],
                 argv: list[str]) -> None:
    """The experiment folder's record of this run (see experiment.py)."""
    urls = {service.config.name: service.url for service in planned}
    resolved = {**config.redacted(), "service_urls": urls, "train_command": command}
    experiment.write_config(folder, resolved, config.conf_path, REDACTOR)
    experiment.write_commands(folder, [sys.executable, "launcher.py", *argv], command, REDACTOR)
    experiment.write_git(folder, REPO_ROOT)
    experiment.write_verl(folder)
    (folder / "pip_freeze.txt").write_text(experiment.pip_freeze())


def command_summary(command: list[str], shown: int = 3) -> str:
    """A command's first words and how many follow: a recipe's training command runs to thousands of characters of
    overrides, which the console does not need (command.txt keeps the whole line)."""
    head = shlex.join(command[:shown])
    return head if len(command) <= shown else f"{head} ... ({len(command) - shown} more arguments)"


def run(config: LaunchConfig, args, overrides: list[str], argv: list[str], tracker: ProcessTracker) -> int:
    """Everything after the config is loaded: services, backup, preparation, training. Returns training's code."""
    services = services_to_start(config, args.services)
    steps = prepare_steps(config, args.skip_prepare)
    root = args.backup_dir or Path(config.experiment_root)
    check_placeholders(config, services, placeholder_values(root, "http://check"), overrides)
    folder = experiment.create_experiment_dir(root, config.experiment_name)
    say(f"experiment folder: {folder}")
    tracker.on_add = functools.partial(experiment.write_processes, folder)
    experiment.write_commands(folder, [sys.executable, "launcher.py", *argv], None, REDACTOR)
    planned = start_services(config, services, folder, tracker)
    values = placeholder_values(folder, env_url_of(planned))
    command = train_command(config.train, values, overrides, bool(config.dotenv.get("ENVSERVICE_TOKEN")))
    write_backup(folder, config, planned, command, argv)
    env = train_env(config.train, config.dotenv, values)
    for step in steps:
        run_prepare(step, values, env, folder / "logs", tracker, say)
    say(f"training: {command_summary(command)} (the whole command: {folder / 'command.txt'}; its output: "
        f"{folder / 'logs' / 'train.log'})")
    metrics = MetricsFollower(folder / METRICS_FILE, say)
    code = run_streamed("train", command, env, folder / "logs" / "train.log", tracker, on_line=metrics,
                        redact=REDACTOR.text)
    metrics()
    say(f"training exited with code {code} after {metrics.steps} logged step(s); experiment folder: {folder}")
    if metrics.steps:
        say(f"look at it: python -m beyond_agent.viewer {folder}  (curves also in curves.png)")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of launcher.py; returns the exit code."""
    global REDACTOR
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    tracker = ProcessTracker()
    try:
        config = load_config(args.conf, args.env_file)
        REDACTOR = config.redactor(overrides)
        if args.dry_run or args.plan:
            return dry_run(config, args, overrides, services_to_start(config, args.services))
        install_handlers(tracker, say)
        return run(config, args, overrides, argv, tracker)
    except LaunchConfigError as error:
        say(f"error: {error}")
        return EXIT_CONFIG
    except ServiceStartError as error:
        say(f"error: {error.summary}")
        print(error.details, file=sys.stderr, flush=True)
        return EXIT_SERVICE
    except PrepareError as error:
        say(f"error: {error}")
        return 1
    except Interrupted:
        return EXIT_INTERRUPTED
    except Exception as error:  # anything else: the traceback, after we stopped what we started
        traceback.print_exc()
        say(f"error: {type(error).__name__}: {error}")
        return 1
    finally:
        stop_everything(tracker)


def stop_everything(tracker: ProcessTracker) -> None:
    """Stop every process group we started; a second Ctrl-C (handled in signals.py) forces it."""
    if not tracker.children:
        return
    say("stopping: " + ", ".join(f"{child.name} (pgid {child.pgid})" for child in tracker.children))
    while True:
        try:
            tracker.stop_all()
            break
        except Interrupted:  # a signal landed between the first and the stop: stop anyway
            continue
    left = tracker.alive()
    say("stopped everything the launcher started" if not left else f"still alive after SIGKILL: {left}")
