"""Run untrusted Python (a model's code) in a subprocess that cannot harm the run.

`await Sandbox(limits).run(source, files)` writes `source` as `main.py` (and `files`) into a fresh
temporary directory, runs it there and returns exit code, capped stdout/stderr and whether it timed
out. The directory is removed afterwards; at most `max_concurrent` programs run at once, and the
event loop is never blocked (asyncio subprocesses).

The child is this file run as a script (`python -I -S sandbox.py CONFIG`, standard library only):
it applies the layers below to itself, then executes `main.py`. What each layer guarantees:

1. Process limits (kernel, always on). A new session, SIGKILLed as a whole group at the wall-clock
   timeout; RLIMIT_CPU, RLIMIT_AS (memory: a 10 GB allocation raises MemoryError), RLIMIT_FSIZE,
   RLIMIT_NOFILE, no core dumps, RLIMIT_NPROC (Linux does not apply it to root); stdin is
   /dev/null; the environment is scrubbed to PATH, HOME, TMPDIR and LANG; stdout and stderr are
   kept up to `output_bytes` each (the rest is read and dropped). `-I -S`: no site-packages, no
   user paths, PYTHON* variables ignored; only the standard library and the directory's files.
2. A seccomp filter (kernel, always on for x86_64 and aarch64; needs no privileges): no new
   processes (fork, vfork, clone without CLONE_THREAD; clone3 answers ENOSYS so libc falls back
   to clone), no IPv4/IPv6 sockets, no io_uring, ptrace or process_vm_writev. Threads still work.
   This is what stops a fork bomb for root too, and the network when namespaces are unavailable.
3. Namespaces (kernel, when the system allows user namespaces: `isolation_status()` checks once).
   New user, network, mount and PID namespaces: no network at all (an empty network namespace);
   every mount read-only except the working directory (so no writes to /tmp, /dev/shm or the run
   directory); the program is PID 1 of its own PID namespace with a fresh /proc (it sees and can
   signal only its own processes, and when its parent runner is killed the kernel kills
   everything inside). Without user namespaces (some containers, AppArmor policies)
   `isolation="auto"` falls back to layers 1, 2 and 4 and says so once in the log;
   `isolation="require"` refuses to run instead.
4. An audit hook (Python, installed before the program runs; hooks cannot be removed). It refuses
   sockets, subprocesses, exec/spawn/fork/kill, importing ctypes/_ctypes/_posixsubprocess, every
   ctypes event, creating code objects by hand, and writes (open for writing, remove, rename,
   mkdir, chmod, links, truncate) outside the working directory, with a clear PermissionError.
   An audit hook is NOT a security boundary: code that reaches native execution (a crafted code
   object, an interpreter bug) bypasses it. The runner's own ctypes (for layers 2 and 3) is
   removed from sys.modules before the program starts, so `import ctypes` is a new import the
   hook refuses, and calls through any leftover ctypes object raise `ctypes.call_function`, also
   refused. With namespaces the hook is defence in depth; without them it is the only guard
   against writes outside the directory and signals to other processes of the same user, so
   treat a sandbox without isolation as protection against accidents and small models, not
   against a determined adversary. Started as root, the program keeps root's permission to READ
   files (e.g. /root); writing is confined as above.
"""

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any, Literal

log = logging.getLogger(__name__)
SETUP_FAILED = 125  # exit code of a runner whose sandbox set-up failed (message on stderr)
KILL_GRACE_S = 2.0  # after SIGKILL, how long to wait for the pipes to close


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    """Address space (RLIMIT_AS) of the program; Python itself needs ~30 MB."""
    max_processes: int = 8
    """Processes and threads inside the sandbox (RLIMIT_NPROC; not enforced for root)."""
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1_000_000
    """Per stream; more is read and dropped."""


@dataclass
class SandboxResult:
    exit_code: int | None
    """The program's exit code (128 + N when killed by signal N); None when timed out."""
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    seconds: float
    isolated: bool
    """Whether the namespace layer was on."""
    error: str | None = None
    """Why the sandbox itself failed to set up (then the program never ran)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """The sandbox cannot run as configured (e.g. isolation required but unavailable)."""


Isolation = Literal["auto", "require", "off"]


class Sandbox:
    def __init__(
        self,
        limits: Limits = Limits(),
        max_concurrent: int = 4,
        isolation: Isolation = "auto",
        audit_hook: bool = True,
    ) -> None:
        """`audit_hook=False` leaves only the kernel layers (tests use it to check them alone)."""
        self.limits = limits
        self.audit_hook = audit_hook
        self.max_concurrent = max_concurrent
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.isolate = False
        if isolation != "off":
            available, reason = isolation_status()
            if not available and isolation == "require":
                raise SandboxError(f"sandbox isolation is required but unavailable: {reason}")
            self.isolate = available

    def slots(self) -> asyncio.Semaphore:
        """The concurrency limit of the running event loop (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._slots[1]

    async def run(self, source: str, files: Mapping[str, str] | None = None) -> SandboxResult:
        """Run `source` as main.py in a fresh directory holding `files` (name → text)."""
        async with self.slots():
            workdir = tempfile.mkdtemp(prefix="tandem-sandbox-")
            try:
                for name, text in {**(files or {}), "main.py": source}.items():
                    path = os.path.realpath(os.path.join(workdir, name))
                    if os.path.dirname(path) != os.path.realpath(workdir):
                        raise ValueError(f"sandbox file name {name!r} must be a plain file name")
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(text)
                return await self.execute(workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    async def execute(self, workdir: str) -> SandboxResult:
        # The runner reports its set-up on its own pipe and closes it before the program starts,
        # so a program cannot pass itself off as a set-up failure (or the other way round).
        status_r, status_w = os.pipe()
        config = {
            "limits": asdict(self.limits),
            "isolate": self.isolate,
            "audit": self.audit_hook,
            "workdir": workdir,
            "status_fd": status_w,
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        start = time.perf_counter()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-B", __file__, json.dumps(config),
                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_w,),
            )  # fmt: skip
        finally:
            os.close(status_w)
        cap = self.limits.output_bytes
        readers = [asyncio.ensure_future(read_capped(s, cap)) for s in (process.stdout, process.stderr)]
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.limits.wall_seconds)
        except TimeoutError:
            timed_out = True
        finally:
            kill_group(process.pid)  # also stops anything the program left behind
        if process.returncode is None:
            await asyncio.wait_for(process.wait(), KILL_GRACE_S)
        done, pending = await asyncio.wait(readers, timeout=KILL_GRACE_S)
        for reader in pending:  # an escaped descendant holds the pipe open: stop listening
            reader.cancel()
        (out, out_cut), (err, err_cut) = (r.result() if r in done else (b"", True) for r in readers)
        status = read_status(status_r)
        code = process.returncode
        return SandboxResult(
            exit_code=None if timed_out else (128 - code if code is not None and code < 0 else code),
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            output_truncated=out_cut or err_cut,
            seconds=time.perf_counter() - start,
            isolated=self.isolate,
            error=None if status == "ok" else status or "the sandbox runner ended before its set-up finished",
        )


def read_status(fd: int) -> str:
    """What the runner wrote on its status pipe ('ok' or why its set-up failed); closes `fd`."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    except BlockingIOError:  # nothing written, and somebody still holds the pipe
        return ""
    finally:
        os.close(fd)


async def read_capped(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    """Everything the stream says up to `cap` bytes, and whether there was more."""
    kept, size = bytearray(), 0
    while stream is not None and (chunk := await stream.read(65536)):
        if size < cap:
            kept += chunk[: cap - size]
        size += len(chunk)
    return bytes(kept), size > cap


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@cache
def isolation_status() -> tuple[bool, str]:
    """Whether this machine allows the namespace layer (checked once by running the set-up)."""
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-probe-") as workdir:
        config = {"limits": asdict(Limits()), "isolate": True, "workdir": workdir, "probe": True}
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", "-B", __file__, json.dumps(config)],
                cwd=workdir, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False, "the namespace set-up did not finish within 30 s"
    if done.returncode == 0:
        return True, "user, network, mount and PID namespaces"
    reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    log.warning("sandbox: no namespace isolation (%s); using process limits and an audit hook only", reason)
    return False, reason


# --- the child side: runs as `python -I -S sandbox.py CONFIG` with the working directory as cwd ---


def set_limits(limits: dict[str, Any]) -> None:
    mb = 1 << 20
    for which, value in [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, limits["cpu_seconds"]),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
    ]:
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, then SIGKILL
        resource.setrlimit(which, (value, hard))


def enter_namespaces(workdir: str, status_fd: int | None) -> None:
    """New user, network, mount and PID namespaces; all mounts read-only except `workdir`.

    Returns in a forked child that is PID 1 of the new PID namespace; the runner closes its copy
    of `status_fd`, waits for that child and exits with its status."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    class MountAttr(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

    def set_readonly(path: str, readonly: bool) -> None:
        attr = MountAttr(1 if readonly else 0, 0 if readonly else 1, 0, 0)  # MOUNT_ATTR_RDONLY = 1
        # mount_setattr(AT_FDCWD, path, AT_RECURSIVE, attr, size): syscall 442 on every Linux arch
        check(libc.syscall(442, -100, path.encode(), 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)), path)

    uid, gid = os.geteuid(), os.getegid()
    clone_newuser, clone_newnet, clone_newns, clone_newpid = 0x10000000, 0x40000000, 0x00020000, 0x20000000
    check(libc.unshare(clone_newuser | clone_newnet | clone_newns | clone_newpid), "unshare")
    for name, text in [("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")]:
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    ms_bind, ms_rec, ms_private = 0x1000, 0x4000, 1 << 18
    check(libc.mount(None, b"/", None, ms_rec | ms_private, None), "make mounts private")
    check(libc.mount(workdir.encode(), workdir.encode(), None, ms_bind | ms_rec, None), "bind workdir")
    set_readonly("/", True)
    set_readonly(workdir, False)
    os.chdir(workdir)  # the old cwd is the directory on the now read-only mount, not the bind mount

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:  # the runner: wait for PID 1 of the namespace and pass on how it ended
        os.close(ready_r)
        if status_fd is not None:
            os.close(status_fd)
        os.write(ready_w, b"x")
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    os.close(ready_w)
    check(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")  # the runner dies → we die
    if os.read(ready_r, 1) != b"x":  # the runner died before PDEATHSIG was armed
        os._exit(SETUP_FAILED)
    os.close(ready_r)
    ms_nosuid, ms_nodev, ms_noexec = 2, 4, 8
    libc.mount(b"proc", b"/proc", b"proc", ms_nosuid | ms_nodev | ms_noexec, None)  # best effort


# machine → (AUDIT_ARCH, clone, clone3, socket, syscalls refused outright: fork, vfork,
# io_uring_setup (it can open sockets), ptrace, process_vm_writev)
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, 56, 435, 41, (57, 58, 425, 101, 311)),
    "aarch64": (0xC00000B7, 220, 435, 198, (425, 117, 271)),
}


def install_seccomp() -> bool:
    """A kernel syscall filter: new processes (fork, vfork, clone without CLONE_THREAD) and IPv4/IPv6
    sockets fail with EPERM; clone3 fails with ENOSYS so libc falls back to clone, whose flags a
    filter can read; threads stay allowed. Returns False (no filter) on other architectures."""
    import ctypes

    arch = SECCOMP_ARCHES.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, clone, clone3, socket_nr, refused = arch
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, RET|K
    nr, arch_field, arg0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low word, little-endian)
    program = [
        (ld, 0, 0, arch_field), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm),  # other ABIs: refused
        (ld, 0, 0, nr), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm),  # x32 syscalls: refused
        *[instruction for number in refused for instruction in ((jeq, 0, 1, number), (ret, 0, 0, eperm))],
        (jeq, 0, 1, clone3), (ret, 0, 0, enosys),
        (jeq, 0, 4, clone), (ld, 0, 0, arg0), (jset, 0, 1, 0x00010000), (ret, 0, 0, allow), (ret, 0, 0, eperm),
        (jeq, 0, 4, socket_nr), (ld, 0, 0, arg0), (jeq, 1, 0, 2), (jeq, 0, 1, 10), (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]  # fmt: skip

    class Filter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*program)
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    for args in [
        (pr_set_no_new_privs, 1, 0, 0, 0),
        (pr_set_seccomp, seccomp_mode_filter, ctypes.byref(Program(len(program), filters)), 0, 0),
    ]:
        if libc.prctl(*args) != 0:
            raise OSError(ctypes.get_errno(), f"seccomp: {os.strerror(ctypes.get_errno())}")
    return True


def forget_ctypes() -> None:
    """Drop the set-up's ctypes modules, so the program's `import ctypes` is a new import that the
    audit hook refuses."""
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


BLOCKED_EVENTS = (
    "socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.system", "os.kill", "os.killpg", "os.startfile", "pty.", "ctypes.", "code.__new__",
)  # fmt: skip
BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess"}
PATH_EVENTS = {  # event → indices of path arguments that must stay inside the working directory
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.chmod": (0,),
    "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
    "os.chflags": (0,), "os.lchflags": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
}  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_audit_hook(workdir: str) -> None:
    root = os.path.realpath(workdir)
    busy = False

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True  # an already open file descriptor
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        nonlocal busy
        if busy:
            return
        busy = True
        try:
            if event.startswith(BLOCKED_EVENTS) or (event == "import" and args[0] in BLOCKED_IMPORTS):
                what = f"import {args[0]}" if event == "import" else event
                raise PermissionError(f"sandbox: {what} is not allowed")
            if event == "open":
                path, mode, flags = args
                writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
                if writing and not inside(path):
                    raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
            elif event in PATH_EVENTS:
                for i in PATH_EVENTS[event]:
                    if i < len(args) and args[i] is not None and not inside(args[i]):
                        raise PermissionError(
                            f"sandbox: {event} on {args[i]!r} outside the working directory"
                        )
        finally:
            busy = False

    sys.addaudithook(hook)


def child_main(config: dict[str, Any]) -> None:
    workdir, status_fd = config["workdir"], config.get("status_fd")
    try:
        set_limits(config["limits"])
        if config["isolate"]:
            enter_namespaces(workdir, status_fd)
        resource.setrlimit(resource.RLIMIT_NPROC, (config["limits"]["max_processes"],) * 2)
        install_seccomp()
        forget_ctypes()
        if config.get("audit", True):
            install_audit_hook(workdir)
    except Exception as e:
        message = f"sandbox set-up failed: {type(e).__name__}: {e}"
        print(message, file=sys.stderr)
        if status_fd is not None:
            os.write(status_fd, message.encode())
        sys.exit(SETUP_FAILED)
    if config.get("probe"):
        sys.exit(0)
    if status_fd is not None:
        os.write(status_fd, b"ok")
        os.close(status_fd)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)
    del config
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
