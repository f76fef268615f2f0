"""Nothing lost at a checkpoint or a resume (issue #72): the training rows in play when verl writes a checkpoint are
recorded in its data.pt (through `PlayedRowLoader.state_dict`, which verl calls), and a resumed run counts their
episodes and draws those rows again first; the accounting (admitted = trained + dropped + replayed + left) holds
across the resume.

Real parts: torchdata's `StatefulDataLoader` with a seeded `RandomSampler` and verl's `collate_fn`, as verl builds
its train dataloader; `torch.save` / `torch.load(weights_only=False)` of the state, as verl's `_save_checkpoint` and
`_load_checkpoint` do; the real `AsyncEpisodePool`, `RowStream` and `PlayedRowLoader`. Episodes are scripted (no LLM
or env), as in test_async_pool_on_cpu.py: what is under test is which rows are played, trained and counted. The
trainer's side of a checkpoint inside a real training run: tests/trainer/test_train_cpu_on_cpu.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torchdata.stateful_dataloader.sampler import RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from verl.utils.dataset.rl_dataset import collate_fn

from beyond_agent.rollout.async_pool import AsyncEpisodePool, AsyncRolloutConfig
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.handler import Episode
from beyond_agent.rollout.row_stream import RowStream
from beyond_agent.rollout.versions import PolicyVersionGate
from beyond_agent.training import ROWS_IN_PLAY_FORMAT, PlayedRowLoader, resumed_checkpoint_folder

pytestmark = pytest.mark.timeout(60)

ROWS, BATCH, SAMPLES = 12, 2, 2


def task_rows(count: int = ROWS) -> list[dict]:
    """Dataset items shaped as verl's RLHFDataset gives them: tensors and plain objects."""
    return [{"input_ids": torch.full((4,), task), "extra_info": {"env_id": "frozenlake", "task_id": task},
             "data_source": "frozenlake"} for task in range(count)]


def train_loader(seed: int = 7) -> StatefulDataLoader:
    """verl's train dataloader as `_create_dataloader` builds it: torchdata's stateful RandomSampler with a seeded
    generator (`create_rl_sampler`), verl's collate."""
    dataset = task_rows()
    return StatefulDataLoader(dataset, batch_size=BATCH, drop_last=True, collate_fn=collate_fn,
                              sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)))


def task_of(row: dict) -> int:
    return int(row["extra_info"]["task_id"])


def test_the_stream_goes_on_epoch_after_epoch_and_restores_to_the_row(tmp_path):
    """Drawn one by one across an epoch's end; a position recorded mid-batch, restored into a fresh loader with the
    unread rows replayed, draws exactly the rows the first stream would have drawn next."""
    stream = RowStream(train_loader())
    first = [task_of(next(stream)) for _ in range(ROWS + 3)]  # the whole first epoch and 3 rows of the second
    assert sorted(first[:ROWS]) == list(range(ROWS)) and len(set(first[ROWS:])) == 3
    position, unread = stream.read_position()
    assert len(unread) == 1  # the 3rd row drawn of epoch 2 was the first of a batch of 2: its partner is unread
    ahead = [task_of(next(stream)) for _ in range(ROWS + 4)]

    restored = train_loader()
    torch.save(position, tmp_path / "data.pt")
    restored.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=False))
    resumed = RowStream(restored)
    resumed.replay(unread)
    assert [task_of(next(resumed)) for _ in range(ROWS + 4)] == ahead
    # A tensor field of a row is its own copy, not a view of the batch (a checkpoint would save the whole batch).
    assert unread[0]["input_ids"].untyped_storage().nbytes() == 4 * 8


def test_an_exhausted_position_restored_starts_the_next_epoch():
    """verl skips data.pt at an epoch boundary (it assumes the loader exhausted); ours restores it all the same: the
    restored stream draws the next epoch, as the first stream does."""
    stream = RowStream(train_loader())
    [next(stream) for _ in range(ROWS)]  # the whole first epoch
    position, unread = stream.read_position()
    assert unread == []
    ahead = [task_of(next(stream)) for _ in range(ROWS)]
    assert sorted(ahead) == list(range(ROWS))
    restored = train_loader()
    restored.load_state_dict(position)
    resumed = RowStream(restored)
    assert [task_of(next(resumed)) for _ in range(ROWS)] == ahead


def test_an_empty_dataloader_is_named():
    empty = StatefulDataLoader(task_rows(1), batch_size=BATCH, drop_last=True, collate_fn=collate_fn)
    with pytest.raises(RuntimeError, match=r"yields no batch.*data.train_batch_size"):
        next(RowStream(empty))


class ScriptedRun:
    """The rollout manager's side of `PlayedRowLoader` over a real `AsyncEpisodePool` (as the manager's own
    `_start_async` builds it, with scripted episodes instead of an LLM and envservice: one turn tagged with the
    gate's version, then an env step that waits while its task is held)."""

    def __init__(self, gate: PolicyVersionGate, held: set[int], max_staleness: int = 1):
        self.gate, self.held, self.max_staleness = gate, held, max_staleness
        self.release = threading.Event()
        self.admitted: list[int] = []  # task ids of the rows admitted, in order
        self.pool: AsyncEpisodePool | None = None

    def start_rows(self, rows, batch_size, samples_per_row, trained_steps, total_steps=None, resumed=None):
        self.pool = AsyncEpisodePool(rows, self.make_specs, self.run_episode, max_rounds=lambda step: 3,
                                     gate=self.gate, batch_size=batch_size, concurrency=8, total_steps=total_steps,
                                     settings=AsyncRolloutConfig(max_staleness=self.max_staleness))
        self.pool.start(trained_steps, resumed)

    def take_rows(self):
        return self.pool.take_batch(timeout_s=10).rows

    def drawing_paused(self):
        return self.pool.drawing_paused()

    def rows_in_play(self):
        return self.pool.rows_in_play()

    def make_specs(self, key, row):
        self.admitted.append(task_of(row))
        return [EpisodeSpec(env_id="frozenlake", task_id=task_of(row), group_id=key, index=i) for i in range(SAMPLES)]

    def run_episode(self, spec, max_rounds):
        with self.gate.request() as version:
            time.sleep(0.005)
        if spec.task_id in self.held:
            self.release.wait(5)
        episode = Episode(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.5],
                          termination="done", num_turns=1, turn_ends=[0], turn_policy_versions=[version])
        return EpisodeResult(spec=spec, episode=episode, termination="done", reward=1.0, success=True, rounds=1)


def trainer(run: ScriptedRun, global_steps: int, total_steps: int) -> SimpleNamespace:
    """The attributes of verl's trainer that `PlayedRowLoader` reads (`global_steps` as fit() has it inside a step)."""
    config = OmegaConf.create({"data": {"train_batch_size": BATCH}, "actor_rollout_ref": {"rollout": {"n": SAMPLES}}})
    return SimpleNamespace(async_rollout_manager=run, config=config, global_steps=global_steps,
                           total_training_steps=total_steps)


def trained_tasks(batch: dict) -> list[int]:
    return [int(info["task_id"]) for info in batch["extra_info"]]


def sync(run: ScriptedRun, version: int) -> None:
    with run.gate.updating(version):
        pass
    run.pool.version_changed()


def test_rows_in_play_at_a_checkpoint_are_replayed_and_the_accounting_holds_across_the_resume(tmp_path):
    """Run A trains step 1 with staleness bound 1 (4 rows drawn: this step's 2 and the next step's 2); the first task
    drawn is held in its env, so step 1 trains two others and at the checkpoint (after step 1, as verl writes it) 2
    rows are in play. Run B resumes from the checkpoint: those 2 rows are played again first, every row of the
    epoch trains exactly once over the two runs, and admitted = trained + dropped + replayed + left."""
    probe = RowStream(train_loader())
    held_task = task_of(next(probe))  # the first row the seeded shuffle draws
    run_a = ScriptedRun(PolicyVersionGate(), held={held_task})
    loader_a = PlayedRowLoader(train_loader(), trainer(run_a, global_steps=1, total_steps=6))
    batches_a = iter(loader_a)
    step_1 = trained_tasks(next(batches_a))
    assert held_task not in step_1
    state = loader_a.state_dict()  # what verl's _save_checkpoint writes as data.pt after step 1
    accounting_a = run_a.pool.close()
    run_a.release.set()
    path = tmp_path / "data.pt"
    torch.save(state, path)

    assert state["format"] == ROWS_IN_PLAY_FORMAT
    in_play = state["in_play"]
    assert len(in_play["rows"]) == 2 and held_task in [task_of(row) for row in in_play["rows"]]
    assert in_play["episodes"] == 2 * SAMPLES and in_play["serial"] == 4
    counts = in_play["counts"]
    assert counts["admitted"] == counts["trained"] + in_play["episodes"] == 4 * SAMPLES  # nothing dropped yet

    run_b = ScriptedRun(PolicyVersionGate(version=1), held=set())
    loader_b = PlayedRowLoader(train_loader(), trainer(run_b, global_steps=2, total_steps=6))
    loader_b.load_state_dict(torch.load(path, weights_only=False))  # verl's _load_checkpoint
    assert loader_b.restored
    batches_b = iter(loader_b)
    trained_b = []
    for step in range(2, 7):
        trained_b += trained_tasks(next(batches_b))
        sync(run_b, step)
    accounting_b = run_b.pool.close()

    replayed = [task_of(row) for row in in_play["rows"]]
    assert run_b.admitted[:2] == replayed  # the rows in play are drawn again first, in their order
    assert sorted(step_1 + trained_b) == list(range(ROWS))  # 6 steps of 2: the epoch, each row once, none lost
    assert accounting_b["replayed_after_resume"] == 2 * SAMPLES and accounting_b["replayed_after_resume_rows"] == 2
    assert accounting_b["trained"] == ROWS * SAMPLES
    assert accounting_b["admitted"] == (accounting_b["trained"] + accounting_b["replayed_after_resume"]
                                        + accounting_b.get("dropped_stale", 0) + accounting_b.get("dropped_no_signal", 0)
                                        + accounting_b["left_unfinished_at_end"] + accounting_b["left_finished_at_end"])
    # Run A alone would have lost them: its own accounting ends with them left in play, not trained.
    assert accounting_a["left_unfinished_at_end"] + accounting_a["left_finished_at_end"] == 2 * SAMPLES


def test_a_plain_dataloader_state_still_loads():
    """A data.pt from before the record (or from a run without the played-row loader): the loader's state alone."""
    stream = RowStream(train_loader())
    [next(stream) for _ in range(4)]
    position, _ = stream.read_position()
    run = ScriptedRun(PolicyVersionGate(), held=set())
    loader = PlayedRowLoader(train_loader(), trainer(run, global_steps=3, total_steps=6))
    loader.load_state_dict(position)
    assert loader.restored
    assert loader.state_dict()["loader"] == position


def test_the_resumed_folder_is_the_one_verl_reads():
    config = OmegaConf.create({"resume_mode": "auto", "default_local_dir": "ckpts", "resume_from_path": None})
    assert resumed_checkpoint_folder(config, 4) == (Path.cwd() / "ckpts" / "global_step_4")
    config.resume_mode, config.resume_from_path = "resume_path", "/runs/a/global_step_2"
    assert resumed_checkpoint_folder(config, 2) == Path("/runs/a/global_step_2")
