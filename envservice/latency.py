"""Injected env latency: `python -m envservice --step-delay SPEC [--create-delay SPEC] [--step-delay-seed N]`.

Why: the bundled envs answer a step in a millisecond, while the envs agents are trained on for real (a
browser, a container, a remote API, a simulator) take from a fraction of a second to many seconds, with a
long tail. Asynchronous rollout exists to hide that tail behind training; a seeded, long-tailed delay
injected into every env call shows what it hides, on any machine and with any env.

Specs (seconds):

    fixed:SECONDS                          every call waits SECONDS, e.g. fixed:0.1
    uniform:min=A,max=B                    uniform in [A, B]
    lognormal:median=M,sigma=S[,max=X]     exp(Normal(ln M, S)), capped at X (default: no cap), e.g.
                                           lognormal:median=0.2,sigma=1.0,max=5 (mean 0.32 s, p99 2.0 s)

`--step-delay` applies to every /step, `--create-delay` to the env reset of every /create. The draws come
from one seeded generator per kind (`--step-delay-seed`, default 0): the sequence of delays is reproducible;
which session gets which delay depends on the order concurrent requests arrive in.

Where the delay is slept: where the env call runs, before the env method, so that it counts toward
`--step-timeout` exactly like a slow env would (a delay past the limit ends the session with `env_timeout`)
and never on the service's event loop: with `--backend inprocess` on the env-call thread (or on the
request's thread-pool thread when there is no limit); with `process`/`ray`, inside the worker, where it
also occupies one of the worker's call threads, as a slow env would.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Callable

KINDS = {
    "fixed": "fixed:SECONDS",
    "uniform": "uniform:min=A,max=B",
    "lognormal": "lognormal:median=M,sigma=S[,max=X]",
}
"""Each kind of delay distribution and the form of its spec."""
_PARAMS = {"uniform": (("min", "max"), ()), "lognormal": (("median", "sigma"), ("max",))}
"""kind -> (required parameters, optional parameters), for the key=value kinds."""
_STANDARD_NORMAL = NormalDist()


class LatencySpecError(ValueError):
    """A delay spec that cannot be parsed; the message names the flag, the bad part and the valid forms."""


@dataclass(frozen=True)
class LatencySpec:
    """A parsed delay distribution (`parse_latency_spec`); `params` are seconds, except lognormal's sigma."""

    kind: str
    params: dict[str, float] = field(default_factory=dict)

    @property
    def cap(self) -> float:
        """The longest delay it can draw (inf for an uncapped lognormal)."""
        if self.kind == "fixed":
            return self.params["seconds"]
        return self.params.get("max", math.inf)

    def draw(self, rng: random.Random) -> float:
        """One delay in seconds, from `rng`."""
        p = self.params
        if self.kind == "fixed":
            return p["seconds"]
        if self.kind == "uniform":
            return rng.uniform(p["min"], p["max"])
        return min(rng.lognormvariate(math.log(p["median"]), p["sigma"]), self.cap)

    def quantile(self, q: float) -> float:
        """The delay below which a fraction `q` (0 < q < 1) of the draws fall."""
        p = self.params
        if self.kind == "fixed":
            return p["seconds"]
        if self.kind == "uniform":
            return p["min"] + q * (p["max"] - p["min"])
        return min(p["median"] * math.exp(p["sigma"] * _STANDARD_NORMAL.inv_cdf(q)), self.cap)

    def mean(self) -> float:
        """The expected delay (for a capped lognormal, of the capped variable)."""
        p = self.params
        if self.kind == "fixed":
            return p["seconds"]
        if self.kind == "uniform":
            return (p["min"] + p["max"]) / 2
        mu, sigma, cap = math.log(p["median"]), p["sigma"], self.cap
        uncapped = math.exp(mu + sigma * sigma / 2)
        if math.isinf(cap) or sigma == 0:
            return min(uncapped, cap)
        # E[min(X, c)] = E[X; X < c] + c P(X >= c) for X lognormal(mu, sigma).
        z = (math.log(cap) - mu) / sigma
        return uncapped * _STANDARD_NORMAL.cdf(z - sigma) + cap * (1 - _STANDARD_NORMAL.cdf(z))

    def describe(self) -> str:
        """E.g. 'lognormal(median=0.2 s, sigma=1, max=5 s): mean 0.32 s, p50 0.2 s, p90 0.72 s, p99 2.05 s'."""
        if self.kind == "fixed":
            return f"fixed {self.params['seconds']:g} s"
        shape = ", ".join(f"{name}={value:g}" + ("" if name == "sigma" else " s")
                          for name, value in self.params.items())
        figures = ", ".join(f"p{round(q * 100)} {self.quantile(q):.3g} s" for q in (0.5, 0.9, 0.99))
        return f"{self.kind}({shape}): mean {self.mean():.3g} s, {figures}"


class LatencySampler:
    """Thread-safe seeded draws from one spec (the service answers requests on many threads)."""

    def __init__(self, spec: LatencySpec, seed: int | str = 0) -> None:
        self.spec = spec
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def draw(self) -> float:
        """The next delay in seconds."""
        with self._lock:
            return self.spec.draw(self._rng)


@dataclass(frozen=True)
class InjectedLatency:
    """The delays a service injects: into each /step, and into the reset of each /create (None: none)."""

    step: LatencySampler | None = None
    create: LatencySampler | None = None

    @classmethod
    def from_specs(cls, step: LatencySpec | None, create: LatencySpec | None, seed: int = 0) -> "InjectedLatency":
        """Samplers for the given specs, each with its own stream derived from `seed`."""
        return cls(step=LatencySampler(step, f"{seed}:step") if step else None,
                   create=LatencySampler(create, f"{seed}:create") if create else None)

    def step_delay(self) -> float:
        """The delay of the next step (0.0 when steps are not delayed)."""
        return self.step.draw() if self.step else 0.0

    def create_delay(self) -> float:
        """The delay of the next create's reset (0.0 when creates are not delayed)."""
        return self.create.draw() if self.create else 0.0

    def describe(self) -> str:
        """The step delay, then the create delay when there is one, for the start-up log."""
        text = self.step.spec.describe() if self.step else "none"
        return f"{text}; create: {self.create.spec.describe()}" if self.create else text


def parse_latency_spec(text: str, flag: str = "--step-delay") -> LatencySpec:
    """Parse `fixed:0.1`, `uniform:min=0.1,max=0.5` or `lognormal:median=0.2,sigma=1.0,max=5`.

    Raises `LatencySpecError` naming `flag`, the part that is wrong and the valid forms.
    """

    def fail(reason: str) -> LatencySpecError:
        return LatencySpecError(f"{flag} {text!r}: {reason}; valid specs: {', '.join(KINDS.values())}")

    kind, colon, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise fail(f"unknown kind {kind!r}" if colon else "expected KIND:PARAMETERS")
    if not rest.strip():
        raise fail(f"{kind} needs parameters, e.g. {KINDS[kind]}")
    if kind == "fixed":
        if "=" in rest or "," in rest:
            raise fail(f"fixed takes one number of seconds, not {rest.strip()!r}")
        return LatencySpec("fixed", {"seconds": _seconds(rest, "fixed", fail)})
    required, optional = _PARAMS[kind]
    params: dict[str, float] = {}
    for item in rest.split(","):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not name:
            raise fail(f"{item.strip()!r} is not NAME=VALUE")
        if name not in required + optional:
            raise fail(f"{kind} has no parameter {name!r} (its parameters: {', '.join(required + optional)})")
        if name in params:
            raise fail(f"{name} is given twice")
        params[name] = _seconds(value, name, fail)
    missing = [name for name in required if name not in params]
    if missing:
        raise fail(f"{kind} needs {', '.join(f'{name}=...' for name in missing)}")
    _check_shape(kind, params, fail)
    return LatencySpec(kind, {name: params[name] for name in required + optional if name in params})


def _check_shape(kind: str, p: dict[str, float], fail: Callable[[str], LatencySpecError]) -> None:
    if kind == "uniform" and p["max"] < p["min"]:
        raise fail(f"max={p['max']:g} is below min={p['min']:g}")
    if kind == "lognormal":
        if p["median"] <= 0:
            raise fail("median must be > 0 (use fixed:0 for no delay)")
        if "max" in p and p["max"] < p["median"]:
            raise fail(f"max={p['max']:g} is below median={p['median']:g}")


def _seconds(text: str, name: str, fail: Callable[[str], LatencySpecError]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise fail(f"{name}={text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise fail(f"{name}={text.strip()} must be a finite number >= 0")
    return value


def sleep_for(seconds: float) -> None:
    """Sleep the injected delay on the calling thread (never called on the event loop)."""
    if seconds > 0:
        time.sleep(seconds)


class DelayedEnv:
    """An in-process env whose reset and step first sleep the injected delay (the backend wraps it in its
    time limit, so the delay counts toward `--step-timeout`); other attributes are the env's."""

    def __init__(self, env: Any, latency: InjectedLatency) -> None:
        self.env, self.latency = env, latency

    def reset(self, task: Any) -> Any:
        """Sleep a create delay, then reset the env."""
        sleep_for(self.latency.create_delay())
        return self.env.reset(task)

    def step(self, action: str) -> Any:
        """Sleep a step delay, then step the env."""
        sleep_for(self.latency.step_delay())
        return self.env.step(action)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)
