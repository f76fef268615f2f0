"""ScienceWorld (scienceworld 1.2.3): elementary-science tasks in a text simulator that runs in a JVM.

A task is one (task name, variation) pair, named `"<task name>:<variation>"` (e.g. `"boil:3"`). The splits
are the package's own variation splits (train/dev/test are contiguous ranges of each task's variations);
they are tabulated in `VARIATIONS` so listing tasks needs no JVM (a test checks the table against the jar).

Every instance starts its own JVM (py4j gateway) with a capped heap and stops it in `close()`. The
package's reward is the change of a 0..100 score; here it is scaled to 0..1. The package's own step limit
is disabled: the service enforces `max_steps` and reports it as truncation.

The state an observation shows (`STATE_KEY`) is the room as the simulator's free `look` describes it, the
inventory and the score (the look and the inventory consume no simulated time): not the answer to the last
command ("The door is now open.", "No known action matches that input.").
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from typing import Any, Iterator

from scienceworld import ScienceWorldEnv

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv, content_digest
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

VARIATIONS: dict[str, tuple[int, int, int]] = {
    "boil": (30, 14, 21),
    "change-the-state-of-matter-of": (30, 14, 21),
    "chemistry-mix": (32, 16, 24),
    "chemistry-mix-paint-secondary-color": (36, 18, 27),
    "chemistry-mix-paint-tertiary-color": (36, 18, 27),
    "find-animal": (300, 150, 225),
    "find-living-thing": (300, 150, 225),
    "find-non-living-thing": (300, 150, 225),
    "find-plant": (300, 150, 225),
    "freeze": (30, 14, 21),
    "grow-fruit": (126, 62, 93),
    "grow-plant": (126, 62, 93),
    "identify-life-stages-1": (14, 6, 9),
    "identify-life-stages-2": (10, 4, 6),
    "inclined-plane-determine-angle": (168, 84, 126),
    "inclined-plane-friction-named-surfaces": (1386, 692, 1038),
    "inclined-plane-friction-unnamed-surfaces": (162, 80, 120),
    "lifespan-longest-lived": (125, 62, 93),
    "lifespan-longest-lived-then-shortest-lived": (125, 62, 93),
    "lifespan-shortest-lived": (125, 62, 93),
    "measure-melting-point-known-substance": (436, 218, 327),
    "measure-melting-point-unknown-substance": (300, 150, 225),
    "melt": (30, 14, 21),
    "mendelian-genetics-known-plant": (120, 60, 90),
    "mendelian-genetics-unknown-plant": (480, 240, 360),
    "power-component": (20, 10, 15),
    "power-component-renewable-vs-nonrenewable-energy": (20, 10, 15),
    "test-conductivity": (900, 450, 675),
    "test-conductivity-of-unknown-substances": (600, 300, 450),
    "use-thermometer": (540, 270, 405),
}
"""Per task: (number of variations, end of the train range, end of the dev range), as scienceworld 1.2.3's
`get_variations_train/dev/test` return them: train = [0, a), dev = [a, b), test = [b, n)."""

JVM_HEAP_ENV = "SCIWORLD_JVM_HEAP"
"""Environment variable that overrides the JVM heap cap (a `-Xmx` value such as `300m` or `1g`)."""

DEFAULT_JVM_HEAP = "300m"

JVM_OPTIONS = ("-XX:+UseSerialGC",)
"""One GC thread per JVM: many small JVMs share the machine (measured: ~240 MB RSS instead of ~330 MB)."""

SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")
"""Simplifications ScienceWorld accepts ('easy' turns on all that suit the task)."""

NO_STEP_LIMIT = 1 << 30
"""The package's own step limit, set out of reach: the service's `max_steps` truncates instead."""

JVM_EXIT_TIMEOUT_S = 10.0

_LAUNCH_LOCK = threading.Lock()


def task_name(name: str, variation: int) -> str:
    """The service's name of a (task, variation) pair."""
    return f"{name}:{variation}"


def parse_task_name(name: str) -> tuple[str, int]:
    """Split `"<task>:<variation>"` back into its parts."""
    task, _, variation = name.rpartition(":")
    return task, int(variation)


def _split_ranges(split: str, n: int, train_end: int, dev_end: int) -> range:
    return {"train": range(0, train_end), "dev": range(train_end, dev_end), "test": range(dev_end, n)}[split]


def _splits() -> dict[str, list[str]]:
    """Task names per split, ordered by task then variation."""
    return {
        split: [task_name(name, v) for name, bounds in VARIATIONS.items() for v in _split_ranges(split, *bounds)]
        for split in ("train", "dev", "test")
    }


def jvm_heap() -> str:
    """The `-Xmx` value for new JVMs (`$SCIWORLD_JVM_HEAP`, default 300m)."""
    return os.environ.get(JVM_HEAP_ENV, DEFAULT_JVM_HEAP)


@contextlib.contextmanager
def _java_options(options: str) -> Iterator[None]:
    """Append `options` to `JAVA_TOOL_OPTIONS` while a JVM is launched (the package passes none of ours)."""
    with _LAUNCH_LOCK:
        previous = os.environ.get("JAVA_TOOL_OPTIONS")
        os.environ["JAVA_TOOL_OPTIONS"] = f"{previous} {options}" if previous else options
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("JAVA_TOOL_OPTIONS", None)
            else:
                os.environ["JAVA_TOOL_OPTIONS"] = previous


def start_simulator() -> ScienceWorldEnv:
    """A ScienceWorld simulator in a new JVM whose heap is capped by `jvm_heap()`."""
    with _java_options(" ".join((f"-Xmx{jvm_heap()}",) + JVM_OPTIONS)):
        return ScienceWorldEnv("", envStepLimit=NO_STEP_LIMIT)


def stop_simulator(simulator: ScienceWorldEnv) -> None:
    """Shut the gateway down and wait for the JVM to exit (killed if it does not within 10 s)."""
    process: subprocess.Popen = simulator._gateway.java_process
    try:
        simulator.close()
    finally:
        try:
            process.wait(JVM_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(JVM_EXIT_TIMEOUT_S)


NOT_TEXT = "No known action matches that input: it is not valid text (it holds an unpaired surrogate)."


def _is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (py4j sends commands as UTF-8: a lone surrogate fails the call)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _simplifications(task: Task) -> str:
    """The task's `simplifications` param, checked against the names ScienceWorld knows."""
    value = task.params.get("simplifications", "")
    if not isinstance(value, str):
        raise EnvServiceError(ErrorCode.bad_request, f"params.simplifications={value!r} must be a comma-separated "
                              "string of simplification names", valid_choices=list(SIMPLIFICATIONS))
    names = [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in SIMPLIFICATIONS]
    if unknown:
        raise EnvServiceError(ErrorCode.bad_request,
                              f"params.simplifications={value!r} has unknown simplification(s) {unknown}",
                              valid_choices=list(SIMPLIFICATIONS))
    return ",".join(names)


class ScienceWorldTextEnv(TextEnv):
    """One ScienceWorld variation per episode; actions are ScienceWorld commands ('open door to kitchen')."""

    description = ("ScienceWorld (scienceworld 1.2.3): 30 science tasks x variations in a text simulator; "
                   "actions are commands such as 'look around', 'open door to kitchen', 'focus on water'.")
    splits = _splits()
    params = {"simplifications": Param("Comma-separated ScienceWorld simplifications, e.g. 'easy' (default: none).", str)}

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The (task, variation) pair: ScienceWorld's own content ids (a variation fixes the task's world and
        target; the package makes its train/dev/test variations different ones). `simplifications` change how
        the task is played, not which task it is."""
        return content_digest("sciworld", *parse_task_name(task.name))

    def __init__(self) -> None:
        self._sim: ScienceWorldEnv | None = start_simulator()
        self._score = 0
        self._completed = False

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Load the task's variation; the observation is the task description and the first 'look around'."""
        name, variation = parse_task_name(task.name)
        self._sim.load(name, variation, _simplifications(task))
        self._sim.server.reset()
        self._score, self._completed = 0, False
        observation = self._run("look around")
        description = self._sim.get_task_description()
        return f"{description}\n\n{observation}", {"task": name, "variation": variation, "task_description": description,
                                                    STATE_KEY: self.state_key()}

    def state_key(self) -> str:
        """The free look, the inventory and the score (module docstring)."""
        server = self._sim.server
        return content_digest("sciworld-state", self._sim.taskName, self._sim.variationIdx,
                              str(server.freeActionLook()), str(server.freeActionInventory()), self._score)

    def step(self, action: str) -> StepResult:
        """Run one command; reward is the score change / 100; the episode ends when the task does (or fails)."""
        command = action.strip()
        if not _is_utf8(command):
            return NOT_TEXT, 0.0, False, False, {"score": self._score / 100.0, "invalid": True,
                                                 STATE_KEY: self.state_key()}
        before = self._score
        observation = self._run(command)
        return (observation, (self._score - before) / 100.0, self._completed, False,
                {"score": self._score / 100.0, STATE_KEY: self.state_key()})

    def _run(self, command: str) -> str:
        """One simulator step through the JVM interface, updating score and completion.

        `ScienceWorldEnv.step` also lists every valid action after each step (most of its ~0.2 s); the
        agent does not see that list, so this calls the simulator directly.
        """
        server = self._sim.server
        observation = str(server.step(command))
        self._score = int(round(100 * server.getScore()))
        self._completed = bool(server.getCompleted()) or self._score < 0
        return observation

    def evaluate(self) -> tuple[float, bool]:
        """Score: ScienceWorld's task score scaled to [0, 1] (negative scores of failed tasks count as 0)."""
        success = self._score >= 100
        return min(1.0, max(0.0, self._score / 100.0)), success

    def gold_actions(self) -> list[str]:
        """The package's gold action sequence for the current variation; restarts its episode (an oracle)."""
        sim = self._sim
        sim.load(sim.taskName, sim.variationIdx, sim.simplificationStr, generateGoldPath=True)
        sim.server.reset()
        self._score, self._completed = 0, False
        self._run("look around")
        return sim.get_gold_action_sequence()

    def close(self) -> None:
        """Stop this instance's JVM."""
        if self._sim is not None:
            simulator, self._sim = self._sim, None
            stop_simulator(simulator)
