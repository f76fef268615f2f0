"""The `ray` backend: env instances live in N Ray actors, each running an `EnvHost`, anywhere on a cluster.

`--ray-address auto` joins the cluster this machine belongs to, `ray://HOST:10001` connects as a Ray
client, `local` starts a private single-machine Ray for this service (stopped with it). Every node must be
able to import `envservice` and the env packages (install this project in the same environment there).
An actor that dies (crash, node lost, or killed by us after a timeout) ends only its sessions with
`env_error`, and a new actor takes its place.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, WorkerCrashedError

from envservice.backends import DEFAULT_STEP_TIMEOUT_S, PooledBackend, WorkerLost
from envservice.host import EnvHost, Reply
from envservice.latency import InjectedLatency
from envservice.workers import START_TIMEOUT_S, THREADS_PER_WORKER

logger = logging.getLogger("envservice")


class RayBackend(PooledBackend):
    """Env instances in `workers` Ray actors; see the module docstring.

    Args:
        address: 'auto', 'ray://HOST:PORT', 'local', or an address ray.init accepts. Ignored when this
            process is already connected to Ray (tests start their own local Ray).
        actor_options: Ray options of each actor, e.g. {"num_cpus": 1, "resources": {"envs": 1}}.
    """

    name = "ray"

    def __init__(self, workers: int, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, address: str = "auto",
                 actor_options: dict[str, Any] | None = None, latency: InjectedLatency | None = None) -> None:
        self.address = address
        self._owns_ray = connect(address)
        self.actor_options = {"num_cpus": 1, "max_concurrency": THREADS_PER_WORKER, **(actor_options or {})}
        super().__init__(workers, step_timeout_s, latency=latency)

    def _start_worker(self, index: int) -> "RayWorker":
        return RayWorker(index, self.actor_options)

    def describe(self) -> str:
        return f"ray, {len(self._workers)} actors, address {self.address}"

    def shutdown(self) -> None:
        """Kill the actors and disconnect from Ray when this backend connected (a private Ray ends whole)."""
        if self._owns_ray and self.address == "local":
            self._stopping = True  # the actors end with the private Ray; no calls to a Ray being torn down
        else:
            super().shutdown()
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


def connect(address: str, attempts: int = 2) -> bool:
    """Connect this process to Ray unless it already is; returns whether it connected here.

    A local Ray that times out starting (a busy machine) is tried again, `attempts` times in all.
    """
    if ray.is_initialized():
        return False
    options = {"include_dashboard": False} if address == "local" else {"address": address}
    error: Exception | None = None
    for _ in range(attempts if address == "local" else 1):
        try:
            ray.init(**options)
            return True
        except Exception as exc:
            ray.shutdown()
            error = exc
            logger.warning("could not connect to Ray at %s: %s", address, exc)
    raise RuntimeError(f"could not connect to Ray (--ray-address {address}): {error}") from error


class EnvHostActor:
    """The Ray actor class: one `EnvHost` that serves `max_concurrency` calls at once."""

    def __init__(self) -> None:
        self.host = EnvHost()

    def handle(self, method: str, key: str, args: tuple) -> Reply:
        """Run one request (see `EnvHost.handle`)."""
        return self.host.handle(method, key, args)

    def where(self) -> str:
        """'pid 4242 on 10.0.0.7': where this actor runs (also the sign that it started)."""
        return f"pid {os.getpid()} on {ray.util.get_node_ip_address()}"


class RayWorker:
    """The service's handle on one `EnvHostActor` (implements `backends.WorkerHandle`)."""

    def __init__(self, index: int, options: dict[str, Any]) -> None:
        self.index, self.load = index, 0
        # The actor runs `max_concurrency` calls at once and queues the rest, and Ray's timeout counts from the
        # call's submission: a queued call would be taken for a hung one (#33 finding 4). So the service sends
        # an actor only what it can run now; a call waits for a slot here, outside its time limit.
        self._slots = threading.BoundedSemaphore(options.get("max_concurrency", THREADS_PER_WORKER))
        self.actor = ray.remote(EnvHostActor).options(**options).remote()
        self._started = self.actor.where.remote()
        self._where: str | None = None
        self._death: str | None = None

    @property
    def alive(self) -> bool:
        return self._death is None

    def describe(self) -> str:
        return f"ray actor {self.index} ({self._where or 'not started yet'})"

    def request(self, method: str, key: str, args: tuple, timeout_s: float | None) -> Reply:
        """Call the actor and wait for its reply (see `WorkerHandle.request`)."""
        if self._death is not None:
            raise WorkerLost(self._death)
        try:
            self._wait_started()
            self._take_slot()
            try:
                return ray.get(self.actor.handle.remote(method, key, args), timeout=timeout_s)
            finally:
                self._slots.release()
        except GetTimeoutError:
            raise TimeoutError(f"{self.describe()} gave no answer within {timeout_s} s") from None
        except (RayActorError, WorkerCrashedError) as exc:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            self._death = self._death or f"{self.describe()} died ({type(exc).__name__}: {first_line})"
            raise WorkerLost(self._death) from None

    def _take_slot(self) -> None:
        """Wait until the actor has a free slot (each call in it is bounded by its limit, so one comes), or
        `WorkerLost` once the actor is dead."""
        while not self._slots.acquire(timeout=1.0):
            if self._death is not None:
                raise WorkerLost(self._death)

    def _wait_started(self) -> None:
        """Wait for the actor to be placed and started (not counted in the call's limit)."""
        if self._where is not None:
            return
        try:
            self._where = ray.get(self._started, timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            self.kill(f"{self.describe()} did not start within {START_TIMEOUT_S:g} s "
                      "(does the cluster have the resources asked per actor?)")
            raise WorkerLost(self._death) from None

    def kill(self, reason: str) -> None:
        """Kill the actor; its pending and later calls fail with `reason`."""
        self._death = reason
        ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        """Kill the actor (its sessions were closed by the service before)."""
        self._death = self._death or f"{self.describe()} was stopped"
        if not ray.is_initialized():  # any Ray call now would start a new local Ray
            return
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # Ray may already be shutting down
            logger.debug("could not kill %s", self.describe(), exc_info=True)
