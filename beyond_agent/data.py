"""Tasks as data: write the train/val parquet files verl's dataloader reads, one row per (env, task).

    python -m beyond_agent.data --env babyai --train-tasks 0:64 --val-tasks 0:16 --out data/babyai
    python -m beyond_agent.data --env babyai --task BabyAI-GoToRedBallNoDists-v0 --train-tasks 0:480 ...

With `--task NAME` every row is that task of the split and the task numbers only pick its seeds (seed + number):
one level, many layouts. Without it the numbers are the split's tasks (task i with seed + i).

Each row's `prompt` is the env's first observation of that task (asked from envservice, which this
starts unless given `--envservice-url`); `extra_info` holds env_id, task_id, seed and split, which is all
BeyondAgentLoopManager needs to replay the task, and `task` when `--agent-task` names the AgentTask the
rows use (else the rows use the task configured for their env, or `default`). The episode starts from a
fresh session, and its first messages are the row's `prompt` (edit it, and the model sees the edit;
`{observation}` in a user message stands for the env's live first observation).
Several files (one per env) can be mixed in one run: `data.train_files=[a/train.parquet,b/train.parquet]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from beyond_agent.cli_args import json_object, task_indices


def task_rows(client, env_id: str, split: str, tasks: list[int], seed: int, agent_task: str | None = None,
              params: dict | None = None, task_name: str | None = None) -> list[dict]:
    """One verl RL row per task number, with the first observation as the user prompt; `params` are the env's task
    parameters (e.g. FrozenLake's size), kept in extra_info so every episode of the row gets them. `task_name`:
    every row plays that task, the numbers only pick the seeds (seed + number)."""
    from envservice.contamination import TaskSet

    rows = []
    for index, (task, task_seed) in enumerate(TaskSet.of("rows", env_id, split, tasks, seed, params, task_name).tasks):
        created = client.create(env_id, task_id=task, seed=task_seed, split=split, params=params or {})
        try:
            observation = created.observation
        finally:
            client.release(created.session_id)
        rows.append({
            "data_source": env_id,
            "prompt": [{"role": "user", "content": observation}],
            "ability": "agent",
            "reward_model": {"style": "env", "ground_truth": ""},
            "extra_info": {"env_id": env_id, "task_id": task, "seed": task_seed, "split": split, "index": index,
                           **({"task": agent_task} if agent_task else {}), **({"params": params} if params else {})},
        })
    return rows


def write_parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def write_task_files(env_id: str, out: Path, train_tasks: list[int], val_tasks: list[int], seed: int = 0,
                     val_split: str = "test", envservice_url: str | None = None,
                     agent_task: str | None = None, params: dict | None = None,
                     task_name: str | None = None) -> tuple[Path, Path]:
    """Write out/train.parquet and out/val.parquet; return their paths (`task_name`: see `task_rows`)."""
    from envservice.client import EnvClient
    from envservice.process import envservice_url as serving

    with serving([env_id], envservice_url) as url, EnvClient(url) as client:
        train_rows = task_rows(client, env_id, "train", train_tasks, seed, agent_task, params, task_name)
        val_rows = task_rows(client, env_id, val_split, val_tasks, seed, agent_task, params, task_name)
    train_path, val_path = out / "train.parquet", out / "val.parquet"
    write_parquet(train_rows, train_path)
    write_parquet(val_rows, val_path)
    print(f"[data] {validation_overlap(env_id, train_tasks, val_tasks, seed, val_split, params, task_name)}",
          flush=True)
    return train_path, val_path


def validation_overlap(env_id: str, train_tasks: list[int], val_tasks: list[int], seed: int, val_split: str,
                       params: dict | None, task_name: str | None = None) -> str:
    """One line: how many validation rows are tasks the train rows also hold, compared by content (the env's
    task fingerprint), or why that cannot be told. Validation on such rows is not held-out."""
    from envservice.contamination import TaskSet, UnknownContent, contamination
    from envservice.errors import EnvServiceError

    val = TaskSet.of("val", env_id, val_split, val_tasks, seed, params, task_name)
    try:
        report = contamination(val, [TaskSet.of("train", env_id, "train", train_tasks, seed, params, task_name)])
    except (UnknownContent, EnvServiceError) as error:  # e.g. an env only a remote service knows
        return f"validation rows not checked against the train rows: {error}"
    verdict = "held-out" if report["shared_any"] == 0 else "NOT held-out"
    return (f"{report['shared_any']} of {report['tasks']} validation rows have the content of a train row "
            f"({report['distinct']} distinct): {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m beyond_agent.data", description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="envservice env id, e.g. babyai")
    parser.add_argument("--train-tasks", type=task_indices, default=task_indices("0:64"))
    parser.add_argument("--val-tasks", type=task_indices, default=task_indices("0:16"))
    parser.add_argument("--val-split", default="test", help="split the validation tasks come from")
    parser.add_argument("--seed", type=int, default=0, help="task seed = seed + task number")
    parser.add_argument("--task", default=None, help="every row plays this task (a name of the split, e.g. a BabyAI "
                        "level); the task numbers then only pick the seeds")
    parser.add_argument("--envservice-url", default=None)
    parser.add_argument("--agent-task", default=None,
                        help="the AgentTask of these rows (extra_info.task): an entry of beyond_agent.tasks or a "
                        "registered task; default: the task configured for the env, else `default`")
    parser.add_argument("--params", type=json_object, default=None,
                        help='the env\'s task parameters as a JSON object, e.g. \'{"size": 6}\'')
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    train, val = write_task_files(args.env, args.out, args.train_tasks, args.val_tasks, args.seed, args.val_split,
                                  args.envservice_url, args.agent_task, args.params, args.task)
    print(f"wrote {len(args.train_tasks)} train rows to {train} and {len(args.val_tasks)} val rows to {val}")


if __name__ == "__main__":
    main()
