"""The sandbox's first program: caps the sandbox's processes, forwards loopback ports to Unix sockets bound in
from outside, then runs the command and exits with its status (the sandbox, and everything still running in
it, ends with it). It imports only the standard library (it runs as a file, `python -I inside.py`).

    python -I inside.py --nproc 132 --forward 8080=/run/beyond/8080.sock -- python agent.py

Why the process cap is set here: RLIMIT_NPROC counts a user's processes in each user namespace, and only in
here does the count hold the sandbox's processes alone.

Why a forwarder: inside, the network is the sandbox's own loopback and nothing else, so an agent whose
`OPENAI_BASE_URL` is `http://127.0.0.1:8080/...` reaches exactly the one socket it was given.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import threading

_CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve(port: int, socket_path: str) -> None:
    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))

    server = await asyncio.start_server(relay, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _forward(pairs: list[tuple[int, str]], ready: threading.Event) -> None:
    async def main() -> None:
        servers = [asyncio.ensure_future(_serve(port, path)) for port, path in pairs]
        await asyncio.sleep(0)  # the listening sockets are bound before the command starts
        ready.set()
        await asyncio.gather(*servers)

    asyncio.run(main())


def main(argv: list[str]) -> int:
    """Parse `[--nproc N] [--forward PORT=SOCKET]... -- command...`, apply, run the command, return its status."""
    if "--" not in argv:
        print("sandbox.inside: usage: [--nproc N] [--forward PORT=SOCKET]... -- command [args...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    pairs, nproc = [], None
    for flag, value in zip(options[::2], options[1::2]):
        port, _, path = value.partition("=")
        if flag == "--nproc" and value.isdigit():
            nproc = int(value)
        elif flag == "--forward" and port.isdigit() and path:
            pairs.append((int(port), path))
        else:
            print(f"sandbox.inside: bad option {flag} {value} (valid: --nproc N, --forward PORT=SOCKET)",
                  file=sys.stderr)
            return 2
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if pairs:
        ready = threading.Event()
        threading.Thread(target=_forward, args=(pairs, ready), daemon=True, name="forward").start()
        ready.wait(10)
    try:
        return exit_status(subprocess.call(command, stdin=subprocess.DEVNULL))
    except OSError as error:  # no such program, not executable: the command's fault, said on stderr
        print(f"sandbox.inside: cannot run {command[0]!r}: {error}", file=sys.stderr)
        return 127


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
