"""Write a tiny single-turn dataset in verl's gsm8k-like parquet schema for the CPU smoke run.

    python -m verl_cpu.smoke_data --out outputs/smoke_data --rows 16

Writes ``train.parquet`` and ``val.parquet``; each row has a ``prompt`` chat list, a ``data_source``,
``reward_model: {style, ground_truth}`` and ``extra_info``, which is what verl's RLHFDataset and reward
loop read. Deterministic: the same arguments give the same rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

DATA_SOURCE = "beyond_agent/smoke_add"


def make_row(index: int, split: str) -> dict:
    """One addition question whose answer is the ground truth."""
    a, b = 3 + index, 2 * index + 1
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write_split(out: Path, split: str, rows: int) -> Path:
    """Write ``<out>/<split>.parquet`` with ``rows`` rows and return its path."""
    path = out / f"{split}.parquet"
    pd.DataFrame([make_row(i, split) for i in range(rows)]).to_parquet(path)
    return path


def main() -> None:
    """Command line: write train and val splits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        print(write_split(args.out, split, args.rows))


if __name__ == "__main__":
    main()
