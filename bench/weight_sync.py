"""Weight-sync bench: bytes and seconds per sync, full vs delta, in the rollout's dtype (bf16) and in fp32,
at two learning rates, after real AdamW steps on a Qwen2-shaped model (issue #32 item 4).

    python bench/weight_sync.py [--layers 4] [--syncs 4] [--out outputs/bench/weight_sync]

What runs: a randomly initialised Qwen2 model (Qwen2.5-0.5B's widths, `--layers` layers, tied embeddings),
trained with AdamW on random token batches (one optimiser step per sync, as a training step of the recipe);
after each step the delta sender (`beyond_agent.weights.delta`) encodes the model's state dict and the
receiver applies and verifies it, as the trainer and the vLLM extension do. The first sync is full (there is
nothing to diff against); the figures are the mean over the `--syncs` deltas after it. "full MiB" is what
`mode: full` sends each time (the whole model in the send dtype). Each (send dtype, lr) variant is one JSON
under `--out`, skipped when present, so an interrupted run resumes.

What it prints: per variant, the elements that changed per sync, the bytes sent as a share of a full sync
(goal for bf16 at lr 1e-6: <= 20 %), the sender's encode and the receiver's apply seconds; then what a LoRA
sync sends (rank 16 and 64 on every linear layer) against a full one, on Qwen2.5-0.5B/1.5B/7B's shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from beyond_agent.weights.delta import WeightDeltaReceiver, WeightDeltaSender, WeightSyncConfig

VARIANTS = [("bfloat16", 1e-6), ("bfloat16", 1e-5), ("float32", 1e-6), ("float32", 1e-5)]
"""(send dtype, learning rate) pairs measured."""
QWEN25_SHAPES = {  # the published configs' widths (nothing is downloaded)
    "Qwen2.5-0.5B": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(vocab_size=151_936, hidden_size=1_536, intermediate_size=8_960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152_064, hidden_size=3_584, intermediate_size=18_944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
LORA_RANKS = (16, 64)


def build_model(layers: int, seed: int) -> torch.nn.Module:
    """Qwen2.5-0.5B's widths with `layers` layers, randomly initialised (nothing is downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4_096,
                         tie_word_embeddings=True, torch_dtype="float32")
    return Qwen2ForCausalLM(config).float()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> float:
    """One AdamW step on a random batch (2 x 128 tokens from the first 32 000 ids); returns the loss."""
    tokens = torch.randint(0, 32_000, (2, 128), generator=generator)
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def run_variant(send_dtype: str, lr: float, layers: int, syncs: int) -> dict:
    """Train and sync `syncs` times; the per-sync figures and their means over syncs 2..N."""
    model = build_model(layers, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sender = WeightDeltaSender(WeightSyncConfig(mode="delta", full_every=10_000),
                               float_dtype=getattr(torch, send_dtype))
    receiver, generator, rows = WeightDeltaReceiver(), torch.Generator().manual_seed(0), []
    for index in range(syncs + 1):
        loss = train_step(model, optimizer, generator) if index else float("nan")  # sync 0: the start weights
        # named_parameters, not state_dict: the tied embedding is sent once (vLLM ties lm_head to it itself)
        sync = sender.encode((name, tensor.detach()) for name, tensor in model.named_parameters())
        started = time.perf_counter()
        receiver.apply(sync.header, sync.payloads)
        apply_s = time.perf_counter() - started
        metrics = sync.metrics
        row = {"sync": index, "loss": loss, "full": bool(metrics["beyond_agent/weight_sync/full"]),
               "bytes_sent": int(metrics["beyond_agent/weight_sync/bytes_sent"]), "bytes_full": int(metrics["beyond_agent/weight_sync/bytes_full"]),
               "sent_fraction": metrics["beyond_agent/weight_sync/sent_fraction"],
               "changed_fraction": metrics["beyond_agent/weight_sync/changed_fraction"],
               "encode_s": metrics["beyond_agent/weight_sync/encode_s"], "apply_s": apply_s}
        rows.append(row)
        print(f"  {send_dtype} lr {lr:g} sync {index}: {'full' if row['full'] else 'delta'}, changed "
              f"{100 * row['changed_fraction']:.2f} %, sent {row['bytes_sent'] / 2**20:.1f} MiB "
              f"({100 * row['sent_fraction']:.1f} % of full), encode {row['encode_s']:.2f} s, apply {apply_s:.2f} s",
              flush=True)
    later = rows[1:]
    parameters = sum(p.numel() for p in model.parameters())
    return {"send_dtype": send_dtype, "lr": lr, "layers": layers, "parameters": parameters, "syncs": rows,
            "mean": {key: statistics.fmean(row[key] for row in later)
                     for key in ("changed_fraction", "sent_fraction", "bytes_sent", "bytes_full", "encode_s",
                                 "apply_s")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--syncs", type=int, default=4, help="training steps, each followed by a sync")
    parser.add_argument("--out", default="outputs/bench/weight_sync", help="one JSON per variant (resumable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.syncs < 2:
        parser.error("--layers must be >= 1 and --syncs >= 2 (the first sync is full; deltas follow)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for send_dtype, lr in VARIANTS:
        path = out / f"{send_dtype}_lr{lr:g}_layers{args.layers}_syncs{args.syncs}.json"
        if path.exists():
            print(f"{path.name}: done before, read back")
        else:
            print(f"{send_dtype}, lr {lr:g}:", flush=True)
            path.write_text(json.dumps(run_variant(send_dtype, lr, args.layers, args.syncs), indent=1))
        results.append(json.loads(path.read_text()))
    print(f"\n{results[0]['parameters'] / 1e6:.0f} M parameters ({args.layers} layers), mean over the {args.syncs} delta syncs:")
    print("| send dtype | lr | elements changed | delta bytes / full | delta MiB | full MiB | encode s | apply s |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        mean = result["mean"]
        print(f"| {result['send_dtype']} | {result['lr']:g} | {100 * mean['changed_fraction']:.2f} % | "
              f"{100 * mean['sent_fraction']:.1f} % | {mean['bytes_sent'] / 2**20:.1f} | {mean['bytes_full'] / 2**20:.1f} | "
              f"{mean['encode_s']:.2f} | {mean['apply_s']:.2f} |")
    lora = print_lora_table()
    if args.json:
        summary = [{key: result[key] for key in ("send_dtype", "lr", "parameters", "mean")} for result in results]
        args.json.write_text(json.dumps({"layers": args.layers, "syncs": args.syncs, "variants": summary,
                                         "lora": lora}, indent=1))
    return 0


def print_lora_table() -> list[dict]:
    """What a LoRA sync sends (the adapter on every linear layer, `all-linear`) against a full sync, counted by PEFT
    on meta-device models of Qwen2.5's shapes (`beyond_agent.weights.lora.adapter_parameter_count`)."""
    from transformers import Qwen2Config

    from beyond_agent.weights.lora import adapter_parameter_count

    print("\nLoRA (all-linear) vs full sync, elements per sync (x 2 bytes in bf16, x 4 in fp32):")
    print("| model | full | " + " | ".join(f"LoRA rank {rank}" for rank in LORA_RANKS) + " |")
    print("|---|---|" + "---|" * len(LORA_RANKS))
    rows = []
    for name, shape in QWEN25_SHAPES.items():
        config = Qwen2Config(**shape)
        with torch.device("meta"):
            from transformers import Qwen2ForCausalLM

            full = sum(param.numel() for param in Qwen2ForCausalLM(config).parameters())
        cells = []
        for rank in LORA_RANKS:
            adapter = adapter_parameter_count(config, rank, alpha=2 * rank, target_modules="all-linear")
            cells.append(f"{adapter / 1e6:.1f} M ({100 * adapter / full:.2f} %)")
            rows.append({"model": name, "rank": rank, "full_parameters": full, "adapter_parameters": adapter})
        print(f"| {name} | {full / 1e6:.0f} M | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
