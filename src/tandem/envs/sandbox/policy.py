"""What a sandboxed program may reach: the files of its root and the system calls it may make.

`interpreter_files()` lists what the interpreter needs, read-only: its executable, its install's
library directory (the standard library, libpython) and the system's shared-library directories
(plus /etc/ld.so.cache), with every site-packages / dist-packages directory and every entry of
this process's sys.path under them hidden. Nothing else of the host is in the program's root: no
/etc, no home, no project, no run directory, no tandem (and so none of its data files).

`seccomp_program()` compiles the system-call filter with libseccomp (through pyseccomp) to BPF;
the runner or bwrap loads it as the last step before the program. It refuses with EPERM: mount
and every other mount-API call, pivot_root, chroot, unshare, setns and clone into new namespaces,
ptrace, process_vm_readv/writev, the pidfd calls, io_uring (it would run calls outside the filter),
bpf, perf_event_open, userfaultfd, keyrings, kernel modules, kexec, reboot, swap, quotas,
open_by_handle_at, syslog; memfd_create and System V shared memory, message queues and
semaphores (memory outside RLIMIT_AS: a detached segment lives until its IPC namespace ends);
prctl(PR_SET_PDEATHSIG), which would untie a process from the runner whose death must kill it;
socket() and socketpair() of every family the task did not allow (none by default, AF_UNIX
included); and, unless the task allows processes, fork, vfork and clone without CLONE_THREAD
(threads still work; clone3 answers ENOSYS so libc uses clone, whose flags a filter can read).
System calls of another ABI (x32, i386 on x86_64) are refused.
"""

import errno
import glob
import os
import socket
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import cache

SYSTEM_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32")
ALWAYS_DENIED = (
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv",
    "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "open_by_handle_at",
    "name_to_handle_at", "syslog", "lookup_dcookie", "uselib", "iopl", "ioperm", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime",
    # memory that no process maps, so RLIMIT_AS does not count it (SysV segments outlive shmdt)
    "memfd_create", "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl",
)  # fmt: skip
UNKNOWN_TO_LIBSECCOMP = -1  # __NR_SCMP_ERROR
UNIFIED_NUMBERS = {  # calls added since Linux 5.1 have one number on every architecture
    "pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "pidfd_open": 434, "clone3": 435, "pidfd_getfd": 438, "mount_setattr": 442, "quotactl_fd": 443,
}  # fmt: skip
CLONE_THREAD = 0x00010000
PR_SET_PDEATHSIG = 1
INT_MASK = 0xFFFFFFFF  # prctl's option is an int: the kernel ignores the upper 32 bits
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
SOCKET_FAMILIES = {"AF_UNIX": socket.AF_UNIX, "AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6}


@dataclass(frozen=True)
class RootFiles:
    mounts: tuple[str, ...]
    """Real paths bound read-only at the same path (files or directories)."""
    symlinks: tuple[tuple[str, str], ...]
    """(path, target): symbolic links recreated in the root (e.g. /lib -> usr/lib)."""
    hidden: tuple[str, ...]
    """Directories under the mounts covered by an empty read-only tmpfs."""
    python: str
    """The interpreter's executable (a real path inside `mounts`)."""


def _covered(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@cache
def interpreter_files() -> RootFiles:
    python = os.path.realpath(sys.executable)
    wanted = [python, sysconfig.get_paths()["stdlib"], sysconfig.get_config_var("LIBDIR") or ""]
    symlinks = []
    for path in SYSTEM_LIBRARY_DIRS:
        if os.path.islink(path):
            symlinks.append((path, os.readlink(path)))
        if os.path.isdir(path):
            wanted.append(path)
    wanted.append("/etc/ld.so.cache")
    real = sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)}, key=len)
    mounts: list[str] = []
    for path in real:  # shortest first: drop paths inside one already mounted
        if not _covered(path, mounts):
            mounts.append(path)
    dirs = [m for m in mounts if os.path.isdir(m)]
    paths = sysconfig.get_paths()
    standard = {paths["stdlib"], paths["platstdlib"], sysconfig.get_config_var("DESTSHARED") or ""}
    standard = {os.path.realpath(p) for p in standard if p}
    hidden = {  # site-packages and the like; other sys.path entries (a project's source) too
        os.path.realpath(p)
        for d in dirs
        for pattern in ("*-packages", "python3*/*-packages")
        for p in glob.glob(os.path.join(d, pattern))
        if os.path.isdir(p)
    }
    for entry in sys.path:
        path = os.path.realpath(entry or ".")
        inside_standard = any(_covered(s, [path]) for s in standard)
        if os.path.isdir(path) and _covered(path, dirs) and not inside_standard:
            hidden.add(path)
    symlinks = [
        (p, t) for p, t in symlinks if os.path.realpath(p) in mounts or _covered(os.path.realpath(p), dirs)
    ]
    return RootFiles(tuple(mounts), tuple(symlinks), tuple(sorted(hidden)), python)


@cache
def seccomp_program(socket_families: tuple[str, ...] = (), processes: bool = False) -> bytes:
    """The filter as BPF bytes for this machine's architecture (see the module docstring)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as e:  # pyseccomp raises RuntimeError without libseccomp
        raise OSError(
            f"libseccomp is unavailable ({e}): install libseccomp2 (apt) or libseccomp (dnf)"
        ) from None
    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    rules.set_attr(seccomp.Attr.ACT_BADARCH, deny)

    def add(action: int, name: str, *args: object) -> None:
        number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
        if number == UNKNOWN_TO_LIBSECCOMP:
            number = UNIFIED_NUMBERS.get(name, number)  # newer than this libseccomp
        if number != UNKNOWN_TO_LIBSECCOMP:
            rules.add_rule(action, number, *args)

    for name in ALWAYS_DENIED:
        add(deny, name)
    add(seccomp.ERRNO(errno.ENOSYS), "clone3")
    add(deny, "prctl", seccomp.Arg(0, seccomp.MASKED_EQ, INT_MASK, PR_SET_PDEATHSIG))
    for flag in CLONE_NEW_FLAGS:
        add(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    if not processes:
        add(deny, "fork")
        add(deny, "vfork")
        add(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    allowed = {SOCKET_FAMILIES[f] for f in socket_families}
    top = max(SOCKET_FAMILIES.values())
    for name in ("socket", "socketpair"):
        add(deny, name, seccomp.Arg(0, seccomp.GT, top))
        for family in range(top + 1):
            if family not in allowed:
                add(deny, name, seccomp.Arg(0, seccomp.EQ, family))
    with tempfile.TemporaryFile() as f:
        rules.export_bpf(f)
        f.seek(0)
        return f.read()
