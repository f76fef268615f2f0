"""`python launcher.py --conf CONF.yaml [--with-appworld] [--with-envservice] [--dry-run] [--backup-dir D] [-- overrides]`

Reads `.env` and CONF.yaml, starts the env service(s) asked for (each in its own process group, logs in
the experiment folder), waits until each is healthy, writes the experiment folder, runs the preparation
steps and training with its output streamed, and on exit, error, Ctrl-C or SIGTERM stops exactly the
processes it started. A second Ctrl-C kills them at once. Everything after `--` is passed to training.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import traceback
from pathlib import Path

from launch import experiment
from launch.config import LaunchConfig, LaunchConfigError, ServiceConfig, load_config
from launch.services import ServiceStartError, build_service, start_service
from launch.signals import Interrupted, ProcessTracker, install_handlers
from launch.training import (MetricsWriter, PrepareError, run_prepare, run_streamed, substitute,
                                                 train_command, train_env)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXIT_CONFIG, EXIT_SERVICE, EXIT_INTERRUPTED = 2, 3, 130


def say(message: str) -> None:
    """Launcher messages go to stderr, prefixed, so they stand out from training's output."""
    print(f"[launcher] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options, and the Hydra overrides after `--`."""
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="launcher.py", description=__doc__.splitlines()[0])
    parser.add_argument("--conf", required=True, type=Path, help="the launcher YAML")
    parser.add_argument("--with-appworld", action="store_true", help="start the AppWorld env service (appworld:)")
    parser.add_argument("--with-envservice", action="store_true", help="start envservice with envservice.envs")
    parser.add_argument("--dry-run", action="store_true", help="print what would start and the training command")
    parser.add_argument("--backup-dir", type=Path, default=None,
                        help="folder for experiment folders (default: experiment.root in the YAML)")
    parser.add_argument("--env-file", type=Path, default=Path(".env"), help="the .env to read (default ./.env)")
    return parser.parse_args(argv), overrides


def services_to_start(config: LaunchConfig, args: argparse.Namespace) -> list[ServiceConfig]:
    """The services the flags ask for, in start order."""
    services = []
    if args.with_envservice:
        if config.envservice is None:
            from envservice.registry import registered_ids

            raise LaunchConfigError(f"--with-envservice needs envservice.envs in {config.conf_path} "
                                    f"(valid env ids: {', '.join(registered_ids())})")
        services.append(config.envservice)
    if args.with_appworld:
        services.append(config.appworld)
    return services


def placeholder_values(folder: Path, urls: dict[str, str]) -> dict[str, str]:
    """Values for `{...}` placeholders; training talks to envservice if started, else to AppWorld."""
    return {"python": sys.executable, "repo": str(REPO_ROOT), "experiment_dir": str(folder),
            "env_url": urls.get("envservice") or urls.get("appworld") or ""}


def dry_run(config: LaunchConfig, args, overrides: list[str], services: list[ServiceConfig]) -> int:
    """Print the services, the folder, the preparation steps and the training command; start nothing."""
    root = args.backup_dir or Path(config.experiment_root)
    folder = root / f"{config.experiment_name}-<timestamp>"
    urls = {svc.name: f"http://{svc.host}:{svc.port or '<free port>'}" for svc in services}
    values = placeholder_values(folder, urls)
    for svc in services:
        service = build_service(svc, folder / "logs" / f"{svc.name}.log", config.dotenv)
        print(f"would start {svc.name}: {shlex.join(service.cmd)}  (deadline {svc.startup_timeout_s:.0f} s)")
    print(f"would write the experiment folder {folder}")
    for step in config.prepare:
        print(f"would prepare {step.name}: " + shlex.join(substitute(a, values, "prepare") for a in step.command))
    env = train_env(config.train, {}, values)
    command = train_command(config.train, values, overrides, bool(config.dotenv.get("ENVSERVICE_TOKEN")))
    print("training environment: " + " ".join(f"{key}={value}" for key, value in env.items()))
    print(f"training command: {shlex.join(command)}")
    return 0


def check_placeholders(config: LaunchConfig, values: dict[str, str], overrides: list[str]) -> None:
    """Fail before anything starts when a command names an unknown placeholder."""
    train_command(config.train, values, overrides, token=False)
    train_env(config.train, {}, values)
    for step in config.prepare:
        for arg in step.command:
            substitute(arg, values, f"prepare {step.name}.command")


def start_services(config: LaunchConfig, services: list[ServiceConfig], folder: Path,
                   tracker: ProcessTracker) -> dict[str, str]:
    """Start each service in turn and wait until healthy; {name: url}."""
    urls = {}
    for svc in services:
        service = build_service(svc, folder / "logs" / f"{svc.name}.log", config.dotenv)
        urls[svc.name] = start_service(svc, service, tracker, say)
    return urls


def write_backup(folder: Path, config: LaunchConfig, urls: dict[str, str], command: list[str], argv: list[str]) -> None:
    """The experiment folder's record of this run (see experiment.py)."""
    resolved = {**config.redacted(), "service_urls": urls, "train_command": command}
    experiment.write_config(folder, resolved, config.conf_path)
    experiment.write_commands(folder, [sys.executable, "launcher.py", *argv], command)
    experiment.write_git(folder, REPO_ROOT)
    experiment.write_verl(folder)
    (folder / "pip_freeze.txt").write_text(experiment.pip_freeze())


def run(config: LaunchConfig, args, overrides: list[str], argv: list[str], tracker: ProcessTracker) -> int:
    """Everything after the config is loaded: services, backup, preparation, training. Returns training's code."""
    services = services_to_start(config, args)
    root = args.backup_dir or Path(config.experiment_root)
    check_placeholders(config, placeholder_values(root, {svc.name: "http://check" for svc in services}), overrides)
    folder = experiment.create_experiment_dir(root, config.experiment_name)
    say(f"experiment folder: {folder}")
    tracker.on_add = functools.partial(experiment.write_processes, folder)
    experiment.write_commands(folder, [sys.executable, "launcher.py", *argv], None)
    urls = start_services(config, services, folder, tracker)
    values = placeholder_values(folder, urls)
    command = train_command(config.train, values, overrides, bool(config.dotenv.get("ENVSERVICE_TOKEN")))
    write_backup(folder, config, urls, command, argv)
    env = train_env(config.train, config.dotenv, values)
    for step in config.prepare:
        run_prepare(step, values, env, folder / "logs", tracker, say)
    say(f"training: {shlex.join(command)}")
    metrics = MetricsWriter(folder / "metrics.jsonl", say)
    code = run_streamed("train", command, env, folder / "logs" / "train.log", tracker, on_line=metrics)
    say(f"training exited with code {code} after {metrics.steps} logged step(s); experiment folder: {folder}")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of launcher.py; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    tracker = ProcessTracker()
    try:
        config = load_config(args.conf, args.env_file)
        if args.dry_run:
            return dry_run(config, args, overrides, services_to_start(config, args))
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
