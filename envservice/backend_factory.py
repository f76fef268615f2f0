"""Choosing where environments run: `make_backend(kind, ...)` builds the in-process, process-pool or Ray backend.

It lives apart from `envservice.backends` because the worker backends (`envservice.workers`,
`envservice.ray_hosts`) build on `backends.PooledBackend`: the factory sits above all three, so no module
imports one that imports it back.
"""

from __future__ import annotations

import os

from envservice.backends import DEFAULT_STEP_TIMEOUT_S, EnvBackend, InProcessBackend
from envservice.latency import InjectedLatency

BACKENDS = ("inprocess", "process", "ray")
"""The valid `kind`s of `make_backend` (`python -m envservice --backend`)."""


def default_workers() -> int:
    """Workers when `--workers` is not given: min(4, CPU count)."""
    return max(1, min(4, os.cpu_count() or 1))


def make_backend(kind: str, *, workers: int | None = None, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 ray_address: str | None = None, ray_actor_options: dict | None = None,
                 latency: InjectedLatency | None = None) -> EnvBackend:
    """The backend named `kind` (one of `BACKENDS`); worker backends start their workers here. `latency`:
    delays to inject into env calls (`envservice.latency`), None for none."""
    if kind == "inprocess":
        return InProcessBackend(step_timeout_s, latency=latency)
    if kind == "process":
        from envservice.workers import ProcessBackend

        return ProcessBackend(workers or default_workers(), step_timeout_s, latency=latency)
    if kind == "ray":
        from envservice.ray_hosts import RayBackend

        return RayBackend(workers or default_workers(), step_timeout_s, address=ray_address or "auto",
                          actor_options=ray_actor_options, latency=latency)
    raise ValueError(f"backend {kind!r} is unknown; valid backends: {', '.join(BACKENDS)}")
