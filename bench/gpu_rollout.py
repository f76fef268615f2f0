"""Rollout throughput on one GPU: our env manager against verl 0.9's own agent loop, on the same vLLM server.

    python bench/gpu_rollout.py [--sizes 0.5b 1.5b] [--rows 32] [--n 2] [--rounds 4] [--tokens-per-turn 256]
                                [--stop-at-eos] [--repeats 2] [--out DIR]
    BEYOND_GPU_CHECKS_ON_CPU=1 .venv/bin/python bench/gpu_rollout.py --sizes tiny --rows 2 --repeats 1 \
        --tokens-per-turn 64 --out /tmp/gpu-bench      # the CPU rehearsal (~5 min on 2 cores)

For each size: a random-initialised Qwen2 with Qwen2.5-<size>-Instruct's shape (hidden size, layers, heads,
MLP; built on the machine, nothing downloaded; the vocabulary is the offline tokenizer's ~1k entries, not Qwen's
152k, so the output layer is far smaller than the real model's), envservice serving BabyAI, and verl's standalone
vLLM server (one replica on the one GPU, verl's LLMServerManager) with one client. Then the same rows (BabyAI
tasks, `--n` episodes each, at most `--rounds` replies of `--tokens-per-turn` tokens: verl's server ignores the eos
token (`rollout.ignore_eos`) unless `--stop-at-eos`, so every reply has an agent's length rather than a random
model's; its replies are rarely actions, so nearly every episode plays all its rounds) are played by
  (a) ours: BeyondAgentLoopManager, i.e. ParallelEnvManager with `--rows x --n` episodes in flight, and
  (b) verl's: AgentLoopManager with one AgentLoopWorker and bench/verl_envservice_loop.py's turn loop,
first once each to warm up, then `--repeats` times each, alternating. Per manager it prints generated tokens/s,
episodes/s, seconds per reply (each episode's time waiting for its replies over the replies), the GPU's busy
fraction (utilisation sampled every 50 ms while the manager plays, from NVML or nvidia-smi) and, for ours, rollout
wall / LLM busy (time with a request in flight, as our manager counts it). Figures of one run; compare ratios.
One JSON per size in --out (default outputs/gpu-bench), skipped when present: `scripts/gpu/checks.sh bench-0.5b`
and `bench-1.5b` run one size each, so each fits beside another check in one device call (docs/gpus.md).
The training step's breakdown in full and delta sync modes is not measured here (tests/gpu's runs log it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable
from uuid import uuid4

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

REHEARSE_ON_CPU = os.environ.get("BEYOND_GPU_CHECKS_ON_CPU") == "1"

from dev_tools.run_phases import phase_rows  # noqa: E402
from dev_tools.tiny_model import SHAPES, build_shaped_model  # noqa: E402


def capture_sizes(concurrency: int) -> list[int]:
    """The batch sizes vLLM captures CUDA graphs for: its own default steps (1, 2, 4, then every 8) up to the most
    replies the bench has in flight, instead of up to 2 x verl's max_num_seqs of 256 (51 sizes, each captured for
    full and piecewise graphs: the 2026-11-28 H200 call ran past 150 s of start-up in capture). Larger batches
    never occur here; a batch between two sizes is padded to the larger, as vLLM does anyway."""
    steps = [1, 2, 4, *range(8, concurrency + 8, 8)]
    return [size for size in steps if size < concurrency] + [next(size for size in steps if size >= concurrency)]


def compose_config(args: argparse.Namespace, model_dir: Path, env_url: str, loop_config: Path) -> Any:
    """The recipe's config with verl's standalone rollout on one GPU, and the loop of (b) named."""
    from hydra import compose, initialize_config_dir
    from verl_cpu.overrides import IN_PROCESS_WORKER

    from bench.verl_envservice_loop import AGENT_NAME

    prompt, response = 1024, args.rounds * (args.tokens_per_turn + 256)
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", f"data.max_prompt_length={prompt}",
        f"data.max_response_length={response}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.max_model_len={prompt + response}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.temperature=1.0",
        # verl's vLLM server applies it to every request, of both managers: each reply is max_tokens long
        f"actor_rollout_ref.rollout.ignore_eos={str(not args.stop_at_eos).lower()}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_config}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        f"beyond_agent.env.url={env_url}", f"beyond_agent.max_tokens_per_turn={args.tokens_per_turn}",
        f"beyond_agent.rounds.rounds={args.rounds}", f"beyond_agent.concurrency={args.rows * args.n}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.rows * args.n}",
        f"actor_rollout_ref.rollout.cudagraph_capture_sizes=[{','.join(map(str, capture_sizes(args.rows * args.n)))}]",
        # vLLM's worker in its engine core's process (vLLM's own choice at TP 1; verl asks for a process of its own,
        # 25 s more start-up in the H200 call of 2026-11-28), the same server for both managers
        IN_PROCESS_WORKER,
    ]
    if REHEARSE_ON_CPU:
        from verl_cpu.overrides import cpu_overrides

        overrides += [override for override in cpu_overrides() if override != IN_PROCESS_WORKER
                      and override.startswith(("actor_rollout_ref.rollout", "+actor_rollout_ref.rollout"))]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipe/multiturn_rl/config"), version_base=None):
        return compose("beyond_agent_trainer", overrides=overrides)


def rows_batch(rows: list[dict], n: int) -> Any:
    """verl's rollout batch of the rows, each repeated n times in a row (one group), as the trainer hands it."""
    import numpy as np
    from verl.protocol import DataProto

    def column(values: list[Any]) -> np.ndarray:
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):  # one by one: np.array(list of lists) would make a 2-D array
            array[i] = value
        return array

    batch = DataProto(non_tensor_batch={
        "raw_prompt": column([list(row["prompt"]) for row in rows]),
        "extra_info": column([dict(row["extra_info"]) for row in rows]),
        "uid": column([uuid4().hex for _ in rows]),
        "data_source": column([row["data_source"] for row in rows]),
    }, meta_info={"global_steps": 1})
    return batch.repeat(n, interleave=True)


class GpuBusy:
    """The GPU's utilisation (percent of time a kernel ran), sampled every 50 ms while in the `with` block: from
    NVML when pynvml is installed, else from `nvidia-smi --loop-ms` (the lent machine's image has the driver's
    tool but not pynvml); None on a machine with neither (a CPU rehearsal)."""

    def __init__(self) -> None:
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._read: Callable[[], float] | None = None
        self._smi: subprocess.Popen | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception:  # noqa: BLE001 - no NVML: nvidia-smi below, or the figure is left out
            pass

    def __enter__(self) -> "GpuBusy":
        if self._read:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        elif shutil.which("nvidia-smi"):
            self._smi = subprocess.Popen(["nvidia-smi", "--id=0", "--query-gpu=utilization.gpu",
                                          "--format=csv,noheader,nounits", "--loop-ms=50"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self._samples.append(self._read() / 100.0)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            output, _ = self._smi.communicate(timeout=10)
            self._samples = [float(line) / 100.0 for line in output.split() if line.strip().isdigit()]

    @property
    def fraction(self) -> float | None:
        return statistics.fmean(self._samples) if self._samples else None


def play(generate: Callable[[Any], Any], batch: Any, llm_figures: Callable[[Any, float], dict[str, float]]
         ) -> dict[str, Any]:
    """One rollout of the batch through a manager's generate_sequences: throughput figures, and the manager's own
    (`llm_figures(output, wall)`: its mean seconds per reply, and ours its wall / LLM busy)."""
    with GpuBusy() as gpu:
        started = time.perf_counter()
        output = generate(batch)
        wall = time.perf_counter() - started
    generated = int(output.batch["response_mask"].sum())  # the policy's tokens only, for both managers
    return {"wall_s": wall, "episodes": len(output), "episodes_per_s": len(output) / wall,
            "generated_tokens": generated, "generated_tokens_per_s": generated / wall,
            "gpu_busy_fraction": gpu.fraction, **llm_figures(output, wall)}


def verl_llm_figures(output: Any, wall: float) -> dict[str, float]:
    """bench/verl_envservice_loop.py's per-episode fields: seconds waiting for replies, and replies."""
    replies = int(sum(output.non_tensor_batch["replies"]))
    return {"replies": replies, "seconds_per_reply": float(sum(output.non_tensor_batch["llm_s"])) / max(replies, 1)}


class PhaseClock:
    """When each phase of a bench call ended, in seconds from its start (issue #74: a device call's minutes are
    planned from these)."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.phases.append((phase, round(time.perf_counter() - self._started, 1)))


def bench_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """Start everything for one model size, play warm-up and timed rollouts with both managers."""
    import ray

    from bench.verl_envservice_loop import write_agent_loop_config
    from envservice.client import EnvClient
    from envservice.process import EnvServiceProcess
    from beyond_agent.data import task_rows

    out = Path(args.out)
    clock = PhaseClock()
    model_dir = build_shaped_model(size, Path(args.models) / size)
    clock.mark("model built (or kept)")
    with EnvServiceProcess(["babyai"], log_path=out / f"envservice_{size}.log") as service:
        with EnvClient(service.url) as client:
            # Rows are layouts of one level, drawn by seed: BabyAI's train split is its 10 levels, so task numbers
            # 0..rows-1 past 9 do not exist (the 2026-11-28 H200 call failed on exactly that with the default 32).
            rows = task_rows(client, "babyai", "train", list(range(args.rows)), seed=0, task_name=args.level)
        loop_config = write_agent_loop_config(out / "agent_loops.yaml", args.rounds, args.tokens_per_turn,
                                              args.rows * args.n)
        config = compose_config(args, model_dir, service.url, loop_config)
        clock.mark("envservice up, rows drawn")
        # verl's workers import bench/verl_envservice_loop.py: Ray's processes inherit this environment.
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
        ray.init(num_gpus=1 if REHEARSE_ON_CPU else None, include_dashboard=False)
        clock.mark("Ray up")
        try:
            from beyond_agent.rollout_manager import BeyondAgentLoopManager
            from verl.experimental.agent_loop import AgentLoopManager
            from verl.workers.rollout.llm_server import LLMServerManager

            started = time.perf_counter()
            servers = LLMServerManager.create(config=config)  # no worker group: standalone replicas
            clock.mark("vLLM server up")
            client = servers.get_client()  # what verl's trainer hands any rollout manager
            verl_manager = AgentLoopManager.create(config=config, llm_client=client)
            ours = BeyondAgentLoopManager.create(config=config, llm_client=client)
            clock.mark("both managers up")
            result: dict[str, Any] = {"size": size, "shape_of": SHAPES[size], "rows": args.rows, "n": args.n,
                                      "rounds": args.rounds, "tokens_per_turn": args.tokens_per_turn,
                                      "ignore_eos": not args.stop_at_eos,
                                      "startup_s": time.perf_counter() - started, "ours": [], "verl": []}

            def ours_llm_figures(output: Any, wall: float) -> dict[str, float]:
                # The rollout's figures (beyond_agent/...): episodes, mean rounds (= replies), the seconds every
                # episode waited for replies, and the time the server had a request of ours in flight.
                figures = ours.take_step_metrics()
                replies = round(figures["beyond_agent/mean_rounds"] * figures["beyond_agent/episodes"])
                return {"replies": replies, "seconds_per_reply": figures["beyond_agent/llm_time_s"] / max(replies, 1),
                        "wall_over_llm_busy": wall / figures["beyond_agent/llm_busy_s"]}

            managers = {"ours": (ours.generate_sequences, ours_llm_figures),
                        "verl": (verl_manager.generate_sequences, verl_llm_figures)}
            for name, (generate, llm_figures) in managers.items():  # warm-up: first requests, connections, envs
                result[f"{name}_warmup"] = play(generate, rows_batch(rows, args.n), llm_figures)
                clock.mark(f"{name}: warm-up played")
            for repeat in range(args.repeats):
                for name in (("ours", "verl") if repeat % 2 == 0 else ("verl", "ours")):
                    generate, llm_figures = managers[name]
                    result[name].append(play(generate, rows_batch(rows, args.n), llm_figures))
                    clock.mark(f"{name}: timed rollout {repeat + 1} played")
                    print(f"[gpu_rollout] {size} {name} #{repeat + 1}: {json.dumps(result[name][-1])}", flush=True)
            result["phases"] = clock.phases
            return result
        finally:
            ray.shutdown()


def summary(result: dict[str, Any]) -> str:
    """One table row per manager, and ours / verl's."""
    def mean(name: str, key: str) -> float | None:
        values = [run[key] for run in result[name] if run.get(key) is not None]
        return statistics.fmean(values) if values else None

    lines = [f"{result['size']}: {result['rows']} rows x n={result['n']}, {result['rounds']} rounds x "
             f"{result['tokens_per_turn']} tokens{' (eos ignored)' if result.get('ignore_eos') else ''}; "
             f"start-up {result['startup_s']:.0f} s",
             "| manager | generated tokens/s | episodes/s | s per reply | GPU busy | wall / LLM busy |",
             "|---|---|---|---|---|---|"]
    for name in ("ours", "verl"):
        busy, ratio, latency = (mean(name, key) for key in ("gpu_busy_fraction", "wall_over_llm_busy", "seconds_per_reply"))
        lines.append(f"| {name} | {mean(name, 'generated_tokens_per_s'):.0f} | {mean(name, 'episodes_per_s'):.2f} | "
                     f"{'-' if latency is None else f'{latency:.3f}'} | {'-' if busy is None else f'{busy:.2f}'} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    lines.append(f"ours / verl: generated tokens/s {mean('ours', 'generated_tokens_per_s') / mean('verl', 'generated_tokens_per_s'):.2f}x, "
                 f"episodes/s {mean('ours', 'episodes_per_s') / mean('verl', 'episodes_per_s'):.2f}x")
    if result.get("phases"):  # JSONs written before 2026-12-01 have none
        lines += ["", f"where the {result['size']} call's time went:", *phase_rows(result["phases"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=32, help="BabyAI layouts per rollout (seeds 0..rows-1 of --level)")
    parser.add_argument("--level", default="BabyAI-GoToLocal-v0", help="the BabyAI level every row plays")
    parser.add_argument("--n", type=int, default=2, help="episodes per task")
    parser.add_argument("--rounds", type=int, default=4, help="replies per episode at most")
    parser.add_argument("--tokens-per-turn", type=int, default=256, help="new tokens per reply")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="let replies end at the eos token (default: every reply is --tokens-per-turn tokens, "
                             "since a random-weight model's replies would otherwise end at random lengths)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts per manager, after one warm-up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=str(REPO_ROOT / "outputs/gpu-bench"), help="the JSONs and logs")
    parser.add_argument("--models", default=str(REPO_ROOT / "outputs/gpu-bench/models"),
                        help="where the random models are built (GBs: keep it out of a device call's $OUT)")
    args = parser.parse_args(argv)
    if REHEARSE_ON_CPU:  # before anything imports verl: its plugin registers the CPU platform at import
        from verl_cpu.overrides import CPU_ENV

        os.environ.update(CPU_ENV)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        path = Path(args.out) / f"bench_gpu_rollout_{size}.json"
        if path.exists():
            print(f"[gpu_rollout] {size}: {path} exists, skipped")
        else:
            path.write_text(json.dumps(bench_size(args, size), indent=2) + "\n")
        print(summary(json.loads(path.read_text())), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
