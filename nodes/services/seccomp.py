"""The sandbox's seccomp filter: system calls a sandboxed program never needs, refused with ``EPERM``.

Built once with libseccomp (through ``ctypes``; the system's ``libseccomp.so.2``) and exported as a BPF
program that bubblewrap loads (``--seccomp FD``) right before it executes the interpreter. Everything else
is allowed: the namespaces and limits contain the program; the filter takes away the kernel interfaces
that attacks on those start from (tracing other processes, new namespaces, mounts, keyrings, eBPF, perf
events, userfaultfd, io_uring, kernel modules). System calls of another architecture's ABI (``int 0x80``)
kill the process (libseccomp's default for an architecture the filter does not name).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

__all__ = ["DENIED", "seccomp_filter"]

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root",
    "chroot", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct", "open_by_handle_at",
    "name_to_handle_at", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "quotactl",
    "lookup_dcookie", "fanotify_init", "move_mount", "open_tree", "fsopen", "fsmount",
)  # fmt: skip
"""The system calls the filter refuses (``EPERM``)."""

_ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
_ERRNO = 0x00050000  # SCMP_ACT_ERRNO(e) = _ERRNO | e


def seccomp_filter() -> tuple[bytes | None, str]:
    """``(bpf, why)``: the filter's BPF program, or ``None`` and why it cannot be built (no libseccomp)."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None, "libseccomp not found"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        return None, "seccomp_init failed"
    fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
    try:
        for call in DENIED:
            number = lib.seccomp_syscall_resolve_name(call.encode())
            if number >= 0 and lib.seccomp_rule_add(ctx, _ERRNO | errno.EPERM, number, 0) != 0:
                return None, f"seccomp_rule_add({call}) failed"
        if lib.seccomp_export_bpf(ctx, fd) != 0:
            return None, "seccomp_export_bpf failed"
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks), ""
    finally:
        os.close(fd)
        lib.seccomp_release(ctx)
