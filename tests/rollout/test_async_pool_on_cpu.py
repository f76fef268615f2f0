"""The async rollout's parts on their own: the version gate, the pool's admission bound, carry-over of slow
rows, dropping of rows past the staleness bound or without signal (dynamic sampling), and the accounting of
every episode.

Episodes here are real `EpisodeResult`s built by a scripted episode function (no LLM or env): what is under
test is the scheduling, which must not depend on what the episodes contain.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future

import pytest

from beyond_agent.rollout.async_pool import AsyncEpisodePool, AsyncRolloutConfig, PendingRow, row_staleness
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.dynamic_sampling import DynamicSamplingConfig
from beyond_agent.rollout.handler import Episode
from beyond_agent.rollout.versions import PolicyVersionGate
from beyond_agent.settings import BeyondAgentConfig

pytestmark = pytest.mark.timeout(60)


# ---- the gate -------------------------------------------------------------------------------------

def test_gate_tags_turns_and_an_update_waits_for_the_request_in_flight():
    gate = PolicyVersionGate(version=3)
    release = threading.Event()
    events = []

    def slow_generate(request_id, prompt_ids, max_tokens):
        events.append("generating")
        release.wait(5)
        return type("Turn", (), {"token_ids": [1, 2], "logprobs": [-0.1, -0.2]})()

    generate = gate.generate_fn(slow_generate)
    results = []
    request = threading.Thread(target=lambda: results.append(generate("r", [0], 2)))
    request.start()
    while not events:
        time.sleep(0.01)

    def update():
        with gate.updating(4):
            events.append("synced")

    updater = threading.Thread(target=update)
    updater.start()
    time.sleep(0.2)
    assert "synced" not in events  # the sync waits for the request in flight
    release.set()
    request.join(5)
    updater.join(5)
    assert events == ["generating", "synced"]
    assert results[0].policy_version == 3 and results[0].token_ids == [1, 2]  # sampled before the sync
    assert generate("r", [0], 2).policy_version == 4


def test_gate_blocks_new_requests_during_an_update():
    gate = PolicyVersionGate()
    inside_update = threading.Event()
    finish_update = threading.Event()
    versions = []

    def update():
        with gate.updating(1):
            inside_update.set()
            finish_update.wait(5)

    updater = threading.Thread(target=update)
    updater.start()
    inside_update.wait(5)

    def request():
        with gate.request() as version:
            versions.append(version)

    requester = threading.Thread(target=request)
    requester.start()
    time.sleep(0.2)
    assert versions == []  # held while the weights change
    finish_update.set()
    requester.join(5)
    updater.join(5)
    assert versions == [1]


def test_without_partial_rollout_an_update_waits_for_the_whole_episode():
    gate = PolicyVersionGate(partial_rollout=False)
    order = []
    episode_may_end = threading.Event()

    def episode():
        with gate.episode():
            with gate.request() as first:
                order.append(("turn", first))
            episode_may_end.wait(5)  # between turns: a partial-rollout sync could happen here
            with gate.request() as second:
                order.append(("turn", second))

    def update():
        with gate.updating(1):
            order.append(("sync", 1))

    player = threading.Thread(target=episode)
    player.start()
    while not order:
        time.sleep(0.01)
    updater = threading.Thread(target=update)
    updater.start()
    time.sleep(0.2)
    episode_may_end.set()
    player.join(5)
    updater.join(5)
    assert order == [("turn", 0), ("turn", 0), ("sync", 1)]  # both turns on the old weights


def test_with_partial_rollout_an_episode_continues_on_the_new_weights():
    gate = PolicyVersionGate(partial_rollout=True)
    with gate.episode():
        with gate.request() as first:
            pass
        with gate.updating(1):  # would deadlock if the episode were counted
            pass
        with gate.request() as second:
            pass
    assert (first, second) == (0, 1)


# ---- the pool -------------------------------------------------------------------------------------

class ScriptedEpisodes:
    """make_specs / run_episode for the pool: each row has n episodes of one LLM turn (tagged with the gate's
    version) followed by an env step whose duration is scripted by task id (or that waits for an event)."""

    def __init__(self, gate: PolicyVersionGate, n: int = 2, durations: dict[int, float] | None = None,
                 blockers: dict[int, threading.Event] | None = None, reward=lambda task_id, index: 1.0):
        self.gate, self.n, self.durations, self.blockers = gate, n, durations or {}, blockers or {}
        self.reward = reward
        self.started: list[int] = []
        self.lock = threading.Lock()

    def rows(self):
        return ({"extra_info": {"env_id": "frozenlake", "task_id": task}, "data_source": "frozenlake"}
                for task in itertools.count())

    def make_specs(self, key, row):
        return [EpisodeSpec(env_id=row["extra_info"]["env_id"], task_id=row["extra_info"]["task_id"],
                            group_id=key, index=i) for i in range(self.n)]

    def run_episode(self, spec, max_rounds):
        with self.lock:
            self.started.append(spec.task_id)
        with self.gate.request() as version:
            time.sleep(0.005)  # the LLM turn
        time.sleep(self.durations.get(spec.task_id, 0.01))  # the env step: a slow env never holds a sync
        if spec.task_id in self.blockers:
            self.blockers[spec.task_id].wait(5)
        episode = Episode(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.5],
                          termination="done", num_turns=1, turn_ends=[0], turn_policy_versions=[version])
        reward = self.reward(spec.task_id, spec.index)
        return EpisodeResult(spec=spec, episode=episode, termination="done", reward=reward, success=reward > 0,
                             rounds=1)


def make_pool(script, gate, batch_size=2, max_staleness=1, total_steps=None, dynamic_sampling=None, concurrency=8,
              **settings):
    return AsyncEpisodePool(script.rows(), script.make_specs, script.run_episode, max_rounds=lambda step: 3,
                            gate=gate, batch_size=batch_size, concurrency=concurrency, total_steps=total_steps,
                            settings=AsyncRolloutConfig(max_staleness=max_staleness, **settings),
                            dynamic_sampling=dynamic_sampling or DynamicSamplingConfig())


def train_step(gate, pool, step):
    """What the trainer does after a step: sync weights (version = step), tell the pool."""
    with gate.updating(step):
        pass
    pool.version_changed()


def wait_until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_rows_are_drawn_ahead_only_as_far_as_the_staleness_bound(max_staleness):
    gate = PolicyVersionGate()
    script = ScriptedEpisodes(gate)
    pool = make_pool(script, gate, batch_size=2, max_staleness=max_staleness)
    pool.start()
    ahead = 2 * (max_staleness + 1)  # rows: this step's batch and K more
    wait_until(lambda: pool.counts["admitted_rows"] == ahead)
    time.sleep(0.3)
    assert pool.counts["admitted_rows"] == ahead
    taken = pool.take_batch()
    # While step 1 trains (weights still version 0), a row drawn now would queue behind the K batches
    # already waiting and train at step K + 2 on weights K + 1: one version too stale. So nothing is drawn
    # until the sync; then exactly one batch more.
    time.sleep(0.3)
    assert pool.counts["admitted_rows"] == ahead
    train_step(gate, pool, 1)
    wait_until(lambda: pool.counts["admitted_rows"] == ahead + 2)
    assert len(taken.rows) == 2 and taken.metrics["async/staleness_max"] == 0
    pool.close()


def test_extra_rows_are_drawn_beyond_the_bound_and_the_first_finished_fill_the_batch():
    gate = PolicyVersionGate()
    release = threading.Event()
    script = ScriptedEpisodes(gate, blockers={0: release})  # task 0: the first row drawn, its env hangs
    pool = make_pool(script, gate, batch_size=1, max_staleness=1, extra_rows=2)
    pool.start()
    wait_until(lambda: pool.counts["admitted_rows"] == 1 * (1 + 1) + 2)  # the bound's 2 rows and 2 extra
    time.sleep(0.3)
    assert pool.counts["admitted_rows"] == 4
    taken = [pool.take_batch()]
    train_step(gate, pool, 1)
    taken.append(pool.take_batch())
    train_step(gate, pool, 2)
    # Steps 1-2 trained two of tasks 1-3 without waiting for task 0; after each take one row more was drawn.
    first_two = [batch.rows[0].row["extra_info"]["task_id"] for batch in taken]
    assert len(set(first_two)) == 2 and set(first_two) <= {1, 2, 3}
    wait_until(lambda: pool.counts["admitted_rows"] == 6)
    release.set()
    wait_until(lambda: all(f.done() for row in list(pool._waiting) for f in row.futures))
    third = pool.take_batch()  # against version 2: the rows sampled at version 0 are 2 > 1 versions stale
    # The price of the extra rows: task 0 and the third of tasks 1-3 (both version 0) are dropped, counted.
    assert third.rows[0].row["extra_info"]["task_id"] in (4, 5)  # drawn after the first sync
    assert third.metrics["async/dropped_stale_episodes"] == 4
    accounting = pool.close()
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])


def test_extra_rows_are_not_drawn_past_the_last_step_or_while_a_synchronous_step_trains():
    gate = PolicyVersionGate()
    script = ScriptedEpisodes(gate)
    pool = make_pool(script, gate, batch_size=2, max_staleness=0, total_steps=2, extra_rows=1)
    pool.start()
    wait_until(lambda: pool.counts["admitted_rows"] == 3)  # K = 0: this step's 2 rows and 1 extra
    pool.take_batch()
    time.sleep(0.3)  # step 1 trains on weights 0: K = 0 draws nothing meanwhile, extra rows included
    assert pool.counts["admitted_rows"] == 3
    train_step(gate, pool, 1)
    wait_until(lambda: pool.counts["admitted_rows"] == 5)  # the extra row still waits: 2 + 1 allowed, 2 drawn
    wait_until(lambda: all(f.done() for row in list(pool._waiting) for f in row.futures))
    second = pool.take_batch()
    # The extra row sampled by version 0 is stale for step 2 (K = 0): dropped; the batch is the two new rows.
    assert second.metrics["async/dropped_stale_episodes"] == 2 and second.metrics["async/staleness_max"] == 0
    train_step(gate, pool, 2)
    time.sleep(0.3)  # the last step is trained: nothing more is drawn, extra rows included
    accounting = pool.close()
    assert accounting["admitted_rows"] == 5 and accounting["trained_rows"] == 4
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])


def test_no_row_is_drawn_that_no_remaining_step_could_train():
    gate = PolicyVersionGate()
    script = ScriptedEpisodes(gate)
    pool = make_pool(script, gate, batch_size=2, max_staleness=3, total_steps=2)
    pool.start()
    wait_until(lambda: pool.counts["admitted_rows"] == 4)
    pool.take_batch()
    train_step(gate, pool, 1)
    pool.take_batch()
    train_step(gate, pool, 2)
    time.sleep(0.3)
    accounting = pool.close()
    assert accounting["admitted_rows"] == 4 and accounting["trained_rows"] == 4  # K = 3 alone would allow 8
    assert accounting["left_finished_at_end"] == accounting["left_unfinished_at_end"] == 0


def test_a_slow_row_is_carried_over_and_finished_rows_train_first():
    gate = PolicyVersionGate()
    script = ScriptedEpisodes(gate, durations={0: 0.6})  # row of task 0 is the long tail
    pool = make_pool(script, gate, batch_size=2, max_staleness=2)
    pool.start()
    first = pool.take_batch()
    first_tasks = [row.row["extra_info"]["task_id"] for row in first.rows]
    assert len(first_tasks) == 2 and 0 not in first_tasks  # not held by task 0: rows drawn after it trained first
    assert first.metrics["async/carried_over_episodes"] >= 2  # task 0's two episodes were still running
    time.sleep(0.8)  # step 1 trains meanwhile; task 0 finishes, after the rows of steps 2 and 3 did
    for step in (1, 2):
        train_step(gate, pool, step)
        batch = pool.take_batch()
        if 0 in [row.row["extra_info"]["task_id"] for row in batch.rows]:
            break
    else:
        pytest.fail("the slow row never trained")
    # Sampled by version 0, trained at step 2 or 3 against version 1 or 2: within the bound, and visible.
    assert batch.metrics["async/staleness_max"] == step
    assert batch.metrics["async/dropped_stale_episodes"] == 0
    pool.close()


def test_a_row_that_finished_past_the_bound_is_dropped_counted_and_labelled():
    gate = PolicyVersionGate()
    release = threading.Event()
    script = ScriptedEpisodes(gate, blockers={0: release})  # task 0: sampled at version 0, env hangs
    pool = make_pool(script, gate, batch_size=1, max_staleness=1)
    pool.start()
    pool.take_batch()  # step 1: task 1
    train_step(gate, pool, 1)
    pool.take_batch()  # step 2: task 2
    train_step(gate, pool, 2)
    release.set()
    wait_until(lambda: all(f.done() for row in list(pool._waiting) for f in row.futures))
    third = pool.take_batch()  # step 3 trains against version 2: task 0 is 2 > 1 versions stale
    assert [row.row["extra_info"]["task_id"] for row in third.rows] != [0]
    assert third.metrics["async/dropped_stale_episodes"] == 2
    assert third.metrics["async/dropped_stale/frozenlake"] == 2  # labelled (here: by env id)
    assert third.metrics["async/staleness_max"] <= 1
    accounting = pool.close()
    assert accounting["dropped_stale"] == 2 and accounting["trained"] == 6
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])


def test_a_running_row_past_the_bound_is_dropped_at_once_and_its_place_drawn_again():
    gate = PolicyVersionGate()
    release = threading.Event()
    script = ScriptedEpisodes(gate, blockers={0: release})  # task 0: its turn sampled by version 0, then its env hangs
    pool = make_pool(script, gate, batch_size=1, max_staleness=1)
    pool.start()
    for step in (1, 2):  # tasks 1 and 2 train; task 0, one version stale at step 2, is within the bound
        assert pool.take_batch().metrics["async/dropped_stale_episodes"] == 0
        train_step(gate, pool, step)
    third = pool.take_batch()  # against version 2: task 0 is 2 > 1 versions stale, and still running
    assert not release.is_set()
    assert third.metrics["async/dropped_stale_episodes"] == 2 and third.metrics["async/dropped_stale/frozenlake"] == 2
    assert third.metrics["async/staleness_max"] <= 1
    # While step 3 trains one row may wait (K = 1); task 0 no longer holds that place, so task 4 is drawn now,
    # not after task 0 ends.
    wait_until(lambda: pool.counts["admitted_rows"] == 5)
    assert sorted(script.started) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    release.set()
    accounting = pool.close()
    assert accounting["dropped_stale"] == 2 and accounting["trained"] == 6
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])


def test_the_gate_tells_an_observer_the_version_of_its_own_threads_requests_only():
    gate = PolicyVersionGate(version=3)
    seen = []

    def request():
        with gate.request():
            pass

    with gate.observing(seen.append):
        request()
        other = threading.Thread(target=request)  # another thread's request: not told
        other.start()
        other.join()
        with gate.updating(4):
            pass
        request()
    request()  # outside `observing`: not told
    assert seen == [3, 4]


def test_row_staleness_counts_from_the_oldest_turn():
    gate = PolicyVersionGate(version=5)
    script = ScriptedEpisodes(gate)
    pool = make_pool(script, gate, batch_size=1, max_staleness=3)
    pool.start()
    row = pool.take_batch().rows[0]
    row.results()[1].episode.turn_policy_versions = [3, 5]  # a partial rollout: first turn on version 3
    assert row_staleness(row, 6) == 3
    pool.close()


def one_turn(version: int, seat: int | None = None) -> EpisodeResult:
    """A row an episode trains, with one turn sampled by weights `version`."""
    episode = Episode(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.5],
                      termination="done", num_turns=1, turn_ends=[0], turn_policy_versions=[version],
                      token_policy_versions=[version])
    return EpisodeResult(spec=EpisodeSpec(env_id="tictactoe", seat=seat), episode=episode, termination="done")


def finished_row(*results: EpisodeResult) -> PendingRow:
    row = PendingRow(key="r1", row={}, admitted_version=0)
    for result in results:
        row.futures.append(Future())
        row.futures[-1].set_result(result)
    return row


def test_row_staleness_counts_every_segment_and_every_seat():
    """#69: a per_call episode whose last row was sampled by version 5 and its earlier segment by 1, and a self-play
    game whose seat 0 played on version 5 and seat 1 (trained beside it) on 2: trained against version 5 they are 4
    and 3 versions stale, not 0."""
    segmented = one_turn(5)
    segmented.earlier_segments = [one_turn(1)]
    game = one_turn(5, seat=0)
    game.other_seats = [one_turn(2, seat=1)]
    assert row_staleness(finished_row(segmented), 5) == 4
    assert row_staleness(finished_row(game), 5) == 3
    assert row_staleness(finished_row(one_turn(5), game), 5) == 3


class GatewayEpisodes(ScriptedEpisodes):
    """Rows of per_call agent episodes of two segments. The gateway serves an agent's calls, so the pool never sees
    their versions while the episode runs (no `gate.request` in its thread): each call reads the gate's version, as
    the gateway tags a turn. A blocked task's agent waits for its event between its two segments."""

    def run_episode(self, spec, max_rounds):
        first = self.gate.version
        if spec.task_id in self.blockers:
            self.blockers[spec.task_id].wait(5)
        result = one_turn(self.gate.version)
        result.spec, result.earlier_segments = spec, [one_turn(first)]
        result.reward, result.success = 1.0, True
        return result


@pytest.mark.parametrize("max_staleness", [1, 4])
def test_an_earlier_segment_past_the_bound_drops_its_row(max_staleness):
    """Task 0's first segment is sampled by version 0; its agent then waits while steps 1-4 train tasks 1-4, and its
    last segment is sampled by version 4. Step 5 trains against version 4: the row's oldest trained token is 4
    versions stale. K = 1: dropped (#69: it was trained, judged by its last segment alone, 0 stale). K = 4: trained,
    its staleness 4 in the metrics (each episode's turns 4 and 0 stale: turn mean 2)."""
    gate = PolicyVersionGate()
    release = threading.Event()
    script = GatewayEpisodes(gate, blockers={0: release})
    pool = make_pool(script, gate, batch_size=1, max_staleness=max_staleness, total_steps=5)
    pool.start()
    taken = []
    for step in (1, 2, 3, 4):  # the first rows to finish fill each batch: on a loaded machine 4 may beat 3
        taken += [row.row["extra_info"]["task_id"] for row in pool.take_batch(timeout_s=10).rows]
        train_step(gate, pool, step)
    assert sorted(taken) == [1, 2, 3, 4]  # task 0 waits for its release meanwhile
    release.set()
    wait_until(lambda: all(f.done() for row in list(pool._waiting) for f in row.futures))
    fifth = pool.take_batch(timeout_s=10)
    if max_staleness == 1:
        assert fifth.metrics["async/dropped_stale_episodes"] == 2
        assert [row.row["extra_info"]["task_id"] for row in fifth.rows] == [5]
        assert fifth.metrics["async/staleness_max"] == 0.0
    else:
        assert fifth.metrics["async/dropped_stale_episodes"] == 0
        assert [row.row["extra_info"]["task_id"] for row in fifth.rows] == [0]
        assert fifth.metrics["async/staleness_max"] == 4.0 and fifth.metrics["async/turn_staleness_mean"] == 2.0
        # Each episode's two segments, one token each, sampled 4 and 0 versions back: every trained token counts.
        assert fifth.metrics["async/token_staleness_mean"] == 2.0
        assert fifth.metrics["async/partial_episodes"] == 2.0
    pool.close()


def test_groups_without_signal_are_dropped_and_replaced_within_the_budget():
    gate = PolicyVersionGate()
    # Tasks 0-5 are solved by both episodes (no signal); from task 6 on, one episode of two wins.
    script = ScriptedEpisodes(gate, reward=lambda task, index: 1.0 if task < 6 or index == 0 else 0.0)
    # One episode at a time: rows finish in the order they were drawn, so which ones are dropped is fixed.
    pool = make_pool(script, gate, batch_size=2, max_staleness=0, concurrency=1,
                     dynamic_sampling=DynamicSamplingConfig(drop="zero_variance", max_extra_batches=2.0))
    pool.start()
    first = pool.take_batch()
    # The budget is 4 groups a step: tasks 0-3 are dropped, 4 and 5 train without signal.
    assert sorted(row.row["extra_info"]["task_id"] for row in first.rows) == [4, 5]
    assert first.metrics["dynamic_sampling/dropped_groups"] == 4.0
    assert first.metrics["dynamic_sampling/extra_episodes"] == 8.0
    assert first.metrics["dynamic_sampling/kept_without_signal_groups"] == 2.0
    assert first.metrics["dynamic_sampling/dropped/frozenlake"] == 4.0
    train_step(gate, pool, 1)
    second = pool.take_batch()
    assert sorted(row.row["extra_info"]["task_id"] for row in second.rows) == [6, 7]  # signal: nothing dropped
    assert second.metrics["dynamic_sampling/dropped_groups"] == 0.0
    assert second.metrics["async/total_dropped_no_signal"] == 8.0
    accounting = pool.close()
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_no_signal"]
                                      + accounting["dropped_stale"] + accounting["left_unfinished_at_end"]
                                      + accounting["left_finished_at_end"])


# ---- settings -------------------------------------------------------------------------------------

def config(**beyond_agent):
    return {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}, **beyond_agent},
            "data": {"max_prompt_length": 256, "max_response_length": 256},
            "actor_rollout_ref": {"rollout": {"temperature": 1.0, "free_cache_engine": False}}}


def test_async_settings_are_read_and_bad_values_are_named():
    settings = BeyondAgentConfig.from_config(config(rollout_mode="async", async_rollout={"max_staleness": 4}))
    assert settings.is_async and settings.async_rollout.max_staleness == 4
    assert settings.async_rollout.old_log_probs == "behaviour" and settings.async_rollout.partial_rollout
    with pytest.raises(ValueError, match=r"rollout_mode='later' is not valid; choose one of sync, async"):
        BeyondAgentConfig.from_config(config(rollout_mode="later"))
    with pytest.raises(ValueError, match=r"async_rollout has unknown key\(s\) \['staleness'\]; valid keys: max_staleness"):
        BeyondAgentConfig.from_config(config(async_rollout={"staleness": 2}))
    with pytest.raises(ValueError, match=r"old_log_probs='proximal' is not valid; choose one of behaviour, recompute"):
        BeyondAgentConfig.from_config(config(async_rollout={"old_log_probs": "proximal"}))
    assert BeyondAgentConfig.from_config(config(async_rollout={"extra_rows": 3})).async_rollout.extra_rows == 3
    with pytest.raises(ValueError, match=r"extra_rows must be an int >= 0, got -1"):
        BeyondAgentConfig.from_config(config(async_rollout={"extra_rows": -1}))
    with pytest.raises(ValueError, match=r"max_staleness must be an int >= 0"):
        BeyondAgentConfig.from_config(config(async_rollout={"max_staleness": -1}))
    sleeping = config(rollout_mode="async")
    sleeping["actor_rollout_ref"]["rollout"]["free_cache_engine"] = True
    with pytest.raises(ValueError, match=r"needs actor_rollout_ref.rollout.free_cache_engine=false"):
        BeyondAgentConfig.from_config(sleeping)
