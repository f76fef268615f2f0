"""Run the environment service: `python -m envservice --envs babyai,textcraft --port 8000`.

Binds 127.0.0.1 by default, and then answers only to loopback Host names (`--allowed-host` adds one). A
non-loopback host needs a token (`--token` or ENVSERVICE_TOKEN). Prints one
line `envservice ready on http://HOST:PORT (envs: ...; backend: ...; step timeout: ...)` on stdout once it
accepts requests; with `--port 0` the line shows the port the system picked. Before that line the served
envs' packages are imported, in the service and in every worker, so that no first /create stalls on an
import; an env whose import fails is logged and the others are served (`--no-preload` skips this).

Where envs run: `--backend inprocess` (default), `process --workers N`, or
`ray --ray-address auto|ray://HOST:10001|local --workers N`; `--step-timeout S` limits every env call
(0: no limit). See envservice/backends.py.

Injected latency, for benchmarks of what asynchronous rollout hides (envservice/latency.py):
`--step-delay lognormal:median=0.2,sigma=1.0,max=5` (or `fixed:0.1`, `uniform:min=A,max=B`) sleeps a seeded
draw (`--step-delay-seed`) before every env step, `--create-delay SPEC` before the reset of every /create;
the delay runs where the env call runs, inside its `--step-timeout`. The start-up log says
`injecting step latency: ...`.

On a clean stop (SIGTERM, Ctrl-C) every open session is closed and one line accounts for all of them on
stderr: `... envservice stopped: {"created": N, "closed": {"release": ..., "reaper": ..., ...}, "open": 0}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time

import uvicorn

from envservice.childproc import allowed_hosts, is_loopback
from envservice import registry
from envservice.env_config import EnvConfigError, load_env_config
from envservice.latency import InjectedLatency, LatencySpecError, parse_latency_spec
from envservice.backend_factory import BACKENDS, make_backend
from envservice.backends import DEFAULT_STEP_TIMEOUT_S, EnvBackend
from envservice.body_check import LARGE_BODY_BYTES, LARGE_BODY_SHARE
from envservice.host_slots import LOOP_SLOTS_PER_HOST
from envservice.server import BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, EnvServiceConfig, create_app
from envservice.transport import HEAD_TIMEOUT_S, KEEP_ALIVE_S, SPARE_FILE_DESCRIPTORS, server_options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m envservice", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument("--envs", default=None, help="comma-separated env ids (default: all registered)")
    parser.add_argument("--register", action="append", default=[], metavar="ID=MODULE:CLASS",
                        help="serve a TextEnv class under ID without packaging it (repeatable); installed packages "
                        "register theirs through the envservice.envs entry point")
    parser.add_argument("--env-config", action="append", default=[], metavar="FILE",
                        help="a YAML file of envs to serve: remote servers (AgentGym, OpenEnv), Gymnasium games and "
                        "configured classes (see envservice/env_config.py; repeatable)")
    parser.add_argument("--max-sessions", type=int, default=4096, help="most sessions open at once")
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is released")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"largest request body; larger ones get 413 before they are read (default "
                        f"{DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--token", default=None, help="bearer token required from clients (or ENVSERVICE_TOKEN)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer besides localhost/127.0.0.1/::1 when bound to loopback (e.g. a "
                        "container's host name; repeatable); other names get 400 (DNS rebinding)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="connections served at once, more get 503 (default: the open-file limit less "
                        f"{SPARE_FILE_DESCRIPTORS})")
    parser.add_argument("--head-timeout", type=float, default=HEAD_TIMEOUT_S,
                        help="seconds a request head may take to arrive whole; slower ones get 408 and are closed")
    parser.add_argument("--keep-alive", type=float, default=KEEP_ALIVE_S,
                        help="seconds an idle keep-alive connection stays open; keep it above every client's idle "
                             "expiry (EnvClient: 2 s; httpx and the openai SDK: 5 s)")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help="seconds a request body may take once its head arrived; slower ones get 408")
    parser.add_argument("--loop-slots-per-host", type=int, default=LOOP_SLOTS_PER_HOST, metavar="N",
                        help="requests of one client host parsed and routed on the event loop at once; its others "
                        "wait unread, so many connections from one host cannot delay another host's requests; an env "
                        "call waits off the loop and holds none. A host with more requests gets one slot, and gives "
                        "way for up to 2 ms, while a lighter host with at most N is active (envservice/host_slots.py; "
                        f"default {LOOP_SLOTS_PER_HOST}; 0: no limit)")
    parser.add_argument("--large-body-share", type=float, default=LARGE_BODY_SHARE, metavar="FRACTION",
                        help=f"share of the time one client host's JSON checks of bodies over "
                        f"{LARGE_BODY_BYTES // 1024} KiB may keep the checking helper process busy; a check that took "
                        "c CPU seconds makes the host's next such body wait c * (1/FRACTION - 1) (envservice/"
                        f"body_check.py; default {LARGE_BODY_SHARE:g}; 0: no limit)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    parser.add_argument("--no-preload", dest="preload", action="store_false",
                        help="do not import the served envs' packages before the ready line (in the service and "
                        "every worker); starts faster when you serve many envs you will not use, but the first "
                        "/create of each env then waits for its import")
    _add_placement_args(parser)
    _add_latency_args(parser)
    args = parser.parse_args(argv)
    check_backend_args(args)
    args.latency = parse_latency_args(args)
    return args


def _add_latency_args(parser: argparse.ArgumentParser) -> None:
    """Injected env latency (envservice/latency.py), off by default."""
    parser.add_argument("--step-delay", default=None, metavar="SPEC",
                        help="sleep a drawn delay before every env step, counted in --step-timeout: fixed:SECONDS, "
                        "uniform:min=A,max=B or lognormal:median=M,sigma=S[,max=X] (seconds), e.g. "
                        "lognormal:median=0.2,sigma=1.0,max=5; for benchmarks of slow envs")
    parser.add_argument("--create-delay", default=None, metavar="SPEC",
                        help="the same before the env reset of every /create (same SPEC forms)")
    parser.add_argument("--step-delay-seed", type=int, default=0,
                        help="seed of the injected delays (default 0; the sequence of draws is reproducible)")


def parse_latency_args(args: argparse.Namespace) -> InjectedLatency | None:
    """The delays `--step-delay` / `--create-delay` ask for (None when neither is given); a bad spec exits
    with the flag, the bad part and the valid forms."""
    try:
        step = parse_latency_spec(args.step_delay, "--step-delay") if args.step_delay is not None else None
        create = parse_latency_spec(args.create_delay, "--create-delay") if args.create_delay is not None else None
    except LatencySpecError as exc:
        raise SystemExit(f"envservice: {exc}") from None
    if step is None and create is None:
        return None
    return InjectedLatency.from_specs(step, create, seed=args.step_delay_seed)


def _add_placement_args(parser: argparse.ArgumentParser) -> None:
    """Where envs run and how long one env call may take."""
    parser.add_argument("--backend", default="inprocess",
                        help=f"where envs run: {', '.join(BACKENDS)} (default inprocess)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes or Ray actors "
                        "(default min(4, CPU count)); only with --backend process or ray")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to use: auto, ray://HOST:PORT or local "
                        "(default auto); only with --backend ray")
    parser.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs Ray reserves per actor (default 1)")
    parser.add_argument("--ray-resources", default=None,
                        help='custom Ray resources per actor, JSON, e.g. \'{"envs": 1}\'')
    parser.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S, help="seconds one env "
                        f"reset/step/evaluate may take (default {DEFAULT_STEP_TIMEOUT_S:g}; 0: no limit)")


def check_backend_args(args: argparse.Namespace) -> None:
    """Refuse inconsistent placement flags with a sentence naming the flag and the valid values."""
    backend = args.backend
    if backend not in BACKENDS:
        raise SystemExit(f"envservice: --backend {backend!r} is unknown; valid backends: {', '.join(BACKENDS)}")
    if args.workers is not None and (backend == "inprocess" or args.workers < 1):
        raise SystemExit(f"envservice: --workers {args.workers} is invalid: it needs --backend process or ray "
                         f"and a value >= 1 (got --backend {backend})")
    if backend != "ray" and (args.ray_address or args.ray_resources):
        raise SystemExit(f"envservice: --ray-address / --ray-resources need --backend ray (got --backend {backend})")
    if args.max_request_bytes < 1024:
        raise SystemExit(f"envservice: --max-request-bytes {args.max_request_bytes} is too small; give at least 1024")
    if args.step_timeout < 0:
        raise SystemExit(f"envservice: --step-timeout {args.step_timeout:g} is invalid; "
                         "give seconds > 0, or 0 for no limit")
    if args.loop_slots_per_host < 0:
        raise SystemExit(f"envservice: --loop-slots-per-host {args.loop_slots_per_host} is invalid; give a count "
                         ">= 1, or 0 for no limit")
    if not 0 <= args.large_body_share <= 1:
        raise SystemExit(f"envservice: --large-body-share {args.large_body_share:g} is invalid; give a fraction "
                         "in [0, 1], or 0 for no limit")
    if args.ray_resources is not None:
        args.ray_resources = _json_object("--ray-resources", args.ray_resources)


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"envservice: {flag} is not JSON ({exc}); expected e.g. '{{\"envs\": 1}}'") from None
    if not isinstance(value, dict):
        raise SystemExit(f"envservice: {flag} must be a JSON object of resource names to amounts, got {text!r}")
    return value


def build_backend(args: argparse.Namespace) -> EnvBackend:
    """The backend the flags ask for (worker processes or Ray actors are started here)."""
    actor_options = {"num_cpus": args.ray_num_cpus}
    if args.ray_resources:
        actor_options["resources"] = args.ray_resources
    try:
        return make_backend(args.backend, workers=args.workers, step_timeout_s=args.step_timeout,
                            ray_address=args.ray_address, ray_actor_options=actor_options,
                            latency=args.latency)
    except Exception as exc:
        raise SystemExit(f"envservice: could not start --backend {args.backend}: {exc}") from exc


def register_classes(assignments: list[str], env_configs: list[str] = ()) -> None:
    """Register the `--register ID=module:Class` envs and those of each `--env-config FILE`; a malformed entry
    or a taken id exits with the reason."""
    for assignment in assignments:
        try:
            registry.register_from_text(assignment)
        except ValueError as exc:
            raise SystemExit(f"envservice: {exc}") from None
    for path in env_configs:
        try:
            load_env_config(path)
        except EnvConfigError as exc:
            raise SystemExit(f"envservice: {exc}") from None


def parse_env_ids(spec: str | None) -> list[str]:
    """The env ids of `--envs`; an unknown id is an error that lists the registered ones."""
    known = registry.registered_ids()
    if spec is None:
        return known
    ids = [part.strip() for part in spec.split(",") if part.strip()]
    unknown = [env_id for env_id in ids if env_id not in known]
    if unknown or not ids:
        raise SystemExit(f"envservice: --envs has unknown id(s) {unknown or [spec]}; valid ids: {', '.join(known)}")
    return ids


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket (bound here so that port 0 resolves to a real port before start-up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def announce_when_ready(server: uvicorn.Server, url: str, env_ids: list[str], placement: str) -> None:
    """Print the ready line once uvicorn has started serving."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    print(f"envservice ready on {url} (envs: {', '.join(env_ids)}; {placement})", flush=True)


def placement_text(backend: EnvBackend, step_timeout_s: float) -> str:
    """'backend: process, 4 workers; step timeout: 60 s' for the ready line."""
    limit = f"{step_timeout_s:g} s" if step_timeout_s > 0 else "none"
    return f"backend: {backend.describe()}; step timeout: {limit}"


def build_settings(args: argparse.Namespace, env_ids: list[str], token: str | None,
                   backend: EnvBackend) -> EnvServiceConfig:
    """The service `EnvServiceConfig` the parsed flags ask for."""
    return EnvServiceConfig(env_ids=env_ids, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout,
                    token=token, backend=backend, preload=args.preload, max_request_bytes=args.max_request_bytes,
                    allowed_hosts=allowed_hosts(args.host, args.allowed_host), body_timeout_s=args.body_timeout,
                    large_body_share=args.large_body_share)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m envservice`."""
    args = parse_args(argv)
    register_classes(args.register, args.env_config)
    env_ids = parse_env_ids(args.envs)
    token = args.token or os.environ.get("ENVSERVICE_TOKEN") or None
    if not is_loopback(args.host) and token is None:
        raise SystemExit(f"envservice: refusing to bind non-loopback host {args.host!r} without a token "
                         "(pass --token or set ENVSERVICE_TOKEN)")
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    backend = build_backend(args)
    settings = build_settings(args, env_ids, token, backend)
    configure_logging()
    if args.latency is not None:
        logging.getLogger("envservice").warning(
            "injecting step latency: %s (seed %d; slept where env calls run, inside --step-timeout)",
            args.latency.describe(), args.step_delay_seed)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level=args.log_level,
                                           **server_options(args.max_connections, args.head_timeout,
                                                          args.loop_slots_per_host, args.keep_alive)))
    announce = (server, f"http://{host}:{port}", env_ids, placement_text(backend, args.step_timeout))
    threading.Thread(target=announce_when_ready, args=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        backend.shutdown()  # the app's shutdown did it already unless start-up failed
    return 0


def configure_logging() -> None:
    """The service's own log lines (start-up preload, reaping, env failures, the stop ledger) go to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    service_logger = logging.getLogger("envservice")
    service_logger.addHandler(handler)
    service_logger.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
