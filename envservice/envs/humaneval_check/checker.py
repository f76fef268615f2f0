"""The checker's side of a HumanEval check (runs sandboxed: `python -I checker.py TO_FD FROM_FD SPEC_JSON`).

SPEC_JSON: {"prompt", "entry_point", "test" (HumanEval's test code, or only what precedes `def check` when
`asserts` is given), "asserts" (null: run `check(candidate)`; a list: run each assert line on its own and count),
"timeout_s"}. The candidate function is a stand-in that sends each call to the candidate's process (TO_FD) and
decodes its answer (FROM_FD) into built-in values (`plain.py`). The verdict is one JSON line on stdout:
{"passed", "total", "failures", "ended"} (`ended`: `done`, or why the candidate stopped answering: `gone`,
`timeout`). Exit status 2 means the spec itself could not be run (our fault, never the candidate's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder off the path
import plain  # noqa: E402

MAX_FAILURES = 5
"""Failures the verdict describes (the rest are counted)."""
_TEXT = 300


class CandidateRaised(Exception):
    """The solution raised (its type and message are this exception's message)."""


class CandidateGone(BaseException):
    """The candidate stopped answering: its process ended, it took too long, or it wrote what is not plain data.
    A BaseException so that no `except Exception` in test code can swallow it; the verdict fails either way."""


class Candidate:
    """The function under test, as the test code sees it: each call goes to the candidate's process as plain data
    and its answer comes back as built-in values."""

    def __init__(self, to_fd: int, from_fd: int, deadline: float) -> None:
        self.to_fd, self.reader, self.deadline = to_fd, plain.LineReader(from_fd), deadline
        self.gone: str | None = None
        """Why the candidate stopped answering (None while it answers)."""
        self.ended = "done"

    def wait_ready(self) -> str | None:
        """None once the solution is loaded; else why it could not be (its error and traceback's end)."""
        answer = self._receive()
        if answer.get("ready") is True:
            return None
        if "raised" in answer:
            return f"{answer['raised']}\n{answer.get('traceback', '')}".strip()
        return self._lost("gone", f"it said {str(answer)[:80]} instead of being ready")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.gone is not None:
            raise CandidateGone(self.gone)
        message = plain.dumps({"args": plain.encode(list(args)), "kwargs": plain.encode(kwargs)})
        try:
            plain.write_all(self.to_fd, message, self.deadline)
        except TimeoutError:
            raise CandidateGone(self._lost("timeout", "no answer in time (an endless loop?)")) from None
        except OSError:
            raise CandidateGone(self._lost("gone", "the solution's process ended")) from None
        answer = self._receive()
        if "ok" in answer:
            try:
                return plain.decode(answer["ok"])
            except plain.NotPlain as error:
                raise CandidateGone(self._lost("gone", f"its answer is not plain data ({error})")) from None
        if isinstance(answer.get("raised"), str):
            raise CandidateRaised(answer["raised"][:_TEXT])
        raise CandidateGone(self._lost("gone", "it answered neither a value nor an exception"))

    def _receive(self) -> dict[str, Any]:
        """The next message; raises CandidateGone when there is none in time or it is not a message."""
        if self.gone is not None:
            raise CandidateGone(self.gone)
        try:
            line = self.reader.read(self.deadline)
        except TimeoutError:
            raise CandidateGone(self._lost("timeout", "no answer in time (an endless loop?)")) from None
        except plain.NotPlain as error:
            raise CandidateGone(self._lost("gone", str(error))) from None
        if line is None:
            raise CandidateGone(self._lost("gone", "the solution's process ended before answering"))
        try:
            return plain.loads(line)
        except plain.NotPlain as error:
            raise CandidateGone(self._lost("gone", f"its answer is not plain data ({error})")) from None

    def _lost(self, ended: str, why: str) -> str:
        self.gone, self.ended = why, ended
        return why


def _describe(error: BaseException) -> str:
    if isinstance(error, CandidateRaised):
        return f"the solution raised {error}"
    if isinstance(error, CandidateGone):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def run_asserts(namespace: dict[str, Any], asserts: list[str], candidate: Candidate) -> tuple[int, list[str]]:
    """Run each assert line on its own; (how many passed, what failed)."""
    passed, failures = 0, []
    for number, line in enumerate(asserts, 1):
        try:
            exec(compile(line, f"<visible test {number}>", "exec"), namespace)
            passed += candidate.gone is None  # why: a test passed after the candidate left proves nothing
        except BaseException as error:  # the test failed, whatever the candidate made it raise
            failures.append(f"visible test {number} failed: {line[:_TEXT]} -> {_describe(error)[:_TEXT]}")
    return passed, failures


def run_check(namespace: dict[str, Any], candidate: Candidate) -> tuple[int, list[str]]:
    """HumanEval's `check(candidate)`: (1 when it returned and the candidate answered every call, else 0, why)."""
    try:
        namespace["check"](candidate)
    except BaseException as error:  # an assert, the solution's exception, or the candidate gone
        return 0, [f"a hidden test failed: {_describe(error)[:_TEXT]}"]
    if candidate.gone is not None:  # why: test code that swallowed the failure still fails
        return 0, [f"a hidden test failed: {candidate.gone}"]
    return 1, []


def main(argv: list[str]) -> int:
    to_fd, from_fd, spec = int(argv[0]), int(argv[1]), json.loads(argv[2])
    verdict_out = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # why: whatever the test code prints cannot mix with the verdict
    namespace: dict[str, Any] = {"__name__": "__checker__"}
    try:
        exec(compile(spec["prompt"], "<prompt>", "exec"), namespace)
        exec(compile(spec["test"], "<test>", "exec"), namespace)
    except BaseException as error:  # HumanEval's own code failed: no verdict can be given
        print(f"checker: the problem's code failed: {error!r}", file=sys.stderr)
        return 2
    asserts = spec["asserts"]
    total = 1 if asserts is None else len(asserts)
    candidate = Candidate(to_fd, from_fd, time.monotonic() + float(spec["timeout_s"]))
    try:
        load_error = candidate.wait_ready()
    except CandidateGone:
        load_error = candidate.gone
    if load_error is not None:
        passed, failures = 0, [f"the solution could not be loaded: {load_error[-1000:]}"]
    else:
        namespace["candidate"] = namespace[spec["entry_point"]] = candidate
        passed, failures = (run_check(namespace, candidate) if asserts is None
                            else run_asserts(namespace, asserts, candidate))
    verdict = {"passed": passed, "total": total, "failures": failures[:MAX_FAILURES],
               "more_failures": max(0, len(failures) - MAX_FAILURES), "ended": candidate.ended}
    verdict_out.write(json.dumps(verdict) + "\n")
    verdict_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
