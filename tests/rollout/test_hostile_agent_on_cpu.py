"""A hostile command agent (issue #51), one episode per attack, through the real gateway, the real sandbox and a
real envservice (FrozenLake) over loopback: each attack is contained, each episode ends with a termination
reason, the trainer's memory stays flat, and nothing the agent started is left running."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid

import psutil

from envservice.client import EnvClient
from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.agents import AgentEpisodeLoop, CommandAgent
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.llm import GenerationResult
from sandbox import SandboxConfig

HOSTILE_AGENT = r'''
import json, os, socket, subprocess, sys
import openai
from beyond_agent.gateway.remote import episode_context

attack, report, marker, *ports = sys.argv[1:]
ctx = episode_context()
client = openai.OpenAI(max_retries=0)


def play_one_turn():
    messages = [{"role": "user", "content": ctx.env.observation}]
    ctx.env.step(client.chat.completions.create(model=ctx.model, messages=messages).choices[0].message.content)


if attack == "snoop":
    reached = {}
    for port in map(int, ports):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            reached[port] = True
        except OSError:
            reached[port] = False
    try:
        open(os.path.join(os.getcwd(), "escaped-" + marker), "w").write("out")
        wrote_outside = True
    except OSError:
        wrote_outside = False
    processes = [p for p in os.listdir("/proc") if p.isdigit()]
    json.dump({"variables": dict(os.environ), "reached": reached, "wrote_outside": wrote_outside,
               "processes": len(processes)}, open(report, "w"))
    play_one_turn()
elif attack == "daemon":
    subprocess.Popen(["sleep", marker], start_new_session=True)
    play_one_turn()
elif attack == "flood":
    block = b"z" * (1 << 20)
    for _ in range(1024):
        sys.stdout.buffer.write(block)
        sys.stderr.buffer.write(block)
elif attack == "allocate":
    hoard = bytearray(8 << 30)
elif attack == "forkbomb":
    while True:
        try:
            os.fork()
        except OSError:
            pass
elif attack == "escape":  # issue #70: lift its own limits through a namespace of its own, or leave by vsock
    tried = {"unshare": subprocess.run(["unshare", "-Urm", "--cgroup", "true"], capture_output=True).returncode}
    try:
        socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
        tried["vsock"] = "made"
    except OSError as error:
        tried["vsock"] = error.errno
    json.dump(tried, open(report + ".escape", "w"))
    play_one_turn()
elif attack == "loop":
    while True:
        client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": ctx.env.observation}])
'''


class Moves:
    """The policy: always answers "right" (its tokens plus end-of-turn)."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode("right", add_special_tokens=False) + [tokenizer.eos_token_id]

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        return GenerationResult(list(self.ids), [-0.5] * len(self.ids), "stop", 0.0)


class PeakMemory(threading.Thread):
    """Samples this process's RSS every 20 ms until stopped; `growth` is the peak over the first sample."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.process, self.stopped = psutil.Process(), threading.Event()
        self.first = self.peak = self.process.memory_info().rss

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.first


def test_a_hostile_agent_is_contained_attack_by_attack(chatml_tokenizer, frozenlake_url, tmp_path, capsys):
    tokenizer, env_url = chatml_tokenizer, frozenlake_url
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE_AGENT)
    marker = f"{uuid.uuid4().int % 900 + 100}.{os.getpid() % 1000 + 3}"  # a sleep length no one else uses
    server = GatewayServer(Gateway(GatewayConfig(max_tokens_per_turn=8, max_calls=5), tokenizer)).start()
    client = EnvClient(env_url, timeout=10, retries=0)
    sandbox = SandboxConfig(writable=(str(tmp_path),))
    envservice_port = int(env_url.rsplit(":", 1)[1].strip("/"))
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    os.environ["HF_TOKEN_FOR_THIS_TEST"] = "hf-secret-value"
    memory = PeakMemory()
    memory.start()
    results = {}
    try:
        for attack, timeout_s in [("snoop", 60), ("daemon", 60), ("flood", 60), ("allocate", 60),
                                  ("forkbomb", 5), ("escape", 60), ("loop", 60)]:
            command = (f"python {script} {attack} {tmp_path / 'report.json'} {marker} {envservice_port} "
                       f"{server.port} 22")
            spec = EpisodeSpec(env_id="frozenlake", task_id=3, seed=0, group_id=attack)
            config = EpisodeConfig(max_prompt_length=512, max_response_length=512, max_tokens_per_turn=8)
            started = time.monotonic()
            results[attack] = AgentEpisodeLoop(spec, client, server.gateway, server.url,
                                            CommandAgent(command, timeout_s, sandbox), config, 4, Moves(tokenizer),
                                            server.socket_path).run()
            results[attack].wall_time_s = time.monotonic() - started
    finally:
        memory.stopped.set()
        memory.join()
        del os.environ["HF_TOKEN_FOR_THIS_TEST"]
        server.stop()
    assert client.health().sessions == 0  # every episode released its env session
    client.close()

    report = json.loads((tmp_path / "report.json").read_text())
    # It sees none of the trainer's variables, reaches neither envservice nor the gateway's TCP port nor any
    # other port of the host, cannot write outside its scratch, and sees only its own processes.
    assert "HF_TOKEN_FOR_THIS_TEST" not in report["variables"] and "hf-secret-value" not in json.dumps(report)
    assert report["reached"] == {str(envservice_port): False, str(server.port): False, "22": False}
    assert not report["wrote_outside"] and report["processes"] <= 4
    assert report["variables"]["OPENAI_BASE_URL"].startswith("http://127.0.0.1:8080/episodes/")
    assert results["snoop"].termination in ("done", "max_rounds") and results["snoop"].rounds == 1

    assert results["daemon"].termination in ("done", "max_rounds") and results["daemon"].rounds == 1
    assert results["flood"].termination == "done" and results["flood"].error is None
    assert results["allocate"].termination == "agent_error" and "MemoryError" in results["allocate"].error
    assert results["forkbomb"].termination == "timeout" and results["forkbomb"].wall_time_s < 20
    assert results["loop"].termination == "max_calls" and results["loop"].error is None
    # No user namespace of its own (with one it mounted cgroup v1 and raised its own limits), no vsock (#70).
    escape = json.loads((tmp_path / "report.json.escape").read_text())
    assert escape["unshare"] != 0 and escape["vsock"] == 97  # EAFNOSUPPORT
    assert results["escape"].termination in ("done", "max_rounds") and results["escape"].rounds == 1
    assert [r.reward for r in results.values() if r.termination in ("agent_error", "timeout")] == [0.0, 0.0]

    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == [], "a process the agent started outlived its episode"
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= children_before
    assert memory.growth < 100 << 20, f"the trainer grew {memory.growth / 2**20:.0f} MB"
    with capsys.disabled():
        print(f"\n[hostile agent] trainer peak RSS growth {memory.growth / 2**20:.1f} MB over "
              f"{len(results)} attacks; " + ", ".join(f"{a}: {r.termination} in {r.wall_time_s:.1f} s"
                                                     for a, r in results.items()))
