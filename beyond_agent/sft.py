"""Supervised fine-tuning on trajectory records, through verl's own SFT trainer (verl.trainer.sft_trainer).

The program is the `recipe/sft` recipe (its `main` and YAML):

    python -m recipe.sft.main data.train_files=RUN/trajectories model.path=MODEL \\
        +data.trajectory_filter.success=true trainer.total_training_steps=100 trainer.default_local_dir=OUT

This module holds what that program, `recipe/dpo` and the explore -> SFT loops (AgentEvol, Agent-R) share.
Everything is verl's (FSDP engine, its `sft_loss`, checkpointing, trackers) except the dataset:
`TrajectorySFTDataset` (named in the config as verl's `data.custom_cls`) reads our `TrajectoryRecord` files
and hands verl each episode's exact token ids with a loss mask that is 1 only on tokens the policy wrote.
`data.train_files` / `data.val_files` name .jsonl files or folders of them (a run's `trajectories/`).

verl's trainer is an SPMD program started by torchrun: `sft_command` / `run_sft` start torchrun (one process per
`trainer.n_gpus_per_node`) running the program, and on a machine without CUDA add the CPU settings
(`SFT_CPU_OVERRIDES` below) so the tiny model trains on CPU with the same command.
Per-step metrics (`train/loss`, ...) go to `<default_local_dir>/metrics.jsonl` (verl's `file` tracker).
The trained model is written in Hugging Face format under `<default_local_dir>/global_step_<N>/huggingface`
(config `checkpoint.save_contents` includes `hf_model`); `hf_model_dir(folder)` finds the latest.
LoRA: `model.lora_rank=8 model.lora_alpha=16` trains an adapter (verl's own LoRA path); `hf_model_dir` then hands
on the adapter merged into the base (exported once by `beyond_agent.export`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import Dataset

from beyond_agent.child_log import run_logged
from beyond_agent.cli_args import DRY_RUN_MARKER, is_dry_run
from beyond_agent.export import MERGED_FOLDER, export_checkpoint
from beyond_agent.trajectory_data import (
    TrajectoryDataError,
    TrajectoryFilter,
    read_trajectories,
    training_row,
    trajectory_files,
)
from verl_cpu.overrides import FP32_MIXED_PRECISION

SFT_CPU_OVERRIDES: tuple[tuple[str, str], ...] = (
    ("trainer.device=cpu", "no accelerator"),
    ("engine.strategy=fsdp2", "FSDP1 cannot run without an accelerator"),
    ("+model.override_config.attn_implementation=sdpa", "verl defaults to flash-attn"),
    ("model.use_remove_padding=false", "remove-padding needs flash-attn varlen kernels"),
    ("engine.use_torch_compile=false", "compiling on 2 cores costs more than it saves"),
    ("data.num_workers=0", "dataloader worker processes only add memory on 2 cores"),
    (f"+engine.mixed_precision={FP32_MIXED_PRECISION}",
     "verl's engine computes in bf16 unless told otherwise: a CPU without bf16 units runs it slower, and in bf16 the "
     "tiny model did not learn to read its FrozenLake maps (the learning bench's warm-up, measured)"),
)
"""(override, why): verl's SFT config on a CPU-only machine (the PPO ones are in verl_cpu/overrides.py)."""
LORA_EXPORT_FOLDER = "lora_export"
"""Where `hf_model_dir` exports a LoRA checkpoint (inside its `global_step_<N>` folder)."""
SFT_CPU_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "TOKENIZERS_PARALLELISM": "false"}
"""VERL_PLATFORM selects verl_cpu's platform; verl registers its FSDP engines for cuda/npu only, and they run
on CPU tensors all the same."""


class TrajectorySFTDataset(Dataset):
    """verl SFT dataset (`data.custom_cls`) over trajectory records: one row per episode the filter keeps.

    Called by verl as `cls(parquet_files=..., tokenizer=..., config=data_config, processor=..., max_samples=...)`;
    `parquet_files` are our .jsonl files or folders. Reads `data.trajectory_filter` (TrajectoryFilter's
    fields), `data.max_length`, `data.truncation` and `data.pad_mode` (verl's `no_padding` or `right`).
    """

    def __init__(self, parquet_files, tokenizer, config, processor=None, max_samples: int = -1):
        files = dataset_files(parquet_files)
        keep = TrajectoryFilter.from_mapping(plain_config(config.get("trajectory_filter", None)), "trajectory_filter")
        records = read_trajectories(files, keep)
        if not records:
            raise TrajectoryDataError(f"no episode in {', '.join(map(str, files))} passes the filter {keep}")
        if max_samples is not None and max_samples > 0:
            records = records[:max_samples]
        self.max_length = int(config.get("max_length", 1024))
        self.truncation = str(config.get("truncation", "error"))
        self.pad_mode = str(config.get("pad_mode", "no_padding"))
        if self.pad_mode not in ("no_padding", "right"):
            raise TrajectoryDataError(f"data.pad_mode {self.pad_mode!r}; valid: no_padding, right")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.rows = [training_row(record, self.max_length, self.truncation) for record in records]
        self.records = records

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        tensors = row_tensors(self.rows[item])
        if self.pad_mode == "no_padding":  # verl nests variable-length rows itself
            return tensors
        input_ids, loss_mask = tensors["input_ids"], tensors["loss_mask"]
        padding = self.max_length - len(input_ids)
        return {
            "input_ids": torch.cat([input_ids, torch.full((padding,), self.pad_token_id, dtype=torch.long)]),
            "attention_mask": torch.cat([torch.ones_like(input_ids), torch.zeros(padding, dtype=torch.long)]),
            "position_ids": torch.cat([torch.arange(len(input_ids)), torch.zeros(padding, dtype=torch.long)]),
            # Padding is never trained on.
            "loss_mask": torch.cat([loss_mask, torch.zeros(padding, dtype=torch.long)]),
        }


def row_tensors(row) -> dict[str, torch.Tensor]:
    """A `TrainingRow` as verl's no-padding item: input_ids, position_ids, loss_mask, each [seq]."""
    input_ids = torch.tensor(row.input_ids, dtype=torch.long)
    return {"input_ids": input_ids, "position_ids": torch.arange(len(input_ids)),
            "loss_mask": torch.tensor(row.loss_mask, dtype=torch.long)}


def plain_config(value):
    """An OmegaConf node as plain Python (dicts and lists), anything else unchanged."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value


def dataset_files(parquet_files) -> list:
    """The trajectory files/folders verl hands a dataset class as `parquet_files`; unset is an error naming the key."""
    if parquet_files is None:
        raise TrajectoryDataError("data.train_files is not set: name trajectory .jsonl files or folders of them "
                                  "(a run's checkpoints/trajectories, or a collect --out file)")
    return [parquet_files] if isinstance(parquet_files, (str, os.PathLike)) else list(parquet_files)


def hf_model_dir(folder: str | Path) -> Path:
    """The Hugging Face model of the latest `global_step_<N>` checkpoint in an SFT output folder.

    With LoRA (`model.lora_rank > 0`) verl's `huggingface/` folder holds PEFT's state (names no model loader
    reads): the model is then the adapter merged into the base, written once by `beyond_agent.export` into
    `global_step_<N>/lora_export/merged` (beside it, the adapter alone in `lora_export/lora_adapter`)."""
    steps = sorted((int(m.group(1)), p) for p in Path(folder).glob("global_step_*")
                   if (m := re.fullmatch(r"global_step_(\d+)", p.name)))
    for _step, path in reversed(steps):
        model = path / "huggingface"
        if (model / "config.json").exists() and (path / "lora_train_meta.json").exists():
            return merged_lora_model(path)
        if (model / "config.json").exists():
            return model
    raise FileNotFoundError(f"no global_step_*/huggingface model in {folder}; was checkpoint.save_contents "
                            "missing hf_model, or did training stop before its first save?")


def merged_lora_model(checkpoint: Path) -> Path:
    """A LoRA checkpoint's adapter merged into its base (exported on the first call, read back after)."""
    out = checkpoint / LORA_EXPORT_FOLDER
    merged = out / MERGED_FOLDER
    if not (merged / "config.json").exists():
        merged = export_checkpoint(checkpoint, out, merge_lora=True).merged
    return merged


def sft_command(overrides: list[str], program: str, cpu: bool | None = None,
                nproc: int | None = None) -> tuple[list[str], dict]:
    """The torchrun command line and environment that run the trainer program `program` (a module run with
    `python -m`, e.g. the `recipe/sft` recipe's `recipe.sft.main`) with `overrides`: one process per
    `trainer.n_gpus_per_node`, the CPU settings on a machine without CUDA."""
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    nproc = nproc or _n_gpus(overrides)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", program]
    extra_env = dict(SFT_CPU_ENV) if cpu else {}
    cpu_keys = [override for override, _why in SFT_CPU_OVERRIDES] if cpu else []
    return command + cpu_keys + list(overrides), {**os.environ, **extra_env}


def start_program(main: Callable[[], None]) -> None:
    """A trainer program's `__main__` (`recipe/sft`, `recipe/dpo`, run with `python -m`): started by torchrun (or
    in a dry run), be one of its processes (`main`); started by a user, start torchrun running this same program
    (the module `python -m` ran, under its own name: a forked recipe runs itself) with this command line and exit
    with its status."""
    if "LOCAL_RANK" in os.environ or is_dry_run():
        main()
    else:
        command, env = sft_command(sys.argv[1:], sys.modules["__main__"].__spec__.name)
        sys.exit(subprocess.run(command, env=env).returncode)


def _n_gpus(overrides: list[str]) -> int:
    for override in overrides:
        if override.startswith("trainer.n_gpus_per_node="):
            return int(override.split("=", 1)[1])
    return 1


def run_sft(overrides: list[str], program: str, cpu: bool | None = None, log_path: Path | None = None,
            progress: Callable[[], None] | None = None, progress_every_s: float = 30.0) -> None:
    """Run the trainer program `program` (e.g. the `recipe/sft` recipe's `recipe.sft.main`: verl's SFT trainer on
    trajectories; the caller names it, the library names no recipe) to completion in a child torchrun; raises when
    it fails. With `log_path`, its output goes there and `progress`, when given, is called every `progress_every_s`
    seconds while it runs (a long run whose output goes to a log is not silent); without, its output is ours."""
    command, env = sft_command(overrides, program, cpu)
    if log_path is not None:
        returncode = run_logged(command, log_path, progress, progress_every_s, env=env)
    else:
        returncode = subprocess.run(command, env=env).returncode
    if returncode != 0:
        where = f"; its log: {log_path}" if log_path else ""
        raise RuntimeError(f"SFT exited with status {returncode}{where}")


def repeated_files(paths, times: int) -> list[str]:
    """The trajectory files of `paths`, each listed `times` times: in `data.train_files` their episodes then
    weigh `times` as much as a new episode (how the self-training loops up-weight expert data)."""
    if times < 1:
        raise TrajectoryDataError(f"a trajectory weight must be an integer >= 1; got {times}")
    return [str(path) for path in trajectory_files(paths) for _ in range(times)]


def loop_args(config: Any, where: str, task_options: tuple[str, ...],
              choices: Mapping[str, Sequence[str]] | None = None):
    """An explore -> SFT loop's (AgentEvol's, Agent-R's) composed Hydra config as an attribute namespace, checked
    before any model starts: every required key (`???` in its YAML) set, every task range parsed (each becomes its
    list of task indices), `iterations` >= 1, each key of `choices` one of its values; `out` a Path, `sft` (Hydra
    overrides of every SFT run) a list of strings, `envservice_url` the launcher's `beyond_agent.env.url`. A bad
    key raises SystemExit naming `<where>.<key>` and what is valid."""
    import argparse
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from beyond_agent.cli_args import task_indices

    missing = sorted(key for key in config if key != "hydra" and OmegaConf.is_missing(config, key))
    if missing:
        raise SystemExit(f"{where}: {', '.join(f'{where}.{key}' for key in missing)} required (e.g. {missing[0]}=...)")
    values = OmegaConf.to_container(config, resolve=True)
    values.pop("hydra", None)
    for name in task_options:  # "0:64", "3,5,7" (quoted on a Hydra command line) or a list [3, 5, 7]
        value = values[name]
        try:
            values[name] = [int(task) for task in value] if isinstance(value, list) else task_indices(str(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise SystemExit(f"{where}.{name}: {error}") from None
    for name, valid in (choices or {}).items():
        if values[name] not in valid:
            raise SystemExit(f"{where}.{name}={values[name]!r} is not valid; choose one of {', '.join(valid)}")
    if not isinstance(values["iterations"], int) or values["iterations"] < 1:
        raise SystemExit(f"{where}.iterations must be an integer >= 1; got {values['iterations']!r}")
    values["params"] = values.get("params") or {}  # null in the YAML, so that a mapping can replace it on the command line
    values["out"] = Path(values["out"])
    values["sft"] = [str(override) for override in values["sft"] or []]
    values["envservice_url"] = (values.pop("beyond_agent", None) or {}).get("env", {}).get("url")
    return SimpleNamespace(**values)


def report_iterations(figures: list[dict], path: Path, started: float, loop: str,
                      columns: Sequence[tuple[str, str, str]]) -> None:
    """Keep an explore -> SFT loop's iterations and its wall time in `path` (JSON, rewritten after each
    iteration: nothing is lost if a later one fails) and print them as a table, one row per iteration.

    `columns`: (header, key of the row, format spec) each; a row without the key shows '-'."""
    path.write_text(json.dumps({"iterations": figures, "wall_s": time.monotonic() - started}, indent=2))
    print(f"[{loop}] " + "  ".join(header for header, _, _ in columns))
    for row in figures:
        cells = [(format(row[key], spec) if key in row else "-").rjust(len(header)) for header, key, spec in columns]
        print(f"[{loop}] " + "  ".join(cells), flush=True)


def dry_run_checked(config) -> bool:
    """In a dry run (`launcher.py --dry-run`): check what this program reads of its composed config (the
    trajectory filter), print the marker and say so; otherwise False and nothing is checked here."""
    if not is_dry_run():
        return False
    TrajectoryFilter.from_mapping(plain_config(config.data.get("trajectory_filter", None)), "data.trajectory_filter")
    print(DRY_RUN_MARKER, flush=True)
    return True


def use_metrics_file(config) -> None:
    """Point verl's `file` tracker at metrics.jsonl beside the checkpoints, as in RL runs."""
    from beyond_agent.run_folder import METRICS_PATH_VARIABLE, metrics_path

    path = metrics_path(config)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.environ[METRICS_PATH_VARIABLE] = str(path)

