"""One weight sync at a time per host and Ray job id, across independent verl runs.

verl 0.9's colocated (hybrid) weight sync streams tensors from each actor worker to its vLLM worker over a ZMQ
IPC socket named `/tmp/rl-colocate-zmq-<Ray job id>-replica-<r>-rank-<k>.sock`, which the sender removes, binds
and removes again on every sync. The job id only tells runs apart inside one Ray cluster: every run that
starts its own cluster is job `01000000`. When two such runs on one host sync at the same time, the second
sender takes the first one's socket and one of them waits forever (measured here: a CPU training test stuck in
`BucketedWeightSender._init_buffer` for 10 minutes while a benchmark's run trained beside it).

`weight_sync_lock(job_id)` is an exclusive `flock` on a file named after the job id: held around each sync
(the recipe's trainer wraps verl's `update_weights` with it), it makes such syncs take turns. The lock is the
kernel's, so a run that dies releases it; runs of one shared Ray cluster have distinct job ids and never wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Callable, Iterator

LOCK_DIR = "/tmp"
"""Where the lock files live: the folder verl's socket names are in."""


def lock_path(job_id: str) -> str:
    """The lock file of the syncs of Ray job `job_id` on this host."""
    return os.path.join(LOCK_DIR, f"beyond_agent-weight-sync-{job_id}.lock")


@contextlib.contextmanager
def weight_sync_lock(job_id: str, log: Callable[[str], None] = print) -> Iterator[float]:
    """Hold the host's sync lock of `job_id` for the `with` block; yields the seconds spent waiting for it."""
    fd = os.open(lock_path(job_id), os.O_RDWR | os.O_CREAT, 0o666)
    started = time.monotonic()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[beyond_agent] another verl run on this host (Ray job {job_id} too) is syncing weights; this "
                "sync waits for it, since verl names both runs' weight-sync sockets alike")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - started
    finally:
        os.close(fd)  # closing the descriptor releases the lock
