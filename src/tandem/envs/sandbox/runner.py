"""The sandbox's child side: `python -I -S -B runner.py` reads a job (marshal) on stdin and becomes it.

Standard library only: it runs before anything of the program and must not import tandem. Every
mode ends the same way, with TRAMPOLINE (run in this process, or by bwrap as `python -c`): it
sets the resource limits, tells the parent on the status pipe that the set-up succeeded, closes
every other file descriptor and execs `python -E -s -S -B main.py` in the job directory. Until
"ok" is written, any failure is written to the status pipe and the runner exits with
SETUP_FAILED, so the parent can tell a broken sandbox from a failing program (the program never
holds the status pipe).

Modes (`job["mode"]`):

- `namespaces`: this process enters new user, mount, PID, network, IPC, UTS and cgroup
  namespaces, forks PID 1 of the new PID namespace and relays its exit status. PID 1 builds a
  fresh root on a tmpfs: the interpreter's files and the system's library directories bound
  read-only (site-packages hidden), five device nodes, its own /proc (with /proc/sys and the
  like read-only), and /job, a tmpfs of `disk_mb` holding the job's files. It pivots into that
  root, makes / read-only, then enters a second user and mount namespace: every mount of the
  first becomes locked (the kernel refuses to remount, unmount or change its flags from a less
  privileged namespace), and the program's uid is 1000 there. Then all capabilities are dropped
  (bounding, ambient, effective, permitted, inheritable), no_new_privs is set, PDEATHSIG ties it
  to this runner, and the seccomp filter (compiled by the parent) is loaded.
- `bubblewrap`: the same root, built by bwrap(1) from the same mount list; bwrap drops the
  capabilities, sets no_new_privs, loads the same seccomp filter and forbids nested user
  namespaces; the program is PID 1 (`--as-pid-1`: bwrap's own init would stay inside without the
  filter, its memory writable through /proc/1/mem). This process execs bwrap.
- `unsafe-local`: no namespaces: the job runs in a host directory with the seccomp filter and
  the resource limits only (it can read what the user can read).
"""

import ctypes
import marshal
import os
import sys

# Imports are few and cheap on purpose (no json, typing, signal: each costs milliseconds per program).

SETUP_FAILED = 125
SIGKILL = 9
JOB_DIR = "/job"
SANDBOX_UID = 1000  # the program's uid as it sees it
RUN_AS_ROOT = 1000  # started by root: the program's uid in the outer namespace, mapped to NOBODY
NOBODY = 65534
DEVICES = ("null", "zero", "full", "random", "urandom")
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added after the tables merged)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = (
    1,
    4,
    24,
    22,
    38,
    47,
)
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2

TRAMPOLINE = """\
import os, resource, sys
python, status_fd, *limits = sys.argv[1:]
for item in limits:
    name, value = item.split("=")
    hard = int(value) + 1 if name == "RLIMIT_CPU" else int(value)
    resource.setrlimit(getattr(resource, name), (int(value), hard))
os.write(int(status_fd), b"ok")
os.closerange(3, 1 << 16)
os.execv(python, [python, "-E", "-s", "-S", "-B", "main.py"])  # -I minus -P: /job on sys.path
"""
"""The last step inside the sandbox, in every mode (RLIMIT_CPU's hard limit is a second later: SIGXCPU
first, then SIGKILL)."""

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(OSError):
    pass


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(encode(source), target.encode(), encode(fstype), flags, encode(data)), f"mount {target}")


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def set_attributes(path: str, attributes: int, recursive: bool = True) -> None:
    attr = MountAttr(attributes, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    size = ctypes.sizeof(attr)
    check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), size), path)


def make_mount_point(path: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()


def bind_read_only(source: str, target: str) -> None:
    make_mount_point(target, os.path.isdir(source))
    mount(source, target, None, MS_BIND | MS_REC)
    set_attributes(target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)


def write_files(directory: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)


def build_root(job: dict, root: str, run_as: int) -> None:
    """The program's filesystem under `root` (a fresh tmpfs); see the module docstring."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in job["mounts"]:
        bind_read_only(path, root + path)
    for path, target in job["symlinks"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    for path in job["hidden"]:
        mount(
            "tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555"
        )
    os.makedirs(root + "/dev")
    for name in DEVICES:
        make_mount_point(f"{root}/dev/{name}", False)
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
        set_attributes(f"{root}/dev/{name}", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, recursive=False)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        if os.path.exists(f"{root}/proc/{name}"):
            mount(f"{root}/proc/{name}", f"{root}/proc/{name}", None, MS_BIND | MS_REC)
            set_attributes(f"{root}/proc/{name}", MOUNT_ATTR_RDONLY)
    os.makedirs(root + JOB_DIR)
    disk = job["limits"]["disk_mb"]
    options = f"size={disk}m,nr_inodes=4096,mode=0755,uid={run_as},gid={run_as}"
    mount("tmpfs", root + JOB_DIR, "tmpfs", MS_NOSUID | MS_NODEV, options)


def pivot_into(root: str) -> None:
    os.chdir(root)
    number = SYS_PIVOT_ROOT[os.uname().machine]
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    set_attributes("/", MOUNT_ATTR_RDONLY, recursive=False)


def loopback_up() -> None:
    """Bring up `lo` of the new network namespace (only when the task allows IP sockets)."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def drop_capabilities() -> None:
    """Every capability, from every set; the bounding set first (that needs CAP_SETPCAP)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap} from the bounding set")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header, data = CapHeader(0x20080522, 0), (CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3: zeros
    check(libc.capset(ctypes.byref(header), data), "capset")


class SockFilterProgram(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program: bytes) -> None:
    """Load a compiled BPF filter (struct sock_filter[], 8 bytes each); needs no_new_privs or CAP_SYS_ADMIN."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFilterProgram(len(program) // 8, ctypes.addressof(buffer))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def die_with(parent_alive_fd: int) -> None:
    """SIGKILL when the parent dies; the pipe's EOF tells whether it died before this was armed."""
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    os.set_blocking(parent_alive_fd, False)
    try:
        if os.read(parent_alive_fd, 1) == b"":
            raise SetupError(0, "the runner died during the set-up")
    except BlockingIOError:
        pass  # nothing to read and the writer still there: alive
    os.close(parent_alive_fd)


def trampoline_args(job: dict) -> list[str]:
    limits = [f"{name}={value}" for name, value in job["rlimits"].items()]
    return [job["python"], str(job["status_fd"]), *limits]


def run_trampoline(job: dict) -> None:
    """Run TRAMPOLINE in this process (one interpreter start fewer than exec'ing it)."""
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = ["-c", *trampoline_args(job)]
    exec(TRAMPOLINE, {"__name__": "__trampoline__"})


def confine(job: dict) -> None:
    """What every mode applies to itself last: no capabilities, no_new_privs, seccomp."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    load_seccomp(job["seccomp"])


def run_namespaces(job: dict) -> None:
    """This process stays outside and writes the id maps; its child enters the namespaces and forks
    PID 1 of the new PID namespace, which builds the root and becomes the program."""
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        enter_namespaces(job, unshared_w, mapped_r)
    os.close(unshared_w)
    os.close(mapped_r)
    try:
        if os.read(unshared_r, 1) != b"x":
            raise SetupError(0, "the sandbox child died before entering its namespaces")
        write_id_maps(pid, host_id_maps(os.geteuid(), os.getegid()))
        os.write(mapped_w, b"x")
    except BaseException as e:  # noqa: BLE001
        os.kill(pid, SIGKILL)
        fail(job, e)
    os.close(job["status_fd"])
    relay_exit(pid)


def host_id_maps(uid: int, gid: int) -> tuple[str, str]:
    """uid_map and gid_map of the outer namespace: 0 is this user. Root also maps RUN_AS to the host's
    nobody, so the program is not host uid 0 (whose processes RLIMIT_NPROC does not count)."""
    if uid == 0:
        return f"0 0 1\n{RUN_AS_ROOT} {NOBODY} 1", f"0 0 1\n{RUN_AS_ROOT} {NOBODY} 1"
    return f"0 {uid} 1", f"0 {gid} 1"


def write_id_maps(pid: int | str, maps: tuple[str, str]) -> None:
    for name, text in [("setgroups", "deny"), ("uid_map", maps[0]), ("gid_map", maps[1])]:
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def relay_exit(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def enter_namespaces(job: dict, unshared_w: int, mapped_r: int) -> None:
    """Unshare, then fork PID 1. PDEATHSIG ties this process to the runner as PID 1 is tied to this
    one, so that the caller's death reaches the program; it is armed after unshare (a change of
    credentials clears it) and before the runner hears "x" (so the runner is alive then)."""
    try:
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        check(libc.unshare(flags | CLONE_NEWCGROUP), "unshare")
        check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
        os.write(unshared_w, b"x")
        os.close(unshared_w)
        if os.read(mapped_r, 1) != b"x":
            raise SetupError(0, "the runner died before writing the id maps")
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            build_and_exec(job, alive_r)
        os.close(alive_r)
        os.close(job["status_fd"])
    except BaseException as e:  # noqa: BLE001
        fail(job, e)
    relay_exit(pid)


def build_and_exec(job: dict, alive_r: int) -> None:
    """PID 1 of the new namespaces: root, uid, locked mounts, no capabilities, seccomp, exec."""
    try:
        run_as = RUN_AS_ROOT if job["host_uid"] == 0 else 0
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        build_root(job, "/tmp", run_as)
        pivot_into("/tmp")
        if job["ip_sockets"]:
            loopback_up()
        if run_as:
            os.setresgid(run_as, run_as, run_as)
            os.setresuid(run_as, run_as, run_as)
            check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")  # /proc/self stays ours
        write_files(JOB_DIR, job["files"])
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "lock the mounts (unshare)")
        write_id_maps("self", (f"{SANDBOX_UID} {run_as} 1", f"{SANDBOX_UID} {run_as} 1"))
        os.chdir(JOB_DIR)
        drop_capabilities()
        die_with(alive_r)
        confine(job)
        run_trampoline(job)
    except BaseException as e:  # noqa: BLE001 — anything here is a set-up failure
        fail(job, e)


def bubblewrap_argv(job: dict, seccomp_fd: int, file_fds: dict[str, int]) -> list[str]:
    argv = [job["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    # no bwrap init inside (it has no filter and the program could write its memory); no
    # --new-session: the runner has a session of its own already, no terminal, and a session
    # leader could not setsid() (as PID 1 the program would be one)
    argv += ["--as-pid-1"]
    argv += ["--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    for path in job["mounts"]:
        argv += ["--ro-bind", path, path]
    for path, target in job["symlinks"]:
        argv += ["--symlink", target, path]
    for path in job["hidden"]:
        argv += ["--perms", "0555", "--size", "4096", "--tmpfs", path, "--remount-ro", path]
    argv += ["--size", str(1 << 20), "--tmpfs", "/dev"]
    for name in DEVICES:
        argv += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        argv += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev", "--proc", "/proc"]
    for name in PROC_READ_ONLY:
        argv += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
    disk = job["limits"]["disk_mb"] << 20
    argv += ["--perms", "0755", "--size", str(disk), "--tmpfs", JOB_DIR]
    for name, fd in file_fds.items():
        argv += ["--file", str(fd), f"{JOB_DIR}/{name}"]
    argv += ["--chdir", JOB_DIR, "--remount-ro", "/", "--clearenv"]
    for key, value in job["env"].items():
        argv += ["--setenv", key, value]
    python = [job["python"], "-I", "-S", "-B", "-c", TRAMPOLINE, *trampoline_args(job)]
    return [*argv, "--seccomp", str(seccomp_fd), "--", *python]


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("tandem-sandbox", 0)  # inherited by bwrap, which reads and closes it
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_bubblewrap(job: dict) -> None:
    try:
        seccomp_fd = memfd_with(job["seccomp"])
        file_fds = {name: memfd_with(text.encode()) for name, text in job["files"].items()}
        argv = bubblewrap_argv(job, seccomp_fd, file_fds)
        os.execv(argv[0], argv)
    except BaseException as e:  # noqa: BLE001
        fail(job, e)


def run_unsafe_local(job: dict) -> None:
    try:
        os.chdir(job["workdir"])
        write_files(job["workdir"], job["files"])
        confine(job)
        run_trampoline(job)
    except BaseException as e:  # noqa: BLE001
        fail(job, e)


def fail(job: dict, error: BaseException) -> None:
    message = f"sandbox set-up failed: {type(error).__name__}: {error}"
    try:
        os.write(job["status_fd"], message.encode())
    finally:
        os._exit(SETUP_FAILED)


def main() -> None:
    job = marshal.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
        if os.getppid() != job["parent_pid"]:
            raise SetupError(0, "the parent died before the set-up began")
    except BaseException as e:  # noqa: BLE001
        fail(job, e)
    {"namespaces": run_namespaces, "bubblewrap": run_bubblewrap, "unsafe-local": run_unsafe_local}[
        job["mode"]
    ](job)


if __name__ == "__main__":
    main()
