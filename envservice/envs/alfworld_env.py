"""ALFWorld's text engine (alfworld 0.4.2) on household PDDL problems generated from the package's own data.

ALFWorld's official game files (`game.tw-pddl`, made from ALFRED trajectories) need a download. This adapter
generates problems of the same six task types from what the package ships: the PDDL domain and text grammar
(`alfworld/data`), the receptacles and their navigation points of each AI2-THOR scene
(`alfworld/gen/layouts`), the object/receptacle compatibility tables and task goals (`alfworld.gen`). The
games run on the same engine as ALFWorld's TextWorld mode (TextWorld's PDDL env with ALFWorld's name
demangler), so observations and commands are ALFWorld's ('go to fridge 1', 'take apple 2 from fridge 1',
'cool apple 2 with fridge 1', 'move apple 2 to countertop 3', ...).

Official game files are used instead when `$ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}` holds
them (as `alfworld-download` leaves them): the splits are then ALFWorld's and task names are the game folders
relative to the split folder (e.g. `pick_and_place_simple-Apple-None-Fridge-1/trial_T2019...`).

A generated task `task-<i>` of a split is fixed by (split, i): the scene (train: ALFWorld's training scenes, test: its
held-out scenes), the objects and where they are, the task type, its target and the goal sentence.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import alfworld.gen.constants as constants
import alfworld.gen.goal_library as goal_library
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.envs.pddl import PddlEnv

from envservice.envs.base import STATE_KEY, StepResult, Task, TextEnv, content_digest

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
"""ALFWorld's six task types."""

APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
"""Per state-change task type: the receptacle type it needs and the object property."""

TASKS_PER_SPLIT = {"train": 10_000, "test": 1_000}
OFFICIAL_SPLITS = ("train", "valid_seen", "valid_unseen")
OFFICIAL_VERSION_DIR = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
AGENT_START = "loc|-99|-99|0|30"
"""The agent starts away from every receptacle ("in the middle of a room")."""

_PROPERTIES = {"cleanable": "Cleanable", "heatable": "Heatable", "coolable": "Coolable", "sliceable": "Sliceable",
               "toggleable": "Toggleable"}


LAMPS = ("DeskLamp", "FloorLamp")
"""Toggleable lamps of look_at_obj_in_light tasks; they stand on a receptacle that cannot be opened."""

DISTRACTOR_TYPES = 6
"""Object types placed besides the task's own (more objects make the planner-backed engine slower)."""


def _type(entity_id: str) -> str:
    """The AI2-THOR type of an id ('Cabinet|+00.68|...' -> 'Cabinet'; a sink's basin -> 'SinkBasin')."""
    parts = entity_id.split("|")
    return parts[-1] if len(parts) == 5 else parts[0]


@dataclass(frozen=True, eq=False)
class Scene:
    """One AI2-THOR scene as ALFWorld's layouts describe it."""

    number: int
    receptacles: dict[str, str]
    """Receptacle id -> navigation location (`loc|x|z|rotation|horizon`)."""
    object_types: tuple[str, ...]
    """Types of objects that can be picked up and put into one of the scene's receptacles."""
    lamps: tuple[str, ...]
    """Lamp types of the scene (when some receptacle can hold them)."""


@dataclass(frozen=True)
class Game:
    """A generated problem: the PDDL problem, the goal sentence and what the task asks for."""

    scene: int
    task_type: str
    target: str
    parent: str
    goal: str
    pddl_problem: str
    objects: tuple[tuple[str, str], ...] = ()
    """(object type, receptacle id) of every placed object, sorted: where things are, without the random
    positions in their ids (the agent sees 'apple 1', never a position)."""


def _layouts():
    return importlib.resources.files("alfworld") / "gen" / "layouts"


def _location(point: list[float]) -> str:
    return "loc|%d|%d|%d|%d" % (int(point[0] / constants.AGENT_STEP_SIZE), int(point[1] / constants.AGENT_STEP_SIZE),
                                int(point[2]), int(point[3]))


@functools.lru_cache(maxsize=None)
def load_scene(number: int) -> Scene:
    """The receptacles (with locations) and the placeable object types of scene `number`."""
    layouts = _layouts()
    points = json.loads((layouts / f"FloorPlan{number}-openable.json").read_text())
    receptacles = {rid: _location(point) for rid, point in sorted(points.items())
                   if _type(rid) in constants.VAL_RECEPTACLE_OBJECTS
                   and _type(rid) not in constants.MOVABLE_RECEPTACLES_SET}
    present = set(json.loads((layouts / f"FloorPlan{number}-objects.json").read_text()))
    hosts = {_type(rid) for rid in receptacles}
    object_types = tuple(sorted(
        t for t in present
        if t in constants.OBJECTS and (t not in constants.RECEPTACLES or t in constants.MOVABLE_RECEPTACLES_SET)
        and any(t in constants.VAL_RECEPTACLE_OBJECTS[h] for h in hosts)))
    lamps = tuple(t for t in LAMPS if t in present and hosts - constants.OPENABLE_CLASS_SET)
    return Scene(number, receptacles, object_types, lamps)


def scene_numbers(split: str) -> list[int]:
    """Scenes with a layout: ALFWorld's training scenes for 'train', its held-out ones for 'test'."""
    numbers = constants.TRAIN_SCENE_NUMBERS if split == "train" else constants.TEST_SCENE_NUMBERS
    available = {p.name for p in _layouts().iterdir()}
    return [n for n in numbers if f"FloorPlan{n}-openable.json" in available and task_candidates(load_scene(n))]


def _hosts(scene: Scene, object_type: str, exclude: str = "") -> list[str]:
    """Receptacles that may hold `object_type` (lamps: any that cannot be opened), except type `exclude`."""
    if object_type in LAMPS:
        return [r for r in scene.receptacles if _type(r) not in constants.OPENABLE_CLASS_SET]
    return [r for r in scene.receptacles
            if object_type in constants.VAL_RECEPTACLE_OBJECTS[_type(r)] and _type(r) != exclude]


@functools.lru_cache(maxsize=None)
def task_candidates(scene: Scene) -> tuple[tuple[str, str, str], ...]:
    """Every (task type, target object type, parent receptacle type or lamp type) feasible in the scene."""
    rtypes = sorted({_type(r) for r in scene.receptacles})
    candidates = []
    for task_type in TASK_TYPES:
        for target in scene.object_types:
            if task_type == "look_at_obj_in_light":
                candidates += [(task_type, target, lamp) for lamp in scene.lamps]
                continue
            appliance = APPLIANCE.get(task_type)
            if appliance and (appliance[0] not in rtypes or target not in constants.VAL_ACTION_OBJECTS[appliance[1]]):
                continue
            candidates += [(task_type, target, parent) for parent in rtypes
                           if target in constants.VAL_RECEPTACLE_OBJECTS[parent] and _hosts(scene, target, parent)]
    return tuple(candidates)


def _choose_task(scene: Scene, rng: random.Random) -> tuple[str, str, str]:
    """A task type drawn uniformly among those the scene allows, then one of its (target, parent) choices."""
    candidates = task_candidates(scene)
    task_type = rng.choice(sorted({c[0] for c in candidates}))
    return rng.choice([c for c in candidates if c[0] == task_type])


def _place_objects(scene: Scene, rng: random.Random, task_type: str, target: str, parent: str) -> dict[str, str]:
    """Object id -> receptacle id for the target (never already in a receptacle of the parent type), the
    lamp of a look-at task and a few distractor types."""
    others = [t for t in scene.object_types if t != target]
    types = [target] + rng.sample(others, min(DISTRACTOR_TYPES, len(others)))
    if task_type == "look_at_obj_in_light":
        types.append(parent)
    placed: dict[str, str] = {}
    for object_type in types:
        low = 2 if (task_type == "pick_two_obj_and_place" and object_type == target) else 1
        count = 1 if object_type in LAMPS else rng.randint(low, low + 1)
        exclude = parent if object_type == target else ""
        for _ in range(count):
            position = "%+06.2f|%+06.2f|%+06.2f" % (rng.uniform(-4, 4), rng.uniform(0, 2), rng.uniform(-4, 4))
            placed[f"{object_type}|{position}"] = rng.choice(_hosts(scene, object_type, exclude))
    return placed


def _goal_pddl(task_type: str, target: str, parent: str) -> str:
    if task_type == "look_at_obj_in_light":
        return goal_library.gdict[task_type]["pddl"].format(obj=target, toggle=parent)
    return goal_library.gdict[task_type]["pddl"].format(obj=target, recep=parent)


def _goal_sentence(rng: random.Random, task_type: str, target: str, parent: str) -> str:
    template = rng.choice(goal_library.gdict[task_type]["templates"])
    return template.format(obj=target.lower(), recep=parent.lower(), toggle=parent.lower())


def _init_facts(scene: Scene, placed: dict[str, str]) -> list[str]:
    facts = [f"(atLocation agent1 {AGENT_START})"]
    for rid, location in scene.receptacles.items():
        facts += [f"(receptacleType {rid} {_type(rid)}Type)", f"(receptacleAtLocation {rid} {location})"]
        if _type(rid) in constants.OPENABLE_CLASS_SET:
            facts.append(f"(openable {rid})")
    for oid, host in placed.items():
        facts += [f"(objectType {oid} {_type(oid)}Type)", f"(inReceptacle {oid} {host})",
                  f"(objectAtLocation {oid} {scene.receptacles[host]})", f"(pickupable {oid})"]
        facts += [f"({fact} {oid})" for fact, key in _PROPERTIES.items()
                  if _type(oid) in constants.VAL_ACTION_OBJECTS[key]]
    rtypes = sorted({_type(r) for r in scene.receptacles})
    otypes = sorted({_type(o) for o in placed})
    facts += [f"(canContain {r}Type {o}Type)" for r in rtypes for o in otypes
              if o in constants.VAL_RECEPTACLE_OBJECTS[r]]
    return facts


def _pddl_names(text: str) -> str:
    """ALFWorld's escaping of AI2-THOR ids in PDDL ('|' -> '_bar_', '-' -> '_minus_', '#' -> '-', ...)."""
    for old, new in (("-", "_minus_"), ("#", "-"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        text = text.replace(old, new)  # in this order: '-' is escaped before '#' becomes '-'
    return text


def _problem(name: str, scene: Scene, placed: dict[str, str], goal_pddl: str) -> str:
    locations = sorted(set(scene.receptacles.values()) | {AGENT_START})
    declared = (["agent1 # agent"] + [f"{o} # object" for o in placed] + [f"{r} # receptacle" for r in scene.receptacles]
                + [f"{loc} # location" for loc in locations]
                + [f"{t}Type # otype" for t in sorted({_type(o) for o in placed})]
                + [f"{t}Type # rtype" for t in sorted({_type(r) for r in scene.receptacles})])
    text = "(define (problem {})\n(:domain alfred)\n(:objects\n{}\n)\n(:init\n{}\n)\n{}".format(
        name, "\n".join(declared), "\n".join(_init_facts(scene, placed)), goal_pddl.strip())
    return _pddl_names(text)


@functools.lru_cache(maxsize=4096)
def generate_game(split: str, index: int) -> Game:
    """The game of task `index` of `split` (deterministic: the random draws are seeded by split and index)."""
    scenes = scene_numbers(split)
    scene = load_scene(scenes[index % len(scenes)])
    rng = random.Random(f"alfworld-{split}-{index}")
    task_type, target, parent = _choose_task(scene, rng)
    placed = _place_objects(scene, rng, task_type, target, parent)
    goal = _goal_sentence(rng, task_type, target, parent)
    problem = _problem(f"gen_{split}_{index}", scene, placed, _goal_pddl(task_type, target, parent))
    objects = tuple(sorted((_type(oid), host) for oid, host in placed.items()))
    return Game(scene.number, task_type, target, parent, goal, problem, objects)


def game_fingerprint(game: Game) -> str:
    """A generated game's content: the scene, what the task asks (type, target, parent) and where every object is.
    The goal sentence (one of the task type's templates) only words the same goal."""
    return content_digest("alfworld", game.scene, game.task_type, game.target, game.parent, game.objects)


@functools.lru_cache(maxsize=1)
def _domain_and_grammar() -> tuple[str, str]:
    data = importlib.resources.files("alfworld") / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


def game_data(game: Game) -> dict[str, Any]:
    """The `game.tw-pddl` content of a generated game (what ALFWorld's TextWorld env loads)."""
    domain, grammar = _domain_and_grammar()
    return {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", game.goal),
            "pddl_problem": game.pddl_problem, "solvable": True}


_TEXTWORLD_LOCK = threading.Lock()
"""Held while a game is loaded, reset or stepped: TextWorld's PDDL stack is not thread-safe. Its parser
(`textworld.envs.pddl.logic`) is one object per process, its reset runs Fast Downward's translator with `sys.stdout`
swapped for a buffer (`fast_downward.interface.CapturingStdout`), and a step derives its texts with grammars that
games of one goal share. Two at once (sessions of the service's threads; found by `python -m envservice.check
--hacks alfworld`, issue #69) failed with a parse error, a NameError in a step, or left the process's stdout
pointing at a dropped buffer. One process thus plays one ALFWorld call at a time: serve it with worker processes
(`--backend process`) for more."""


def start_game(data: dict[str, Any], policy: bool = False, facts: bool = False) -> textworld.Environment:
    """ALFWorld's TextWorld stack (PDDL env, name demangler, infos) loaded with a game; `facts`: each state also
    lists the game's true facts (for `state_key`)."""
    infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=policy, facts=facts)
    env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
    with _TEXTWORLD_LOCK:  # why: TextWorld parses the PDDL with one module-level parser (see the lock)
        env.load(data)
    return env


def reset_game(env: textworld.Environment) -> Any:
    """The game's first state (`env.reset()`), one thread at a time: the translator swaps `sys.stdout`."""
    with _TEXTWORLD_LOCK:
        return env.reset()


def state_key(state: Any) -> str:
    """The game's true facts (where the agent is, what is open, held, heated...): its state, which the observation
    ("You arrive at ...", "Nothing happens.") only describes in part (see `STATE_KEY`)."""
    return content_digest("alfworld-state", sorted(map(str, state["facts"])))


def plan(data: dict[str, Any]) -> list[str]:
    """A command sequence that solves a game, from the Fast Downward planner (an oracle; takes seconds)."""
    env = start_game(data, policy=True)
    try:
        return list(reset_game(env)["policy_commands"])
    finally:
        env.close()


def official_root() -> Path | None:
    """`$ALFWORLD_DATA/json_2.1.1` when it exists, else None."""
    data = os.environ.get("ALFWORLD_DATA")
    root = Path(data) / OFFICIAL_VERSION_DIR if data else None
    return root if root is not None and root.is_dir() else None


def _solvable(game_file: Path) -> bool:
    """ALFWorld's own filter: games whose file says `"solvable": true`."""
    try:
        return bool(json.loads(game_file.read_text()).get("solvable", False))
    except (OSError, ValueError):
        return False


def official_games() -> dict[str, list[str]] | None:
    """Official solvable games per split (folder names relative to the split), or None without them."""
    root = official_root()
    if root is None:
        return None
    games = {}
    for split in OFFICIAL_SPLITS:
        found = sorted(str(f.parent.relative_to(root / split)) for f in (root / split).glob(f"*/*/{GAME_FILE}")
                       if _solvable(f)) if (root / split).is_dir() else []
        if found:
            games[split] = found
    return games or None


def _generated_splits() -> dict[str, list[str]]:
    return {split: [f"task-{i}" for i in range(n)] for split, n in TASKS_PER_SPLIT.items()}


def load_official(task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    """(game data, info) of an official game; its grammar already holds the goal sentence."""
    data = json.loads((official_root() / task.split / task.name / GAME_FILE).read_text())
    return data, {"task_type": task.name.split("-", 1)[0], "game": task.name}


def load_generated(task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    """(game data, info) of a generated game."""
    game = generate_game(task.split, task.index)
    return game_data(game), {"task_type": game.task_type, "goal": game.goal, "scene": game.scene}


_OFFICIAL = official_games()


class AlfWorldEnv(TextEnv):
    """A household task in ALFWorld's text world; actions are ALFWorld commands (info lists the valid ones)."""

    description = ("ALFWorld text engine (alfworld 0.4.2) on " + ("official game files" if _OFFICIAL else
                   "generated household tasks of its six types") + "; actions such as 'go to fridge 1', "
                   "'open fridge 1', 'take apple 1 from fridge 1', 'heat apple 1 with microwave 1', "
                   "'move apple 1 to countertop 1', 'use desklamp 1'.")
    splits = _OFFICIAL or _generated_splits()
    official = _OFFICIAL is not None
    params: dict[str, str] = {}
    fingerprint_folds = () if official else (
        "which object of a type is numbered 1, 2, ...: their ids hold random positions the agent never sees, so the "
        "fingerprint keeps each object's type and receptacle",
        "the goal sentence's wording (one of its task type's templates, the same goal)",
    )
    """Generated games (`game_fingerprint`); an official game is its folder and folds nothing."""

    def __init__(self) -> None:
        self._env: textworld.Environment | None = None
        self._data: dict[str, Any] = {}
        """The game's data (`game_data`) since the last reset."""
        self._won = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """A generated game's content (`game_fingerprint`); an official game's folder, ALFRED's own trial id."""
        if cls.official:
            return content_digest("alfworld-official", task.name)
        return game_fingerprint(generate_game(task.split, task.index))

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Load (or generate) the task's game and start it; info names the task and lists the valid commands."""
        data, info = load_official(task) if self.official else load_generated(task)
        self.close()
        self._data = data
        self._env = start_game(data, facts=True)
        state = reset_game(self._env)
        self._won = False
        info.setdefault("goal", state.feedback.rsplit("Your task is to: ", 1)[-1].rstrip("."))
        info["admissible_commands"] = list(state["admissible_commands"])
        info[STATE_KEY] = state_key(state)
        return state.feedback, info
    def step(self, action: str) -> StepResult:
        """Run one command ('Nothing happens.' for an invalid one); reward 1 when the task is done."""
        with _TEXTWORLD_LOCK:
            state, score, done = self._env.step(action.strip())
        self._won = self._won or bool(state["won"])
        info = {"admissible_commands": list(state["admissible_commands"]), STATE_KEY: state_key(state)}
        return state.feedback, float(score), bool(done), False, info

    def gold_actions(self) -> list[str]:
        """The planner's solution of the game (`plan`: seconds)."""
        return plan(self._data)

    def evaluate(self) -> tuple[float, bool]:
        """Score 1 once the task is done, else 0."""
        return (1.0 if self._won else 0.0), self._won

    def close(self) -> None:
        """Drop the game."""
        if self._env is not None:
            self._env.close()
            self._env = None


def gold_actions(task: Task) -> list[str]:
    """The planner's solution of a task of `AlfWorldEnv` (official or generated, as the env serves them)."""
    data, _ = load_official(task) if AlfWorldEnv.official else load_generated(task)
    return plan(data)
