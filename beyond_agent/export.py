"""Export a training checkpoint as a Hugging Face model: the full model, or with LoRA the adapter and on request
the base model with the adapter merged in.

    python -m beyond_agent.export --checkpoint <run>/global_step_<N> --out <folder> [--merge-lora]

verl's model merger (`verl.model_merger`, FSDP backend) gathers the actor's shards into `<out>`: the model (bf16,
as verl writes it) and its tokenizer; for a LoRA run, the base model there and the adapter in PEFT's format in
`<out>/lora_adapter` (load it with `PeftModel.from_pretrained`, or serve it with `vllm serve --lora-modules`).
`--merge-lora` also writes `<out>/merged`: PEFT's `merge_and_unload` of that adapter into that base.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FOLDER = "lora_adapter"
MERGED_FOLDER = "merged"


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote."""

    model: Path
    """The checkpoint's model (for a LoRA run: the base model, without the adapter)."""
    adapter: Path | None
    """The LoRA adapter in PEFT's format (None: the run trained the whole model)."""
    merged: Path | None
    """The base model with the adapter merged in (only when asked for)."""


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge_lora: bool = False) -> Exported:
    """Write `checkpoint` (a `global_step_<N>` folder, or its `actor` folder) as a Hugging Face model in `out`.

    Raises FileNotFoundError naming what is missing, ValueError when `merge_lora` is asked of a full model."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor = _actor_folder(Path(checkpoint))
    out = Path(out)
    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor), target_dir=str(out),
                               hf_model_config_path=str(actor / "huggingface"))
    FSDPModelMerger(config).merge_and_save()
    adapter = out / ADAPTER_FOLDER
    adapter = adapter if (adapter / "adapter_config.json").exists() else None
    if merge_lora and adapter is None:
        raise ValueError(f"--merge-lora: {checkpoint} holds no LoRA adapter (the run trained the whole model)")
    merged = merge_adapter(out, adapter, out / MERGED_FOLDER) if merge_lora else None
    return Exported(model=out, adapter=adapter, merged=merged)


def merge_adapter(base: Path, adapter: Path, out: Path) -> Path:
    """PEFT's merge of `adapter` into the model in `base`, saved with `base`'s tokenizer in `out`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def _actor_folder(checkpoint: Path) -> Path:
    for folder in (checkpoint / "actor", checkpoint):
        if (folder / "huggingface" / "config.json").exists() and any(folder.glob("model_world_size_*_rank_*.pt")):
            return folder
    raise FileNotFoundError(f"{checkpoint}: no actor checkpoint (model_world_size_*_rank_*.pt and huggingface/"
                            "config.json) in it or in its actor/ folder; pass a global_step_<N> folder")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a global_step_<N> folder of a training run")
    parser.add_argument("--out", required=True, help="the folder to write the Hugging Face model into")
    parser.add_argument("--merge-lora", action="store_true", help="also write the adapter merged into the base")
    args = parser.parse_args(argv)
    try:
        exported = export_checkpoint(args.checkpoint, args.out, merge_lora=args.merge_lora)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"export: {error}") from None
    print(f"[beyond_agent] exported: model {exported.model}"
          + (f", LoRA adapter {exported.adapter}" if exported.adapter else "")
          + (f", merged model {exported.merged}" if exported.merged else ""), flush=True)


if __name__ == "__main__":
    main()
