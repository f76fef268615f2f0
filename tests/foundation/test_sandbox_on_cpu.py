"""The sandbox (issue #51): real bubblewrap, real processes. Each test is a hostile program doing one thing the
sandbox must contain, and asserts the containment, not just that the program failed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import uuid
import warnings
from pathlib import Path

import psutil
import pytest

import sandbox.run as sandbox_run
from sandbox import SandboxConfig, SandboxUnavailable, run_sandboxed


def python(code: str, config: SandboxConfig | None = None, wall_s: float = 30, **kwargs):
    return run_sandboxed(["python", "-c", code], config or SandboxConfig(), wall_s=wall_s, **kwargs)


def test_the_environment_is_the_allowlist_plus_what_is_given_on_purpose(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("MY_TOOL_KEY", "given-on-purpose")
    config = SandboxConfig(pass_env=("MY_TOOL_KEY", "NOT_SET_ANYWHERE"), env={"MODE": "eval"})
    result = python("import os, json; print(json.dumps(dict(os.environ)))", config,
                    environment={"OPENAI_BASE_URL": "http://127.0.0.1:8080/v1"})
    assert result.returncode == 0, result.stderr.text()
    seen = __import__("json").loads(result.stdout.text())
    assert "wandb-secret" not in result.stdout.text() and "hf-secret" not in result.stdout.text()
    assert seen["MY_TOOL_KEY"] == "given-on-purpose" and seen["MODE"] == "eval"
    assert seen["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/v1"
    assert set(seen) - {"PWD"} == {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                                   "MY_TOOL_KEY", "MODE", "OPENAI_BASE_URL"}


def test_no_host_port_is_reachable_but_the_forwarded_socket_is(tmp_path):
    host_server = socket.create_server(("127.0.0.1", 0))
    host_port = host_server.getsockname()[1]
    unix_path = str(tmp_path / "gateway.sock")
    unix_server = socket.socket(socket.AF_UNIX)
    unix_server.bind(unix_path)
    os.chmod(unix_path, 0o666)
    unix_server.listen()

    def answer_once() -> None:
        connection, _ = unix_server.accept()
        connection.sendall(b"hello from outside: " + connection.recv(100))
        connection.close()

    threading.Thread(target=answer_once, daemon=True).start()
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {host_port}), timeout=2)
    print("host port reached")
except OSError as error:
    print("host port refused:", type(error).__name__)
connection = socket.create_connection(("127.0.0.1", 8080), timeout=5)
connection.sendall(b"ping")
print(connection.recv(100).decode())
"""
    result = python(code, forward={8080: unix_path})
    host_server.close()
    assert result.returncode == 0, result.stderr.text()
    assert "host port refused" in result.stdout.text() and "host port reached" not in result.stdout.text()
    assert "hello from outside: ping" in result.stdout.text()


@pytest.fixture
def home_outside_tmp():
    """A trainer's home at a host path the sandbox shows (not under /tmp, which it hides with the rest of the host's
    /tmp): /var/tmp is writable by every user, root or not."""
    home = Path(tempfile.mkdtemp(prefix="sandbox-home-", dir="/var/tmp"))
    yield home
    shutil.rmtree(home)


def test_the_host_is_read_only_the_scratch_is_private_and_the_trainers_home_hidden(tmp_path, monkeypatch,
                                                                                  home_outside_tmp):
    home = home_outside_tmp
    (home / ".netrc").write_text("machine api.wandb.ai password wandb-secret")
    monkeypatch.setenv("HOME", str(home))
    outside = Path.cwd() / f".sandbox-probe-{uuid.uuid4().hex[:8]}"  # the host, outside /tmp (the scratch)
    code = f"""
import os
try:
    open({str(outside)!r}, "w").write("escaped")
except OSError as error:
    print("write outside refused:", error.strerror)
print("home holds:", sorted(os.listdir({str(home)!r})))
open("/tmp/scratch.txt", "w").write("mine")
print("scratch:", open(os.path.join(os.environ["HOME"], "scratch.txt")).read())
"""
    result = python(code)
    assert result.returncode == 0, result.stderr.text()
    assert "write outside refused: Read-only file system" in result.stdout.text() and not outside.exists()
    assert "home holds: []" in result.stdout.text()
    assert "scratch: mine" in result.stdout.text()
    assert not (tmp_path / "scratch.txt").exists()


def test_a_fork_bomb_is_capped_and_nothing_outlives_the_sandbox():
    marker = f"{uuid.uuid4().int % 900 + 100}.{os.getpid() % 1000}"  # a sleep length no one else uses
    code = f"""
import os, subprocess, sys
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)   # a daemon that tries to outlive us
children = 0
try:
    while True:
        if os.fork() == 0:
            import time; time.sleep(60)
        children += 1
except OSError as error:
    print("fork refused after", children, type(error).__name__)
"""
    result = python(code, SandboxConfig(processes=24))
    assert result.returncode == 0, result.stderr.text()
    refused_after = int(result.stdout.text().split("fork refused after ")[1].split()[0])
    assert refused_after <= 24
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == [], "a process started in the sandbox outlived it"


def test_memory_past_the_limit_fails_inside():
    result = python("b = bytearray(8 << 30)", SandboxConfig(memory_mb=1024))
    assert result.returncode == 1 and "MemoryError" in result.stderr.text()


EMPTY_FILES_WITHOUT_END = """
import os
for i in range(300_000):
    os.close(os.open(f"/tmp/{i}", os.O_CREAT | os.O_WRONLY))
    if i % 1000 == 0:
        print(i, flush=True)
print("made them all")
"""


def test_empty_files_without_end_are_stopped_by_the_memory_group_where_there_is_one():
    """Issue #70: 200 000 inodes fitted in a 32 MiB scratch (bubblewrap sizes a tmpfs, not its inodes). A tmpfs
    inode is kernel memory charged to the sandbox's memory group, so the group bounds them: at memory_mb=128 the
    program is killed after 100 000-150 000 empty files, in about a second. Where no memory group can be made (a
    trainer that is not root, without delegated control groups), the file count's watcher stops it at 262 144 (one
    file per KiB of the 256 MiB scratch)."""
    result = python(EMPTY_FILES_WITHOUT_END, SandboxConfig(memory_mb=128))
    assert result.returncode == 137 and "made them all" not in result.stdout.text()


def test_without_any_control_group_the_files_are_counted_and_capped(monkeypatch):
    """Issue #70: where no control group can be made at all (forced here: their root is a missing folder), nothing
    charged a memory-backed folder's inodes to anyone and 300 000 empty files were made in a 32 MiB scratch; now a
    watcher counts them and kills the sandbox past one file per KiB of the folder's size (32 768 here), at most one
    look (`POLL_S`) late."""
    import sandbox.cgroups
    from sandbox.inodes import FILES_PER_MIB

    monkeypatch.setattr(sandbox.cgroups, "_ROOT", Path("/nonexistent-cgroup-root"))
    result = python(EMPTY_FILES_WITHOUT_END, SandboxConfig(scratch_mb=32))
    made = [int(line) for line in result.stdout.text().split() if line.isdigit()]
    assert result.returncode == 137 and "made them all" not in result.stdout.text()
    cap = 32 * FILES_PER_MIB
    assert cap - 1000 <= made[-1] < 2 * cap, made[-1]  # it got to the cap, and not far past it


def test_output_is_kept_as_head_and_tail_and_the_rest_counted():
    trainer = psutil.Process()
    before = trainer.memory_info().rss
    code = ("import sys; sys.stdout.write('HEAD' + 'x' * 50_000_000 + 'TAIL'); "
            "sys.stderr.write('E' * 30_000_000 + 'LAST')")
    result = python(code, SandboxConfig(output_kb=8))
    growth = trainer.memory_info().rss - before
    assert result.returncode == 0
    assert result.stdout.total == 50_000_008 and result.stdout.dropped == 50_000_008 - 8192
    assert result.stdout.head.startswith(b"HEAD") and result.stdout.tail.endswith(b"TAIL")
    assert "bytes dropped" in result.stdout.text()
    assert result.stderr.tail.endswith(b"LAST") and result.stderr.total == 30_000_004
    assert growth < 50 << 20, f"the trainer grew {growth / 2**20:.0f} MB reading 80 MB of output"


def test_the_wall_clock_kills_everything_it_started():
    marker = f"{uuid.uuid4().int % 900 + 100}.{os.getpid() % 1000 + 1}"
    result = run_sandboxed(["sh", "-c", f"sleep {marker} & sleep {marker}"], SandboxConfig(), wall_s=1)
    assert result.ended == "wall_clock" and result.returncode is None
    assert result.wall_s < 10
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_a_missing_program_is_the_commands_failure_with_a_message():
    result = run_sandboxed(["no-such-program-xyz"], SandboxConfig(), wall_s=10)
    assert result.returncode == 127 and "no-such-program-xyz" in result.stderr.text()


def test_without_bubblewrap_it_refuses_to_start_and_says_what_to_do(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox_run._bwrap_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="no `bwrap` program.*apt-get install bubblewrap.*kind: none"):
            run_sandboxed(["true"], SandboxConfig(), wall_s=5)
    finally:
        sandbox_run._bwrap_problem.cache_clear()


def test_kind_none_warns_and_still_keeps_the_environment_in(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    sandbox_run._warn_uncontained.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = python("import os; print(sorted(os.environ))", SandboxConfig(kind="none"))
    assert any("uncontained" in str(w.message) or "plain child process" in str(w.message) for w in caught)
    assert result.returncode == 0 and "AWS_SECRET_ACCESS_KEY" not in result.stdout.text()


@pytest.mark.parametrize("bad, field", [({"kind": "docker"}, "kind"), ({"memory_mb": 0}, "memory_mb"),
                                        ({"pass_env": "HF_TOKEN"}, "pass_env"), ({"env": {"A-B": "1"}}, "A-B")])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**bad)
    if "kind" in bad:
        with pytest.raises(ValueError, match="bwrap, none"):
            SandboxConfig(**bad)



def test_a_started_sandbox_talks_over_given_pipes_and_stops_with_everything_it_started():
    """`start_sandboxed`: a peer process the caller talks to over the pipe ends it passes (and nothing else of
    its own); `stop` ends it and whatever it started at once."""
    from sandbox import start_sandboxed

    marker = f"{uuid.uuid4().int % 900 + 100}.{os.getpid() % 1000 + 2}"
    read_end, write_end = os.pipe()
    other_read, other_write = os.pipe()
    try:
        code = (f"import os, subprocess; subprocess.Popen(['sleep', '{marker}']); "
                f"os.write({write_end}, ' '.join(os.listdir('/proc/self/fd')).encode()); os.system('sleep {marker}')")
        peer = start_sandboxed(["python", "-c", code], SandboxConfig(), wall_s=60, pass_fds=(write_end,))
        os.close(write_end)
        listed = os.read(read_end, 4096).decode().split()
        assert str(write_end) in listed and str(other_write) not in listed and str(other_read) not in listed
        result = peer.stop()
    finally:
        for fd in (read_end, other_read, other_write):
            os.close(fd)
    assert result.ended == "stopped" and result.returncode is None and result.wall_s < 10
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []


@pytest.fixture
def host_folder():
    """A folder the sandbox sees (the host's /tmp is hidden behind its scratch)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="beyond-sandbox-test-"))
    folder.chmod(0o755)  # mkdtemp's 0700 would close it to a sandbox that drops root
    yield folder
    shutil.rmtree(folder)


def test_hidden_paths_cannot_be_read_inside(host_folder):
    tmp_path = host_folder
    (tmp_path / "answers").mkdir()
    (tmp_path / "answers" / "key.txt").write_text("the answer")
    (tmp_path / "solutions.txt").write_text("the solution")
    code = f"""
import os
print(os.listdir({str(tmp_path / 'answers')!r}))
for path in ({str(tmp_path / 'answers' / 'key.txt')!r}, {str(tmp_path / 'solutions.txt')!r}):
    try:
        print(open(path).read())
    except OSError as error:
        print(type(error).__name__)
"""
    hidden = SandboxConfig(hidden=(str(tmp_path / "answers"), str(tmp_path / "solutions.txt"), "/no/such/path"))
    seen = python(code, hidden)
    assert seen.returncode == 0, seen.stderr.text()
    assert seen.stdout.text().split() == ["[]", "FileNotFoundError", "PermissionError"]
    assert "the answer" in python(code).stdout.text()  # not hidden: readable


def test_files_and_sockets_only_root_may_open_stay_closed_when_the_trainer_is_root(host_folder):
    """Issue #70: with the trainer as root, bubblewrap mapped the sandbox's user to root outside, and a sandboxed
    program read a mode-0600 root file, /etc/shadow and connected to a root-only socket. Now it is nobody outside
    (sandbox/outside_user.py), with no capabilities, while a writable folder the trainer made stays writable."""
    root_only = host_folder / "root-only"
    root_only.mkdir(mode=0o700)
    (root_only / "key").write_text("root's key")
    (host_folder / "key.pem").write_text("root's pem")
    (host_folder / "key.pem").chmod(0o600)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(host_folder / "root.sock"))
    (host_folder / "root.sock").chmod(0o700)
    listener.listen()
    workspace = host_folder / "workspace"
    workspace.mkdir(mode=0o700)
    (workspace / "task.txt").write_text("edit me")
    code = f"""
import json, os, socket
def try_open(path):
    try:
        return open(path).read()
    except OSError as error:
        return type(error).__name__
def try_connect(path):
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        return "connected"
    except OSError as error:
        return type(error).__name__
open({str(workspace / 'task.txt')!r}, "a").write(" - edited")
open({str(workspace / 'made.txt')!r}, "w").write("new")
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({{"shadow": try_open("/etc/shadow"), "pem": try_open({str(host_folder / 'key.pem')!r}),
                  "folder": try_open({str(root_only / 'key')!r}), "socket": try_connect({str(host_folder / 'root.sock')!r}),
                  "uid": os.getuid(), "caps": status["CapEff"].strip(), "bounding": status["CapBnd"].strip()}}))
"""
    try:
        result = python(code, SandboxConfig(writable=(str(workspace),)))
    finally:
        listener.close()
    assert result.returncode == 0, result.stderr.text()
    seen = json.loads(result.stdout.text())
    closed = "PermissionError"
    assert seen["shadow"] == closed
    if os.geteuid() == 0:  # the files and socket are root's only when the trainer is root
        assert (seen["pem"], seen["folder"], seen["socket"]) == (closed, closed, closed)
    assert (seen["uid"], seen["caps"], seen["bounding"]) == (1000, "0000000000000000", "0000000000000000")
    assert (workspace / "task.txt").read_text() == "edit me - edited"
    made = (workspace / "made.txt").lstat()
    assert made.st_uid == (65534 if os.geteuid() == 0 else os.geteuid()) and stat.S_ISREG(made.st_mode)


# ---- Round two (issue #70): no way to lift its own limits, nothing of the host's shown ------------------------------

ATTACKS = r'''
import ctypes, errno, json, os, socket, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    result = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
def sock(family, kind=socket.SOCK_STREAM):
    try:
        socket.socket(family, kind).close()
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
def read(path):
    try:
        return open(path, "rb").read().decode(errors="replace")
    except OSError as error:
        return errno.errorcode[error.errno]
def write(path, megabytes):
    try:
        with open(path, "wb") as handle:
            for _ in range(megabytes):
                handle.write(b"x" * (1 << 20))
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
sleeper = subprocess.Popen(["sleep", "30"])
found = {
    "unshare a user namespace": call(272, 0x10000000),                 # unshare(CLONE_NEWUSER)
    "unshare a mount namespace": call(272, 0x00020000),                # unshare(CLONE_NEWNS)
    "clone into a user namespace": call(56, 0x10000000 | 17, 0, 0, 0, 0),  # clone(CLONE_NEWUSER | SIGCHLD)
    "mount a tmpfs": call(165, 0, 0, 0, 0, 0),
    "io_uring_setup": call(425, 1, 0),
    "keyctl": call(250, 0, 0, 0, 0, 0),
    "add_key": call(248, 0, 0, 0, 0, 0),
    "bpf": call(321, 0, 0, 0),
    "perf_event_open": call(298, 0, 0, -1, -1, 0),
    "userfaultfd": call(323, 0),
    "ptrace attach to a process it did not start": call(101, 16, sleeper.pid, 0, 0),
    "an AF_VSOCK socket": sock(40),
    "an AF_NETLINK socket": sock(socket.AF_NETLINK, socket.SOCK_RAW),
    "an AF_PACKET socket": sock(socket.AF_PACKET, socket.SOCK_RAW),
    "an AF_UNIX socket": sock(socket.AF_UNIX),
    "an AF_INET socket": sock(socket.AF_INET),
    "an AF_INET6 socket": sock(socket.AF_INET6),
    "70 MB into /dev/shm": write("/dev/shm/fill", 70),
    "a file in /run": write("/run/file", 1),
    "bubblewrap's environment": read("/proc/1/environ"),
    "/sys": sorted(os.listdir("/sys")),
    "a file at /": write("/file", 1),
    "mounts": [line.split()[2:5] + [line.split(" - ")[1].split()[0]] for line in open("/proc/self/mountinfo")],
    "a child process still forks": subprocess.run(["true"]).returncode,
}
sleeper.kill()
print(json.dumps(found))
'''
REFUSED = {"EPERM"}


def test_from_inside_the_sandbox_cannot_lift_its_own_limits_or_read_the_hosts():
    """Each a hostile program's attempt from inside (issue #70): new user or mount namespaces (with which a program
    mounted cgroup v1 and raised its own pids.max and memory limit), mount, io_uring, keyrings, bpf, perf, userfaultfd,
    attaching to a process it did not start, sockets of families without a route (AF_VSOCK reached the VM's transport),
    filling /dev/shm and /run past any cap, and reading the control groups' paths from bubblewrap's environment or the
    host's interfaces from /sys. Each is refused or shows nothing; what programs need still works."""
    result = python(ATTACKS, SandboxConfig(file_size_mb=128))  # files may be large: /dev/shm's own cap must stop it
    assert result.returncode == 0, result.stderr.text()
    _assert_each_attack_refused(json.loads(result.stdout.text()))


def _assert_each_attack_refused(found: dict):
    for attempt in ("unshare a user namespace", "unshare a mount namespace", "clone into a user namespace",
                    "mount a tmpfs", "io_uring_setup", "keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd",
                    "ptrace attach to a process it did not start"):
        assert found[attempt] == "EPERM", (attempt, found[attempt])
    for family in ("an AF_VSOCK socket", "an AF_NETLINK socket", "an AF_PACKET socket"):
        assert found[family] == "EAFNOSUPPORT", (family, found[family])
    assert [found[f"an {name} socket"] for name in ("AF_UNIX", "AF_INET", "AF_INET6")] == ["ok", "ok", "ok"]
    assert found["70 MB into /dev/shm"] == "ENOSPC" and found["a file in /run"] == "EROFS"
    assert "cgroup" not in found["bubblewrap's environment"] and found["/sys"] == []
    assert found["a file at /"] == "EROFS"
    _assert_no_host_mount_under_what_the_sandbox_makes_fresh(found["mounts"])
    assert found["a child process still forks"] == 0


def _assert_no_host_mount_under_what_the_sandbox_makes_fresh(inside: list[list[str]]):
    """mountinfo inside (device, root, mount point, type) shows none of the host's mounts under the folders the
    sandbox makes its own (the host's control groups, /dev/shm, devpts, /proc, ...: before, it listed them all), and
    its root is its own, not the host's; what stays are the mounts under the folders it shows anyway."""
    host = [line.split()[2:5] for line in open("/proc/self/mountinfo")]
    device_of = {point: device for device, _, point in host}
    shared = {device_of["/"], device_of.get("/dev")}  # binds of the host's folders and of its device nodes
    hidden = {device for device, _, point in host if device not in shared
              and any(point == top or point.startswith(top + "/") for top in sandbox_run.MADE_FRESH)}
    assert hidden, "this machine has host mounts under /dev, /proc or /sys to hide"
    assert not [mount for mount in inside if mount[0] in hidden]
    assert [mount[3] for mount in inside if mount[2] == "/"] == ["tmpfs"]


AS_AN_UNPRIVILEGED_TRAINER = r"""
import json, sys
from sandbox import SandboxConfig, run_sandboxed
attacks, files = sys.argv[1:]
def run(code, **config):
    result = run_sandboxed(["python3", "-c", code], SandboxConfig(**config), wall_s=60)
    return {"returncode": result.returncode, "stdout": result.stdout.text(), "stderr": result.stderr.text()}
print(json.dumps({"attacks": run(attacks, file_size_mb=128), "files": run(files, scratch_mb=32),
                  "shadow": run("open('/etc/shadow')")}))
"""


@pytest.fixture
def unprivileged_copy():
    """A copy of the sandbox package (and its one dependency, libseccomp's binding) where any user can read it, and
    an interpreter any user can run: the trainer's may sit under a home only its owner can enter."""
    import pyseccomp

    folder = Path(tempfile.mkdtemp(prefix="sandbox-unprivileged-", dir="/var/tmp"))
    shutil.copytree(Path(sandbox_run.__file__).parent, folder / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(pyseccomp.__file__, folder)
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield folder
    shutil.rmtree(folder)


def test_a_trainer_that_is_not_root_gets_the_same_containment(unprivileged_copy):
    """The same attacks as a trainer that is not root (bubblewrap makes the user namespace itself, and no control
    group can be made, so the file count's watcher caps the scratch's inodes): run as `nobody` when the suite runs as
    root (CI does), so the path a cluster user takes is tested on every run."""
    interpreter = "/usr/bin/python3"
    assert os.access(interpreter, os.X_OK), "Debian's python3 runs the unprivileged trainer"
    become = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"] if os.geteuid() == 0 else []
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(unprivileged_copy),
           "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([*become, interpreter, "-c", AS_AN_UNPRIVILEGED_TRAINER, ATTACKS, EMPTY_FILES_WITHOUT_END],
                          capture_output=True, text=True, env=env, cwd="/", timeout=300)
    if done.returncode != 0:
        # A kernel that refuses user namespaces to unprivileged users: the sandbox must refuse to start, saying so.
        assert "SandboxUnavailable" in done.stderr and "cannot run here" in done.stderr, done.stderr
        return
    seen = json.loads(done.stdout)
    assert seen["attacks"]["returncode"] == 0, seen["attacks"]["stderr"]
    _assert_each_attack_refused(json.loads(seen["attacks"]["stdout"]))
    made = [int(line) for line in seen["files"]["stdout"].split() if line.isdigit()]
    assert seen["files"]["returncode"] == 137 and made[-1] < 2 * 32 * 1024, made[-1]
    assert "PermissionError" in seen["shadow"]["stderr"]
