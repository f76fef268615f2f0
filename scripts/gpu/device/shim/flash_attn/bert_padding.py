"""The padding helpers verl imports from flash-attn, taken from verl's own pure-torch module (no code here)."""

from verl.utils.npu_flash_attn_utils import index_first_axis, pad_input, rearrange, unpad_input  # noqa: F401
