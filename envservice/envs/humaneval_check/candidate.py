"""The candidate's side of a HumanEval check (runs sandboxed: `python -I candidate.py IN_FD OUT_FD ENTRY SOURCE`).

Runs SOURCE (the prompt and the model's solution) as `__main__`, then answers each call of the function ENTRY:
a call arrives on IN_FD as `{"args": [...], "kwargs": {...}}` (plain data, `plain.py`), and the answer leaves on
OUT_FD as `{"ok": value}` or `{"raised": "Type: message"}`. First it says `{"ready": true}`, or `{"raised": ...}`
when the solution could not be loaded. Whatever this process does, it only ever writes bytes on OUT_FD: the checker
decodes them as plain data or fails the call.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder off the path
import plain  # noqa: E402

_FOREVER = 1e9
_ERROR_CHARS = 500


def _raised(error: BaseException) -> dict[str, str]:
    """What an exception says: its type and the start of its message (a SystemExit too: leaving is no answer)."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return {"raised": text[:_ERROR_CHARS]}


def _solution_traceback(error: BaseException) -> str:
    """The traceback's frames in the solution's own code (none of this driver's), then the error."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == "<solution>"]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(error))


def _load(source: str, entry: str):
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<solution>", "exec"), namespace)
    function = namespace.get(entry)
    if not callable(function):
        raise NameError(f"the solution defines no function {entry!r}")
    return function


def _answer(function, message: dict) -> dict:
    try:
        args = plain.decode(message.get("args", []))
        kwargs = plain.decode(message.get("kwargs", {"dict": []}))
        return {"ok": plain.encode(function(*args, **kwargs))}
    except BaseException as error:  # the solution's own exception, or a value that is not plain data
        return _raised(error)


def main(argv: list[str]) -> int:
    in_fd, out_fd, entry, source = int(argv[0]), int(argv[1]), argv[2], argv[3]
    try:
        function = _load(source, entry)
    except BaseException as error:  # a syntax error, an import that fails, an exit at load time
        tail = _solution_traceback(error)[-_ERROR_CHARS:]
        plain.write_all(out_fd, plain.dumps({"raised": _raised(error)["raised"], "traceback": tail}),
                        time.monotonic() + _FOREVER)
        return 1
    plain.write_all(out_fd, plain.dumps({"ready": True}), time.monotonic() + _FOREVER)
    reader = plain.LineReader(in_fd)
    while (line := reader.read(time.monotonic() + _FOREVER)) is not None:
        try:
            answer = _answer(function, plain.loads(line))
            data = plain.dumps(answer)
        except (plain.NotPlain, ValueError) as error:  # e.g. an int too long to write as text
            data = plain.dumps(_raised(error))
        plain.write_all(out_fd, data, time.monotonic() + _FOREVER)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
