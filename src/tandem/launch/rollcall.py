"""The node roll call and status board of a multi-node run.

Before any process starts, every node's launcher checks in at a TCPStore that the first trainer
node's launcher hosts (`{first trainer host}:{rdzv_port + 1}`). A node that does not check in
within `cluster.join_timeout_s` is named in the error, with its host; so is the first trainer
node when nobody can reach it. At check-in each node also writes a random token into
run_dir/.nodes/<unit> and every node reads all the others' tokens back: a run directory that is
not shared between nodes fails here, naming the node whose file cannot be seen, instead of as
a trainer waiting forever for rollouts.

Afterwards the store is the run's status board: a node whose process fails posts
`failed/<unit>` and every other node stops its processes naming that node and process; the node
carrying the orchestrator posts `done/<unit>` when the orchestrator finished, which ends the
nodes that only serve; a node stopped for another's failure posts `stopped/<unit>`. A node that
fails before it joined (its preflight) still posts `failed/<unit>`, trying for a few seconds, so
the nodes waiting in the roll call stop at once naming it; trainer-0 failing so hosts the store
for it. The hosting node keeps the store until every node has posted (bounded), also those still
on their way to the roll call, so no node loses the board while it is still starting or finishing.
"""

import json
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from tandem.cli import UserError
from tandem.launch.cluster import Cluster, Unit

MARKER_DIR = ".nodes"
SHARE_GRACE_S = 30.0  # a shared filesystem may show a file written elsewhere a little later
POLL_S = 1.0
FAIL_CONNECT_S = 2.0
"""How long a node that fails before it joined tries to reach the roll call to post its failure
(torch retries a connect that timed out once, after a random delay: about 6 s at most)."""


class RollCall:
    """This node's handle on the roll call store (join, then post and watch statuses)."""

    def __init__(self, cluster: Cluster, me: Unit, say: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.me = me
        self.say = say
        self.hosting = me.role == "trainer" and me.index == 0
        self.address = f"{cluster.trainer_host}:{cluster.rollcall_port}"
        self.store: Any = None
        self._last_poll = 0.0
        self.stopped_by_peer = False  # set when the roll call stopped for another node's failure

    def join(self, run_dir: Path, timeout_s: float) -> None:
        """Check in, wait for every node, and check that all see one run directory."""
        try:
            self._open(timeout_s)
        except (RuntimeError, TimeoutError) as e:  # DistStoreError is a RuntimeError
            if self.hosting:
                raise UserError(
                    f"{self.me.name} cannot host the node roll call at {self.address}: {e}"
                ) from None
            raise UserError(
                f"trainer-0 ({self.cluster.trainer_host}), which hosts the node roll call at {self.address}, "
                f"did not answer within cluster.join_timeout_s={timeout_s:g}"
            ) from None
        token = secrets.token_hex(8)
        marker = run_dir / MARKER_DIR / self.me.name
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(token)
        tmp.replace(marker)
        self.store.set(f"joined/{self.me.name}", json.dumps({"host": socket.gethostname(), "token": token}))
        self.say(f"joined the node roll call at {self.address}; waiting for the other nodes")
        self._wait_for_everyone(timeout_s)
        self._check_shared(run_dir)
        self.say(f"all {self.cluster.num_nodes} nodes joined and share {run_dir}")

    def _open(self, timeout_s: float) -> None:
        from torch.distributed import TCPStore  # the launcher imports torch only on several nodes

        self.store = TCPStore(
            self.cluster.trainer_host,
            self.cluster.rollcall_port,
            is_master=self.hosting,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def _wait_for_everyone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        units = self.cluster.units()
        while True:
            if (failed := self.peer_failure()) is not None:  # first: a failed node may have joined
                self.stopped_by_peer = True
                raise UserError(f"stopping before the start: {failed}")
            missing = [u for u in units if not self.store.check([f"joined/{u.name}"])]
            if not missing:
                return
            if time.monotonic() > deadline:
                shown = ", ".join(f"{u.name} ({self.cluster.host(u)})" for u in missing)
                raise UserError(
                    f"{shown} did not join the node roll call at {self.address} within "
                    f"cluster.join_timeout_s={timeout_s:g}"
                )
            time.sleep(0.2)

    def _check_shared(self, run_dir: Path) -> None:
        for unit in self.cluster.units():
            info = json.loads(self.store.get(f"joined/{unit.name}"))
            path = run_dir / MARKER_DIR / unit.name
            deadline = time.monotonic() + SHARE_GRACE_S
            while _read(path) != info["token"]:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"run_dir {run_dir} is not shared between the nodes: {unit.name} (host {info['host']}) "
                        f"wrote {path}, which {self.me.name} (host {socket.gethostname()}) does not see; every "
                        "node must mount the same run directory (docs/scaling.md)"
                    )
                time.sleep(0.5)

    # ---- status board ------------------------------------------------------------------------

    def post(self, failure: str | None, stopped_by_peer: bool = False) -> None:
        """Tell the other nodes how this node ended: done, stopped for another node's failure, or
        its own one-line failure. A node that fails before it joined still tries to post its
        failure, briefly (FAIL_CONNECT_S; trainer-0 hosts the store for it), so that the nodes
        waiting in the roll call stop at once, naming it, instead of after cluster.join_timeout_s."""
        if self.store is None:
            if failure is None or stopped_by_peer:
                return
            try:
                self._open(FAIL_CONNECT_S)
            except (RuntimeError, TimeoutError):
                return  # trainer-0 is not up (or this node cannot host): the others time out as before
        try:
            if stopped_by_peer:
                self.store.set(f"stopped/{self.me.name}", "1")
            elif failure is None:
                self.store.set(f"done/{self.me.name}", "1")
            else:
                host = self.cluster.host(self.me)
                self.store.set(f"failed/{self.me.name}", f"{self.me.name} ({host}): {failure}")
        except (RuntimeError, TimeoutError):
            pass  # the hosting node is gone; the others see that themselves

    def peer_failure(self) -> str | None:
        """The failure another node posted, or that the hosting node is gone."""
        return self._poll()[0]

    def event(self) -> tuple[str, str] | None:
        """For the supervisor, at most once a second: ("failed", what) when another node failed,
        ("done", what) once the orchestrator's node is done."""
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return None
        self._last_poll = now
        failure, done = self._poll()
        if failure is not None:
            return "failed", failure
        if done:
            return "done", "the orchestrator finished; the run is over"
        return None

    def _poll(self) -> tuple[str | None, bool]:
        if self.store is None:
            return None, False
        try:
            for unit in self.cluster.units():
                key = f"failed/{unit.name}"
                if unit != self.me and self.store.check([key]):
                    return self.store.get(key).decode(), False
            return None, self.store.check([f"done/{self._orchestrator_unit().name}"])
        except (RuntimeError, TimeoutError):
            return (
                f"trainer-0 ({self.cluster.trainer_host}) is gone: the node roll call at {self.address} closed",
                False,
            )

    def _orchestrator_unit(self) -> Unit:
        return next(u for u in self.cluster.units() if u.role == "orchestrator" or u.with_orchestrator)

    def linger(self, timeout_s: float) -> None:
        """On the hosting node: keep the board until every node has posted how it ended (at most
        `timeout_s`). Every node, not only those that joined: after a failure before the start, a
        node still on its way (a slower preflight) joins, reads the failure and posts `stopped/`;
        with the store gone it would wait cluster.join_timeout_s and blame trainer-0."""
        if not self.hosting or self.store is None:
            return
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 2  # (at a normal end the others post within a second)
        names, it = "", "it"
        while time.monotonic() < deadline:
            pending = [
                u.name
                for u in self.cluster.units()
                if not any(self.store.check([f"{state}/{u.name}"]) for state in ("done", "failed", "stopped"))
            ]
            if not pending:
                return
            names, it = ", ".join(pending), "it" if len(pending) == 1 else "they"
            if time.monotonic() > next_note:
                self.say(
                    f"keeping the node roll call open until {names} posted how {it} ended "
                    f"(at most {deadline - time.monotonic():.0f} s more; Ctrl-C leaves now)"
                )
                next_note += 60
            time.sleep(0.2)
        self.say(f"leaving although {names} did not post how {it} ended")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
