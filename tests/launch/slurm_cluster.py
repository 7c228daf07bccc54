"""A real Slurm on localhost for tests: munged, slurmctld and three slurmd daemons (three nodes
of one machine, told apart by `slurmd -N`), all private to one temporary directory.

Needs Debian's slurm-wlm and munge packages (.ci/run installs them) and root (slurmd runs jobs
as their users). Everything started here is stopped by `stop()`.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tandem.net import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
NODES = ("tnode1", "tnode2", "tnode3")
END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def missing_reason() -> str | None:
    """Why a local Slurm cannot start here, or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (
            f"{', '.join(absent)} not installed: .ci/run installs Debian's slurm-wlm and munge "
            "(apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd starts jobs as their user)"
    return None


class LocalSlurm:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-slurm-"))  # short: it holds a unix socket
        self.processes: list[subprocess.Popen] = []
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> None:
        munge = self.dir / "munge"
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.sock"
        self._spawn(
            "munged",
            ["munged", "-F", "-f", f"--socket={socket_path}", f"--key-file={key}"]
            + [f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}"]
            + [f"--seed-file={munge / 'munged.seed'}"],
        )
        self._wait(socket_path.exists, timeout_s, "munged's socket")
        self.conf.write_text(self._slurm_conf(socket_path))
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(self._idle, timeout_s, f"nodes {', '.join(NODES)} to be idle in sinfo")

    def _slurm_conf(self, munge_socket: Path) -> str:
        ctld = free_ports(2 + len(NODES))
        slurmd, *node_ports = range(ctld + 1, ctld + 2 + len(NODES))
        host = socket.gethostname().split(".")[0]
        d = self.dir
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={os.cpu_count()} "
            "RealMemory=2000 State=UNKNOWN"
            for n, p in zip(NODES, node_ports, strict=True)
        )
        return f"""ClusterName=tandemtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.dir / "log" / f"{name}.out").open("w")
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def _idle(self) -> bool:
        for p in self.processes:
            if p.poll() is not None:
                logs = "\n".join(f.read_text()[-2000:] for f in (self.dir / "log").glob("*"))
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{logs}")
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env
        )
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    @staticmethod
    def _wait(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"local Slurm: timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.1)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key → value."""
        out = subprocess.run(
            ["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True, env=self.env
        ).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Wait until job `job_id` ends; its final `scontrol show job` fields."""
        deadline = time.monotonic() + timeout_s
        while (info := self.job(job_id)).get("JobState") not in END_STATES:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env, check=False)
                raise TimeoutError(f"Slurm job {job_id} still {info.get('JobState')} after {timeout_s:g} s")
            time.sleep(0.2)
        return info

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, check=False)
        for p in reversed(self.processes):  # slurmd first, munged last
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
