"""The sandbox's seccomp filter: the system calls a sandboxed program never needs are refused (issue #70).

Tried from inside a sandbox as a hostile program, these rewrote the sandbox's own limits or reached past it: a
nested user namespace with every capability (`unshare -Urm`, then mounting a cgroup v1 hierarchy and writing the
group's own `pids.max` and memory limit), `io_uring`, and an `AF_VSOCK` socket that reached the VM's transport.
So the filter refuses, with an error (EPERM, or EAFNOSUPPORT for a socket family), never by killing:

- new namespaces and changes of them: `unshare`, `setns`, `clone`/`clone3` asking for a namespace (`clone3` is
  refused as unavailable, ENOSYS, so that the C library falls back to `clone`, whose flags the filter can read),
  `mount`, `umount2`, `pivot_root`, `chroot`, `open_by_handle_at`;
- kernel interfaces a program never needs here: `keyctl`, `add_key`, `request_key`, `bpf`, `perf_event_open`,
  `userfaultfd`, `io_uring_setup`, `io_uring_enter`, `io_uring_register`, `kexec_load`, `init_module`,
  `finit_module`, `delete_module`;
- `ptrace` attaching to a process it did not start (`PTRACE_ATTACH`, `PTRACE_SEIZE`): a debugger that runs its own
  child still works;
- sockets of families other than `AF_UNIX`, `AF_INET` and `AF_INET6` (which have no route but the sandbox's own
  loopback anyway): `AF_VSOCK`, `AF_NETLINK`, `AF_PACKET`...

System calls of another architecture's ABI (32-bit calls from an x86_64 process) kill the process: the filter is
written for the machine's own. The filter is compiled once per process with libseccomp's binding (`pyseccomp`) and
handed to bubblewrap as a file descriptor (`--seccomp FD`).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

REFUSED_CALLS = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_by_handle_at", "keyctl",
                 "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                 "io_uring_enter", "io_uring_register", "kexec_load", "init_module", "finit_module", "delete_module")
"""Refused with EPERM whatever their arguments."""
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)
"""AF_UNIX, AF_INET, AF_INET6: every other family's socket is refused (EAFNOSUPPORT)."""
NAMESPACE_FLAGS = (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x08000000, 0x04000000, 0x02000000)
"""CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP."""
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206


@functools.cache
def filter_program() -> bytes:
    """The compiled BPF program (cached: the rules do not change within a process)."""
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    refuse = seccomp.ERRNO(errno.EPERM)
    for call in REFUSED_CALLS:
        rules.add_rule(refuse, call)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags are in memory: the filter cannot read them
    for flag in NAMESPACE_FLAGS:  # one rule per flag: a clone asking for any of them is refused
        rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for request in (PTRACE_ATTACH, PTRACE_SEIZE):
        rules.add_rule(refuse, "ptrace", seccomp.Arg(0, seccomp.EQ, request))
    for call in ("socket", "socketpair"):
        _refuse_families(rules, seccomp, call)
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()


def _refuse_families(rules, seccomp, call: str) -> None:
    """Refuse `call` for every family but the allowed ones: each smaller family by name, every larger one at once
    (libseccomp compares an argument once per rule)."""
    unsupported = seccomp.ERRNO(errno.EAFNOSUPPORT)
    for family in range(max(ALLOWED_SOCKET_FAMILIES)):
        if family not in ALLOWED_SOCKET_FAMILIES:
            rules.add_rule(unsupported, call, seccomp.Arg(0, seccomp.EQ, family))
    rules.add_rule(unsupported, call, seccomp.Arg(0, seccomp.GT, max(ALLOWED_SOCKET_FAMILIES)))


def program_fd() -> int:
    """A fresh file descriptor holding the compiled program at offset 0 (bubblewrap reads it and closes its copy;
    the caller closes this one once the sandbox started)."""
    fd = os.memfd_create("beyond-sandbox-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
