"""A stand-in for flash-attn on the lent GPU machine, which cannot build it (no network) and has no wheel for it.

verl imports only `flash_attn.bert_padding` on CUDA when flash-attn is importable or remove-padding is on; the
GPU checks run with `attn_implementation=sdpa` and `use_remove_padding=false`, so no flash-attn kernel is called.
Put on the path by scripts/gpu/device/install.sh only; a real cluster installs flash-attn (docs/gpus.md).
"""
