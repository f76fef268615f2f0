"""Run the environment service: `python -m envservice --envs babyai,textcraft --port 8000`.

Binds 127.0.0.1 by default. A non-loopback host needs a token (`--token` or ENVSERVICE_TOKEN). Prints one
line `envservice ready on http://HOST:PORT (envs: ...)` on stdout once it accepts requests; with
`--port 0` the line shows the port the system picked.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading
import time

import uvicorn

from envservice import registry
from envservice.server import Settings, create_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m envservice", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument("--envs", default=None, help="comma-separated env ids (default: all registered)")
    parser.add_argument("--max-sessions", type=int, default=4096, help="most sessions open at once")
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is released")
    parser.add_argument("--token", default=None, help="bearer token required from clients (or ENVSERVICE_TOKEN)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return parser.parse_args(argv)


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


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket (bound here so that port 0 resolves to a real port before start-up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def announce_when_ready(server: uvicorn.Server, url: str, env_ids: list[str]) -> None:
    """Print the ready line once uvicorn has started serving."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    print(f"envservice ready on {url} (envs: {', '.join(env_ids)})", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m envservice`."""
    args = parse_args(argv)
    env_ids = parse_env_ids(args.envs)
    token = args.token or os.environ.get("ENVSERVICE_TOKEN") or None
    if not is_loopback(args.host) and token is None:
        raise SystemExit(f"envservice: refusing to bind non-loopback host {args.host!r} without a token "
                         "(pass --token or set ENVSERVICE_TOKEN)")
    settings = Settings(env_ids=env_ids, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout, token=token)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level=args.log_level))
    threading.Thread(target=announce_when_ready, args=(server, f"http://{host}:{port}", env_ids), daemon=True).start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
