"""Asynchronous rollout: episodes are played while the actor trains, with a bound on their staleness.

`AsyncEpisodePool` keeps episodes running in the background, fed row by row from the training data, and
hands the trainer whole finished rows (a prompt and its n episodes: one GRPO group) when it asks for a
batch. verl's `fit()` is unchanged: the trainer wraps its dataloader (`PlayedRowLoader` in trainer.py) so
that each batch `fit()` draws is made of rows whose episodes have already finished, and the rollout
manager's `generate_sequences` returns those episodes (matched by the row key the loader wrote).

Why rows are handed over in the order they finish, not the order they were drawn: agentic episodes have a
long tail, and a synchronous step waits for its slowest episode. Here a slow row is carried over to a
later step while finished rows train now.

Versions and staleness (see rollout/versions.py): version v = the weights after training step v. The
trainer trains step s on weights s - 1, so a token sampled with version u is `s - 1 - u` versions stale.
- Admission keeps FIFO order within the bound: a row drawn now, with q rows already waiting, is trained
  `q // batch_size` steps after the next one, so rows are drawn only while that staleness is <= K
  (`max_staleness`). With K = 0 nothing is drawn while the actor trains, which is synchronous rollout.
- A row's staleness is its oldest trained token's: every row its episodes train counts (`episode_versions`: a
  gateway agent's earlier segments, a self-play game's other seats), not only each episode's last row.
- A row that finished late (carried over) can still exceed K by the time it would be trained: it is
  dropped, counted, and its env/task mix logged (dropping biases training toward short tasks; the mix
  shows by how much). A row still running is dropped as soon as one of its turns is past the bound (it can
  only get staler), so its place is drawn again at once instead of when it ends; its episodes run out
  unused.
- With dynamic sampling (rollout/dynamic_sampling.py), a finished row whose group has no learning signal is
  dropped within the step's budget, counted, and the feeder draws another row in its place.
- With `extra_rows` E, E rows more than that bound allows are in flight (over-provisioning): the first rows to
  finish fill each batch, so a step waits less for a slow or dropped row, and the extra rows that finish past the
  bound are dropped as stale (counted, like any other). It plays more episodes than it trains, and it trains the
  fast ones first even more than the FIFO hand-over does: the drop mix per task shows the bias.
- Every admitted episode is accounted for: trained, dropped (stale or without signal), in flight or ready at
  the end, or replayed after a resume: a checkpoint records the rows drawn and not trained yet with the accounting
  so far (`rows_in_play`); the resumed run counts their episodes as `replayed_after_resume` and draws those rows
  again first (their episodes start anew: the env sessions and generation in flight did not outlive the process).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.dynamic_sampling import DynamicSamplingConfig, GroupSieve, StepSignal
from beyond_agent.rollout.handler import UNVERSIONED
from beyond_agent.rollout.versions import PolicyVersionGate

OLD_LOG_PROB_SOURCES = ("behaviour", "recompute")


@dataclass(frozen=True)
class AsyncRolloutConfig:
    """`beyond_agent.async_rollout`: the bound and policies of asynchronous rollout."""

    max_staleness: int = 1
    """K: a token may be at most K policy versions older than the weights it is trained against; rows are
    drawn ahead only within this bound, and a row that finished too late for it is dropped."""
    partial_rollout: bool | str = True
    """True: an episode that spans a weight update continues on the new weights (its turns record both
    versions). False: an update waits until running episodes finish on the old weights. "token": a turn being
    generated is interrupted too and continued on the new weights, each token keeping its version
    (`rollout.versions`: verl's servers in training, vLLM servers over HTTP outside it)."""
    old_log_probs: str = "behaviour"
    """What the policy loss uses as π_old. behaviour: the log-probs the rollout sampled with (the staleness
    is then in the ratio, as M2PO and off-policy PPO expect); recompute: verl's recomputation with the
    weights before the update (a proximal policy; combine with verl's algorithm.rollout_correction)."""
    extra_rows: int = 0
    """Rows drawn beyond what the staleness bound's FIFO admission allows (over-provisioning): the first rows to
    finish fill each batch and extra rows that finish past the bound are dropped as stale. 0: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise ValueError(f"beyond_agent.async_rollout.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if not (isinstance(self.partial_rollout, bool) or self.partial_rollout == "token"):
            raise ValueError(f"beyond_agent.async_rollout.partial_rollout must be true, false or token, "
                             f"got {self.partial_rollout!r}")
        if not isinstance(self.extra_rows, int) or isinstance(self.extra_rows, bool) or self.extra_rows < 0:
            raise ValueError(f"beyond_agent.async_rollout.extra_rows must be an int >= 0, got {self.extra_rows!r}")
        if self.old_log_probs not in OLD_LOG_PROB_SOURCES:
            raise ValueError(f"beyond_agent.async_rollout.old_log_probs={self.old_log_probs!r} is not valid; "
                             f"choose one of {', '.join(OLD_LOG_PROB_SOURCES)}")


@dataclass
class PendingRow:
    """One drawn row: its key, data and the n episodes played for it."""

    key: str
    row: dict[str, Any]
    """The dataset row as the dataloader gave it (one element of each batch field)."""
    admitted_version: int
    specs: list[EpisodeSpec] = field(default_factory=list)
    futures: list[Future] = field(default_factory=list)
    oldest_sampled: int | None = None
    """The oldest policy version a turn of its episodes was sampled with so far (None: no turn seen yet, or
    turns the pool cannot see, such as a gateway agent's)."""
    finished_at: float | None = None
    sieved: bool = False
    """Finished and passed a step's dynamic-sampling sieve (it trains, whichever step takes it)."""

    @property
    def done(self) -> bool:
        """All n episodes finished."""
        return all(future.done() for future in self.futures)

    def results(self) -> list[EpisodeResult]:
        """The n results, in the order the episodes were submitted (EpisodeLoop.run never raises)."""
        return [future.result() for future in self.futures]


def trained_rows(result: EpisodeResult) -> list[EpisodeResult]:
    """Every row a result trains: a per_call agent's earlier segments, its own, and a self-play game's other seats
    (rollout.batch.segment_batch adds the others beside it)."""
    return [*result.earlier_segments, result, *result.other_seats]


def episode_versions(result: EpisodeResult, admitted_version: int) -> list[int]:
    """The policy version of each generated turn of every row the result trains; an episode with no tagged turn
    counts as admitted.

    Rule: every trained token is within the bound, so every row counts: a gateway episode's earlier segments and a
    game's other seats train beside the result's own row and may be older than it (a segment sampled before an
    update the last one came after)."""
    versions = [version for row in trained_rows(result)
                for version in (row.episode.turn_policy_versions if row.episode else []) if version is not None]
    return versions or [admitted_version]


def sampled_token_versions(result: EpisodeResult) -> np.ndarray:
    """The version of each sampled token of every row the result trains (`trained_rows`), where known."""
    versions = [row.episode.token_policy_versions for row in trained_rows(result)
                if row.episode and row.episode.token_policy_versions]
    every = np.concatenate([np.asarray(v, dtype=np.int64) for v in versions]) if versions else np.zeros(0, np.int64)
    return every[every != UNVERSIONED]


def row_staleness(row: PendingRow, trainer_version: int) -> int:
    """Versions between the row's oldest generated turn (of any row its episodes train: `episode_versions`) and the
    weights it would be trained against."""
    oldest = min(min(episode_versions(r, row.admitted_version)) for r in row.results())
    return trainer_version - oldest


@dataclass(frozen=True)
class RowsInPlay:
    """What a checkpoint keeps of the pool: the rows drawn and not trained yet (running, finished or waiting), how
    many episodes they admitted, the accounting so far and the last row key's number (a resumed run's keys go on
    from it, so no two rows of a run share a key or a sampling seed)."""

    rows: list[dict[str, Any]]
    episodes: int
    counts: dict[str, int]
    serial: int


@dataclass
class TakenBatch:
    """What `take_batch` hands over: the rows, and the metrics of this hand-over."""

    rows: list[PendingRow]
    metrics: dict[str, float]


class AsyncEpisodePool:
    """Background episodes fed from a row stream; see the module docstring.

    Args:
        rows: an endless iterator of dataset rows (dicts), drawn from a background thread.
        make_specs: row key, row -> the n EpisodeSpecs of that row (one GRPO group).
        run_episode: spec, max_rounds -> EpisodeResult (never raises; the manager's EpisodeLoop).
        max_rounds: training step -> the round limit (the RoundsConfig); rows use the step they are drawn at.
        gate: the weight-version gate shared with the trainer's weight sync.
        batch_size: rows per training step.
        settings: the staleness bound.
        concurrency: episodes running at once.
        describe: episode spec -> the label its drop is counted under (env or task name).
        total_steps: the run's last step, if known: no row is drawn that no remaining step could train.
        dynamic_sampling: which finished groups are dropped for lack of signal (default: none).
        step_signal: GiGPO's step-level test of a group (see rollout/dynamic_sampling.py); None: episode-level.
        row_task: dataset row -> its task name (dynamic sampling counts its drops per task).
    """

    def __init__(self, rows: Iterator[dict[str, Any]], make_specs: Callable[[str, dict], Sequence[EpisodeSpec]],
                 run_episode: Callable[[EpisodeSpec, int], EpisodeResult], max_rounds: Callable[[int], int],
                 gate: PolicyVersionGate, batch_size: int, settings: AsyncRolloutConfig, concurrency: int,
                 describe: Callable[[EpisodeSpec], str] = lambda spec: spec.env_id,
                 total_steps: int | None = None, dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig(),
                 step_signal: StepSignal | None = None,
                 row_task: Callable[[dict], str] = lambda row: str(row.get("data_source", "unknown"))):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._rows = rows
        self._make_specs = make_specs
        self._run_episode = run_episode
        self._max_rounds = max_rounds
        self.gate = gate
        self.batch_size = batch_size
        self.settings = settings
        self._describe = describe
        self.total_steps = total_steps
        self.dynamic_sampling = dynamic_sampling
        self.step_signal = step_signal
        self._row_task = row_task
        self._executor = ThreadPoolExecutor(max_workers=max(concurrency, 1), thread_name_prefix="async-episode")
        self._condition = threading.Condition()
        self._drawing = threading.Lock()  # held from taking a row off the stream until it is admitted
        self._waiting: deque[PendingRow] = deque()  # drawn, not yet taken (running or finished)
        self._taken_steps = 0
        self._serial = 0
        self._closed = False
        self._feed_error: BaseException | None = None
        self.counts = Counter()
        """Episodes admitted / trained / dropped_stale / dropped_no_signal, over the whole run (rows: *_rows)."""
        self._feeder = threading.Thread(target=self._feed, name="async-rollout-feeder", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, taken_steps: int = 0, resumed: RowsInPlay | None = None) -> None:
        """Start drawing rows; `taken_steps` is the number of steps already trained (a resumed run), `resumed` what its
        checkpoint recorded (the caller's row stream replays `resumed.rows` first)."""
        self._taken_steps = taken_steps
        if resumed is not None:
            self.counts.update(resumed.counts)
            # Rule: an episode in play at the checkpoint neither trained nor was dropped; its row is drawn again.
            self.counts["replayed_after_resume"] += resumed.episodes
            self.counts["replayed_after_resume_rows"] += len(resumed.rows)
            self._serial = resumed.serial
        self._feeder.start()

    def close(self) -> dict[str, int]:
        """Stop drawing rows and cancel episodes not yet started; the final accounting of every episode."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
            waiting = list(self._waiting)
        self._executor.shutdown(wait=False, cancel_futures=True)
        unfinished = sum(1 for row in waiting for future in row.futures if not future.done())
        finished = sum(1 for row in waiting for future in row.futures if future.done())
        return {**self.counts, "left_unfinished_at_end": unfinished, "left_finished_at_end": finished}

    # ---- the trainer's side --------------------------------------------------------------------

    @contextmanager
    def drawing_paused(self) -> Iterator[None]:
        """No row leaves the row stream while inside (a checkpoint records the pool and the stream together)."""
        with self._drawing:
            yield

    def rows_in_play(self) -> RowsInPlay:
        """The rows drawn and not trained yet, in the order they were drawn, and the accounting (call inside
        `drawing_paused`, between steps: the counts of a step are complete once `take_batch` returned)."""
        with self._condition:
            rows = [row.row for row in self._waiting]
            episodes = sum(len(row.futures) for row in self._waiting)
            return RowsInPlay(rows, episodes, dict(self.counts), self._serial)

    def take_batch(self, timeout_s: float | None = None) -> TakenBatch:
        """Block until `batch_size` finished rows within the staleness bound are ready; hand them over.

        The trainer is about to train step `taken_steps + 1` on weights `taken_steps`, so that is the
        version staleness is measured against.
        """
        started = time.monotonic()
        trainer_version = self._taken_steps
        dropped: list[tuple[PendingRow, int]] = []
        sieve = GroupSieve(self.dynamic_sampling, self.batch_size, self.step_signal)
        with self._condition:
            while True:
                self._raise_feed_error()
                dropped.extend(self._drop_stale_rows(trainer_version))
                self._sieve_finished_rows(sieve)
                # First finished, first trained. Rows stay in the queue until the batch is complete, so the
                # feeder's admission bound never sees a half-taken batch.
                ready = sorted((row for row in self._waiting if row.sieved), key=lambda r: r.finished_at or 0.0)
                if len(ready) >= self.batch_size:
                    taken = ready[: self.batch_size]
                    break
                if not self._condition.wait(timeout=1.0) and timeout_s and time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"fewer than {self.batch_size} finished rollout rows within {timeout_s:.0f} s")
            for row in taken:
                self._waiting.remove(row)
            self._taken_steps += 1
            carried_over = sum(1 for row in self._waiting for future in row.futures if not future.done())
            self._condition.notify_all()  # admission may draw again
        metrics = self._step_metrics(taken, dropped, trainer_version, carried_over, time.monotonic() - started)
        metrics.update(sieve.metrics())  # the run's total is async/total_dropped_no_signal
        return TakenBatch(taken, metrics)

    def _sieve_finished_rows(self, sieve: GroupSieve) -> None:
        """Offer finished rows not sieved yet, first finished first, until a batch has passed; drop those the
        sieve refuses (called with the lock held). A dropped row leaves the queue, so the feeder draws another
        in its place. Rows beyond the batch wait unsieved: the next step's sieve and budget judge them."""
        passed = sum(1 for row in self._waiting if row.sieved)
        finished = sorted((row for row in self._waiting if row.done and not row.sieved),
                          key=lambda r: r.finished_at or 0.0)
        for row in finished:
            if passed >= self.batch_size:
                return
            if sieve.offer(row.results(), self._row_task(row.row)):
                passed += 1
                row.sieved = True
                continue
            self._waiting.remove(row)
            self.counts["dropped_no_signal"] += len(row.futures)
            self.counts["dropped_no_signal_rows"] += 1
            self._condition.notify_all()

    def _drop_stale_rows(self, trainer_version: int) -> list[tuple[PendingRow, int]]:
        """Remove the rows already past the bound, finished or still running (called with the lock held)."""
        dropped = []
        for row in list(self._waiting):
            if row.done:
                staleness = row_staleness(row, trainer_version)
            elif row.oldest_sampled is not None:
                staleness = trainer_version - row.oldest_sampled  # its oldest turn can only be older, never newer
            else:
                continue
            # Rule: beyond K the stale gradient is not taken; a row only gets staler, so it is dropped as soon
            # as it is past the bound, running or not (its episodes not started yet are cancelled).
            if staleness > self.settings.max_staleness:
                self._waiting.remove(row)
                for future in row.futures:
                    future.cancel()
                dropped.append((row, staleness))
        return dropped

    def version_changed(self) -> None:
        """Tell the feeder the weights moved on (it may draw rows again)."""
        with self._condition:
            self._condition.notify_all()

    # ---- the background side --------------------------------------------------------------------

    def _allowed_waiting_rows(self) -> int:
        """Rows that may wait (drawn, not taken): as many as FIFO hand-over keeps within the bound, plus the
        extra rows of over-provisioning (module docstring)."""
        steps_ahead = self.settings.max_staleness + self.gate.version - self._taken_steps
        allowed = self.batch_size * (steps_ahead + 1)
        if self.total_steps is not None:  # rows past the last step would only be played and thrown away
            allowed = min(allowed, self.batch_size * (self.total_steps - self._taken_steps))
        # No extra row either where FIFO admission allows none: K = 0 draws nothing while the actor trains
        # (synchronous), and no row past the last step could be trained.
        return allowed + self.settings.extra_rows if allowed > 0 else 0

    def _feed(self) -> None:
        try:
            while True:
                with self._condition:
                    self._condition.wait_for(
                        lambda: self._closed or len(self._waiting) < self._allowed_waiting_rows(), timeout=1.0)
                    if self._closed:
                        return
                    if len(self._waiting) >= self._allowed_waiting_rows():
                        continue  # woke on the timeout: an update may have moved the version; look again
                    step = self._taken_steps + 1
                with self._drawing:
                    self._admit(next(self._rows), step)
        except BaseException as error:  # surfaced to the trainer at its next take_batch
            with self._condition:
                self._feed_error = error
                self._condition.notify_all()

    def _admit(self, row: dict[str, Any], step: int) -> None:
        with self._condition:
            self._serial += 1
            key = f"r{self._serial}"
            pending = PendingRow(key=key, row=row, admitted_version=self.gate.version)
            specs = self._make_specs(key, row)
            max_rounds = self._max_rounds(step)
            for spec in specs:
                future = self._executor.submit(self._play, pending, spec, max_rounds)
                future.add_done_callback(lambda _, p=pending: self._episode_finished(p))
                pending.specs.append(spec)
                pending.futures.append(future)
            self._waiting.append(pending)
            self.counts["admitted"] += len(specs)
            self.counts["admitted_rows"] += 1

    def _play(self, row: PendingRow, spec: EpisodeSpec, max_rounds: int) -> EpisodeResult:
        """One episode of a row, noting the version of each turn as it is sampled (see `_drop_stale_rows`)."""
        with self.gate.observing(lambda version: self._turn_sampled(row, version)):
            return self._run_episode(spec, max_rounds)

    def _turn_sampled(self, row: PendingRow, version: int) -> None:
        with self._condition:
            if row.oldest_sampled is None or version < row.oldest_sampled:
                row.oldest_sampled = version

    def _episode_finished(self, row: PendingRow) -> None:
        with self._condition:
            if row.finished_at is None and row.done:
                row.finished_at = time.monotonic()
            self._condition.notify_all()

    def _raise_feed_error(self) -> None:
        if self._feed_error is not None:
            raise RuntimeError(f"the async rollout stopped drawing rows: {type(self._feed_error).__name__}: "
                               f"{self._feed_error}") from self._feed_error

    # ---- metrics ---------------------------------------------------------------------------------

    def _step_metrics(self, taken: list[PendingRow], dropped: list[tuple[PendingRow, int]], trainer_version: int,
                      carried_over: int, waited_s: float) -> dict[str, float]:
        episode_staleness, turn_staleness, mixed = [], [], 0
        token_staleness_sum, sampled_tokens = 0, 0  # over every sampled token (numpy: a step holds millions)
        for row in taken:
            for result in row.results():
                versions = episode_versions(result, row.admitted_version)
                episode_staleness.append(trainer_version - min(versions))
                turn_staleness.extend(trainer_version - v for v in versions)
                mixed += len(set(versions)) > 1
                sampled = sampled_token_versions(result)
                token_staleness_sum += int((trainer_version - sampled).sum())
                sampled_tokens += sampled.size
        dropped_specs = [spec for row, _ in dropped for spec in row.specs]
        self.counts["trained"] += sum(len(row.futures) for row in taken)
        self.counts["trained_rows"] += len(taken)
        self.counts["dropped_stale"] += len(dropped_specs)
        self.counts["dropped_stale_rows"] += len(dropped)
        metrics = {
            "async/staleness_mean": _mean(episode_staleness), "async/staleness_max": float(max(episode_staleness, default=0)),
            "async/turn_staleness_mean": _mean(turn_staleness),
            "async/token_staleness_mean": token_staleness_sum / sampled_tokens if sampled_tokens else 0.0,
            "async/partial_episodes": float(mixed),
            "async/interrupted_turns": float(self.gate.take_interrupted_turns()),
            "async/carried_over_episodes": float(carried_over),
            "async/dropped_stale_episodes": float(len(dropped_specs)),
            "async/wait_for_rows_s": waited_s, "async/update_wait_s": self.gate.take_update_wait(),
            "async/policy_version": float(trainer_version),
        }
        metrics.update({f"async/dropped_stale/{label}": float(count)
                        for label, count in Counter(self._describe(spec) for spec in dropped_specs).items()})
        metrics.update({f"async/total_{name}": float(value) for name, value in self.counts.items()})
        return metrics


def _mean(values: list[int]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
