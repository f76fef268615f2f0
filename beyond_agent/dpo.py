"""DPO on pairs of trajectories of the same task, on verl's SFT trainer with our loss (assistant tokens only).

    python -m recipe.dpo.main data.train_files=RUN/trajectories model.path=MODEL \\
        dpo.beta=0.1 data.min_reward_margin=0.5 trainer.total_training_steps=50 trainer.default_local_dir=OUT

Why not TRL's or verl's DPO: verl 0.9 has none, and TRL's DPOTrainer scores a whole completion after a
shared prompt, so in a multi-turn episode it would train on the environment's observations between the
assistant turns. Here the loss is written once (`dpo_loss`) and everything else is verl's: the SFT trainer
(`TrajectoryDPOTrainer` subclasses `verl.trainer.sft_trainer.SFTTrainer`), its FSDP engine, checkpoints and
trackers. The program is `recipe/dpo` (its `main` and YAML); the same command trains the tiny model on CPU and a
7B model on GPUs (torchrun, as SFT's).

Pairs (`preference_pairs`): episodes of one task (env, split, task, seed) with the same first prompt; the
highest reward is paired with the lowest, the second highest with the second lowest, and so on, while the
reward gap is at least `data.min_reward_margin` (> 0). Each pair becomes two rows, chosen then rejected,
with the exact token ids and the loss mask of `training_row`.

The loss: log pi(y|x) is the sum of the policy's log-probabilities over the row's trained tokens only
(mask 1: tokens the policy wrote), the same for the reference model (the starting weights, scored once by
verl's engine before the first step), and
    loss = -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))
averaged over the pairs of the global batch. Logged: `train/dpo/accuracy` (share of pairs whose implicit
reward margin is > 0) and `train/dpo/margin`.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from beyond_agent.seams import patch
from beyond_agent.sft import dataset_files, plain_config, row_tensors
from beyond_agent.trajectories import TrajectoryRecord
from beyond_agent.trajectory_data import TrajectoryDataError, TrajectoryFilter, read_trajectories, training_row

ROW_KEYS = ("input_ids", "position_ids", "loss_mask")


def preference_pairs(records: Sequence[TrajectoryRecord], min_reward_margin: float) -> list[tuple[TrajectoryRecord, TrajectoryRecord]]:
    """(chosen, rejected) pairs of episodes of the same task and first prompt, best with worst inwards."""
    if min_reward_margin <= 0:
        raise TrajectoryDataError(f"min_reward_margin must be > 0 (a pair needs a preference); got {min_reward_margin}")
    by_task: dict[tuple, list[TrajectoryRecord]] = defaultdict(list)
    for record in records:
        by_task[(record.env, record.split, str(record.task), record.seed, tuple(record.prompt_ids))].append(record)
    pairs = []
    for episodes in by_task.values():
        ranked = sorted(episodes, key=lambda record: record.reward, reverse=True)
        for best, worst in zip(ranked[: len(ranked) // 2], reversed(ranked[len(ranked) // 2:])):
            if best.reward - worst.reward >= min_reward_margin:
                pairs.append((best, worst))
    return pairs


class TrajectoryDPODataset(Dataset):
    """Preference pairs from trajectory records, for `TrajectoryDPOTrainer` (verl's `data.custom_cls` call).

    Reads `data.trajectory_filter`, `data.min_reward_margin`, `data.max_length`, `data.truncation`. An item
    is {"chosen": row, "rejected": row}, each row a dict of `ROW_KEYS` tensors plus, once the trainer has
    scored them, `ref_log_probs` (the reference model's log-probability of each next token).
    """

    def __init__(self, parquet_files, tokenizer, config, processor=None, max_samples: int = -1):
        files = dataset_files(parquet_files)
        keep = TrajectoryFilter.from_mapping(plain_config(config.get("trajectory_filter", None)), "trajectory_filter")
        if str(config.get("pad_mode", "no_padding")) != "no_padding":
            raise TrajectoryDataError(f"data.pad_mode {config.get('pad_mode')!r}; DPO supports: no_padding")
        micro_batch = int(config.get("micro_batch_size_per_gpu", 2))
        if config.get("use_dynamic_bsz", False) or micro_batch % 2:
            # The loss pairs row 2k with row 2k + 1 of a micro batch: a pair must never be split.
            raise TrajectoryDataError("DPO keeps each pair in one micro batch: set data.use_dynamic_bsz=false and an "
                                      f"even data.micro_batch_size_per_gpu (rows; got {micro_batch})")
        margin = float(config.get("min_reward_margin", 0.5))
        self.pairs = preference_pairs(read_trajectories(files, keep), margin)
        if not self.pairs:
            raise TrajectoryDataError(f"no preference pair in {', '.join(map(str, files))}: a pair needs two episodes "
                                      f"of one task whose rewards differ by >= data.min_reward_margin ({margin})")
        if max_samples is not None and max_samples > 0:
            self.pairs = self.pairs[:max_samples]
        max_length, truncation = int(config.get("max_length", 4096)), str(config.get("truncation", "error"))
        self.rows = [[row_tensors(training_row(record, max_length, truncation)) for record in pair] for pair in self.pairs]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict[str, dict[str, torch.Tensor]]:
        chosen, rejected = self.rows[item]
        return {"chosen": chosen, "rejected": rejected}


def collate_pairs(items: list[dict]) -> dict:
    """verl's no-padding collation of the pairs' rows, interleaved: chosen 0, rejected 0, chosen 1, ..."""
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    rows = [item[side] for item in items for side in ("chosen", "rejected")]
    return SFTTensorCollator("no_padding")(rows)


def sequence_log_probs(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of log-probabilities over trained tokens. Both are nested [rows, jagged]."""
    # Position i scores token i + 1 (verl's engine): shift the mask left by one. A row's first token is
    # prompt (mask 0), so the roll never carries a trained token across rows.
    mask = torch.roll(loss_mask.values(), shifts=-1, dims=0).to(log_probs.values().dtype)
    offsets = log_probs.offsets()
    row_of_token = torch.repeat_interleave(torch.arange(len(offsets) - 1, device=offsets.device), offsets.diff())
    sums = torch.zeros(len(offsets) - 1, dtype=log_probs.values().dtype, device=offsets.device)
    return sums.index_add(0, row_of_token, log_probs.values() * mask)


def dpo_loss(config, model_output, data, dp_group=None, beta: float = 0.1):
    """verl loss-function signature; rows alternate chosen / rejected (`collate_pairs`, even micro batches)."""
    from verl.utils import tensordict_utils as tu

    policy = sequence_log_probs(model_output["log_probs"], data["loss_mask"])
    reference = sequence_log_probs(data["ref_log_probs"], data["loss_mask"])
    log_ratio = policy - reference
    margin = beta * (log_ratio[0::2] - log_ratio[1::2])  # [pairs in this micro batch]
    global_pairs = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None) or len(margin)
    # Summed over micro batches and averaged over dp ranks by FSDP: a mean over the global batch's pairs.
    loss = -F.logsigmoid(margin).sum() / global_pairs * data["dp_size"]
    return loss, {"dpo/accuracy": (margin > 0).float().mean().item(), "dpo/margin": margin.mean().item()}


def dpo_trainer_class():
    """verl's SFT trainer class with our DPO loss, pair collation and reference scoring (`recipe/dpo`'s trainer)."""
    from beyond_agent.seams.sft_trainer import SFTTrainerSeams

    class TrajectoryDPOTrainer(SFTTrainerSeams):
        """verl's SFT trainer with `dpo_loss`, pair collation and reference log-probs scored before training."""

        def after_engine_built(self) -> None:
            self.loss_fn = partial(dpo_loss, config=None, beta=float(self.config.dpo.beta))
            self.training_client.set_loss_fn(loss_fn=self.loss_fn)
            patch(self.training_client, "train_batch", _with_mean_dpo_metrics(self.training_client.train_batch))

        def after_dataloaders_built(self) -> None:
            self.collate_fn = collate_pairs
            for loader in (self.train_dataloader, self.val_dataloader):
                if loader is not None:
                    loader.collate_fn = collate_pairs

        def after_engine_initialised(self) -> None:
            for dataset in (self.train_dataset, self.val_dataset):
                if dataset is not None:
                    self._score_reference(dataset)

        def _score_reference(self, dataset: TrajectoryDPODataset) -> None:
            """ref_log_probs of every row, from the starting weights (before any step or resume)."""
            from verl.utils import tensordict_utils as tu

            rows = [row for pair in dataset.rows for row in pair]
            chunk = int(self.config.data.micro_batch_size_per_gpu)
            for start in range(0, len(rows), chunk):
                part = rows[start:start + chunk]
                batch = tu.get_tensordict(tensor_dict=_collate_rows(part), non_tensor_dict={
                    **self.engine_batch_settings(), "micro_batch_size_per_gpu": len(part), "compute_loss": False})
                output = self.training_client.infer_batch(batch)
                for row, log_probs in zip(part, tu.get(output, "log_probs").unbind()):
                    row["ref_log_probs"] = log_probs.detach().float().cpu()

        def engine_batch_settings(self) -> dict:
            """The per-batch settings the engine reads, as verl's `fit` sets them for a training batch (the keys
            of its `meta_info`, which verl gives no function of its own: a seam, `SEAMS`)."""
            return {
                "use_remove_padding": self.config.model.use_remove_padding, "use_dynamic_bsz": False,
                "max_token_len_per_gpu": self.config.data.max_token_len_per_gpu,
                "micro_batch_size_per_gpu": self.config.data.micro_batch_size_per_gpu, "temperature": 1.0,
                "global_batch_size": self.global_batch_size, "pad_mode": "no_padding",
                "pad_token_id": self.model_config.tokenizer.pad_token_id,
            }

    return TrajectoryDPOTrainer


def _with_mean_dpo_metrics(train_batch):
    """verl's train_batch, with our per-micro-batch metrics (lists) turned into one mean each, `train/dpo/*`."""
    from verl.utils import tensordict_utils as tu

    def train_batch_with_means(data):
        output = train_batch(data=data)
        metrics = tu.get(output, "metrics") if output is not None else None
        for key in [key for key in (metrics or {}) if key.startswith("dpo/")]:
            values = torch.tensor(metrics.pop(key), dtype=torch.float64).flatten()
            metrics[f"train/{key}"] = values.mean().item()
        return output

    return train_batch_with_means


def _collate_rows(rows: list[dict]) -> dict:
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    return SFTTensorCollator("no_padding")([{key: row[key] for key in ROW_KEYS} for row in rows])
