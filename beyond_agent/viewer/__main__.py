"""`python -m beyond_agent.viewer EXPERIMENT_DIR [--host H] [--port P] [--tokenizer PATH] [--png OUT]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from envservice.childproc import allowed_hosts, free_port, is_loopback
from beyond_agent.curves import write_curves_png
from beyond_agent.run_folder import MetricsLog


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The viewer's options."""
    parser = argparse.ArgumentParser(prog="python -m beyond_agent.viewer",
                                     description="Serve a run's dashboard and episodes on a local web page.")
    parser.add_argument("folder", type=Path, help="the experiment folder (or a run's trainer.default_local_dir)")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default: loopback only)")
    parser.add_argument("--port", type=int, default=8600, help="port (default 8600; 0 picks a free one)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for token texts (default: the model of the run's training config)")
    parser.add_argument("--png", type=Path, default=None, help="write the curves PNG here and exit")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="a Host name to answer besides localhost/127.0.0.1/::1 when listening on loopback "
                        "(repeatable); other names get 400 (DNS rebinding)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve the viewer (or write the PNG); returns the exit code."""
    args = parse_args(argv)
    if not args.folder.is_dir():
        print(f"viewer: {args.folder} is not a folder (give an experiment folder)", file=sys.stderr)
        return 2
    if args.png:
        written = write_curves_png(MetricsLog(args.folder), args.png)
        print(f"viewer: wrote {written}" if written else f"viewer: no metrics in {args.folder}; nothing drawn",
              file=sys.stderr)
        return 0 if written else 1
    import uvicorn

    from beyond_agent.viewer.app import create_app

    if not is_loopback(args.host):
        print(f"viewer: warning: listening on {args.host}: anyone who can reach it reads this run "
              "(the viewer has no login)", file=sys.stderr)
    port = args.port or free_port(args.host)
    app = create_app(args.folder.resolve(), args.tokenizer, hosts=allowed_hosts(args.host, args.allowed_host))
    print(f"viewer: serving {args.folder.resolve()} at http://{args.host}:{port}/", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
