"""A stream read to its end with only its head and tail kept: bounded memory, whatever a process writes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import BinaryIO

_CHUNK = 1 << 16


@dataclass
class CapturedOutput:
    """What was kept of one stream: its first and last bytes, and how many in between were dropped."""

    head: bytes = b""
    """The stream's first bytes (up to half the cap)."""
    tail: bytes = b""
    """Its last bytes (up to half the cap), after `dropped` bytes that were counted, not kept."""
    dropped: int = 0
    """Bytes between `head` and `tail` that were not kept."""

    @property
    def total(self) -> int:
        """Bytes the stream carried."""
        return len(self.head) + self.dropped + len(self.tail)

    def text(self) -> str:
        """The kept bytes as text, with a marker where bytes were dropped."""
        head = self.head.decode("utf-8", "replace")
        if not self.dropped:
            return head + self.tail.decode("utf-8", "replace")
        return f"{head}\n[... {self.dropped} bytes dropped ...]\n{self.tail.decode('utf-8', 'replace')}"


class StreamKeeper(threading.Thread):
    """Reads `stream` to its end in a thread, keeping `cap` bytes at most (`captured` once joined)."""

    def __init__(self, stream: BinaryIO, cap: int) -> None:
        super().__init__(daemon=True, name="sandbox-output")
        self.stream, self.half = stream, max(1, cap // 2)
        self.captured = CapturedOutput()

    def run(self) -> None:
        head, tail, dropped = bytearray(), bytearray(), 0
        with self.stream:
            while chunk := self.stream.read1(_CHUNK) if hasattr(self.stream, "read1") else self.stream.read(_CHUNK):
                room = self.half - len(head)
                if room > 0:
                    head += chunk[:room]
                    chunk = chunk[room:]
                tail += chunk
                if len(tail) > self.half:  # keep only the last half-cap: the rest is counted
                    dropped += len(tail) - self.half
                    del tail[:len(tail) - self.half]
        self.captured = CapturedOutput(bytes(head), bytes(tail), dropped)
