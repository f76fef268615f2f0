"""The training rows a run draws through its dataloader, one by one, epoch after epoch, and what a checkpoint needs
so that a resumed run loses none of them.

verl's dataloader yields batches; the rollout (the async pool, or sync mode with dynamic sampling) draws rows one at
a time and ahead of training. verl's checkpoint keeps the dataloader's reading position, which is past every row
read so far: the rows of a batch read but not drawn yet, and the rows drawn but not trained, would be skipped by a
resumed run. `RowStream` keeps those apart so a checkpoint can record them (`read_position`) and a resumed run draws
them again first (`replay`).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch


class RowStream:
    """The rows of `dataloader` one by one, epoch after epoch (each row one element of every batch field); rows
    handed to `replay` come first. Safe to draw from one thread while another records the position."""

    def __init__(self, dataloader: Any):
        self.dataloader = dataloader
        self._lock = threading.Lock()
        self._replay: deque[dict] = deque()
        self._unread: deque[dict] = deque()  # the rest of the batch read last
        self._batches = None

    def __iter__(self) -> RowStream:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._replay:
                return self._replay.popleft()
            while not self._unread:
                self._unread.extend(split_batch(self._next_batch()))
            return self._unread.popleft()

    def _next_batch(self) -> dict[str, Any]:
        for _ in range(2):  # a pass that yields nothing ends an epoch (or a restored, exhausted one); the next starts
            if self._batches is None:
                self._batches = iter(self.dataloader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
        raise RuntimeError("the training dataloader yields no batch: its dataset is empty or smaller than one batch "
                           "(data.train_batch_size with drop_last)")

    def replay(self, rows: list[dict[str, Any]]) -> None:
        """Draw `rows` before any other (a resumed run's rows that were in play at its checkpoint)."""
        with self._lock:
            self._replay.extend(rows)

    def read_position(self) -> tuple[dict, list[dict[str, Any]]]:
        """The dataloader's state and the rows read from it but not drawn yet (replays first), consistent with each
        other: no row is drawn meanwhile."""
        with self._lock:
            return self.dataloader.state_dict(), [*self._replay, *self._unread]


def split_batch(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A collated batch's rows (each row one element of every field). A tensor row is copied: a view of the batch
    would keep (and a checkpoint would save) the whole batch's storage."""
    size = len(next(iter(batch.values())))
    return [{key: own_copy(values[index]) for key, values in batch.items()} for index in range(size)]


def own_copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
