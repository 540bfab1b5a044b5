"""ddlcomm over ddlcomm.slownet's emulated network: ranks in separate namespaces running
tests/workers/impaired.py, exact results over a lossy slow network, and what every rank does when
one rank's link is cut. What they need to run is in slownet_harness.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest

from harness import RANK_ENV, WORKERS
from slownet_harness import impairable, probe  # noqa: F401 (fixtures the marks use)
from slownet_harness import needs_impairment, needs_net

from ddlcomm import slownet
from ddlcomm.slownet import SlowNet


# The rendezvous store, hosted as torchrun's agent would be: in rank 0's namespace
# (MASTER_ADDR) but outside the ranks, so it outlives any of them.
STORE = r"""
import sys
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), is_master=True,
                 wait_for_workers=False)
print("ready", flush=True)
sys.stdin.read()  # serve until SlowNet kills it on close (or the test dies: EOF)
"""


class Ranks:
    """tests/workers/impaired.py on every rank of ``net``, ``per_host`` in each namespace (as
    torchrun numbers them: a host's consecutively; the default transport, so shared memory
    inside a namespace); their output collected line by line as it comes."""

    def __init__(self, net: SlowNet, cwd: Path, scenario: str, *args: str, per_host: int = 1) -> None:
        port = slownet.DEFAULT_MASTER_PORT
        world = net.ranks * per_host
        store = net.popen(0, [sys.executable, "-c", STORE, net.address(0), str(port), str(world)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert store.stdout is not None and store.stdout.readline().strip() == "ready"
        self.output: list[list[str]] = [[] for _ in range(world)]
        self.exited_at: list[float | None] = [None] * world  # when its output closed
        self.changed = threading.Condition()
        self.procs = []
        for r in range(world):
            env = net.env(r // per_host, port)
            if per_host > 1 and "DDLCOMM_TRANSPORT" not in os.environ:  # shared memory inside a host
                env["DDLCOMM_TRANSPORT"] = "auto"
            env.update(RANK_ENV, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % per_host),
                       LOCAL_WORLD_SIZE=str(per_host))
            proc = net.popen(r // per_host, [sys.executable, str(WORKERS / "impaired.py"), scenario, *args],
                             env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            threading.Thread(target=self._read, args=(r, proc.stdout), daemon=True).start()
            self.procs.append(proc)

    def _read(self, rank: int, stream: Any) -> None:
        for line in stream:
            with self.changed:
                self.output[rank].append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.exited_at[rank] = time.monotonic()
            self.changed.notify_all()

    def fail(self, why: str) -> None:
        text = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-60:])
                         for r, lines in enumerate(self.output))
        pytest.fail(f"{why}\n{text}")

    def first(self, prefix: str) -> dict[int, str]:
        """Each rank's first line starting with ``prefix``, for the ranks that printed one."""
        with self.changed:
            return {r: next(x for x in out if x.startswith(prefix))
                    for r, out in enumerate(self.output) if any(x.startswith(prefix) for x in out)}

    def wait_for(self, prefix: str, timeout: float) -> None:
        """Wait until every rank printed a line starting with ``prefix``; fail if one exits
        without or ``timeout`` s pass."""
        n = len(self.procs)

        def done() -> bool:
            printed = self.first(prefix)
            return len(printed) == n or any(self.exited_at[r] and r not in printed for r in range(n))

        with self.changed:
            self.changed.wait_for(done, timeout)
        missing = sorted(set(range(n)) - set(self.first(prefix)))
        if missing:
            self.fail(f"ranks {missing} did not print {prefix!r} within {timeout:g} s")

    def wait_exit(self, ranks: Sequence[int], timeout: float) -> list[int]:
        """Wait up to ``timeout`` s for ``ranks`` to exit; return those still running."""
        deadline = time.monotonic() + timeout
        with self.changed:
            self.changed.wait_for(lambda: all(self.exited_at[r] for r in ranks), timeout)
        running = []
        for r in ranks:
            try:
                self.procs[r].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.append(r)
        return running

    def finish(self, timeout: float) -> None:
        """Every rank exits 0 within ``timeout`` s, else fail (SlowNet kills what is left)."""
        running = self.wait_exit(range(len(self.procs)), timeout)
        if running:
            self.fail(f"ranks {running} still running after {timeout:g} s")
        codes = [p.returncode for p in self.procs]
        if any(codes):
            self.fail(f"exit codes {codes}")


# Per link direction; a path between two ranks crosses two links: 5 ms one way
# (RTT 10 ms) and 1 - 0.995**2 = 1.0% loss, as `netem delay 5ms loss 1%` on each host.
LINK_DELAY, LINK_LOSS = "2.5ms", "0.5%"


@needs_impairment
def test_ddlcomm_exact_over_lossy_slow_network(tmp_path: Path) -> None:
    with SlowNet(ranks=4, rate="1gbit", delay=LINK_DELAY, loss=LINK_LOSS) as net:
        print(net.describe())
        t0 = time.monotonic()
        ranks = Ranks(net, tmp_path, "mixed")
        ranks.finish(timeout=120)
        dropped = net.dropped_packets()
    for line in ranks.first("rank ").values():
        print(line)
    print(f"4 ranks done in {time.monotonic() - t0:.1f} s, {dropped} packets dropped on the way")
    assert dropped > 0, "the emulated loss dropped nothing"


@needs_net
@pytest.mark.parametrize("host_id, namespaces, peers, topology",
                         [("one", 4, 3, "1 host x 4 ranks"), (None, 2, 1, "2 hosts x 2 ranks")],
                         ids=["DDLCOMM_HOST_ID", "two-per-namespace"])
def test_network_namespaces_are_hosts_unless_named_one(tmp_path: Path, host_id: str | None, namespaces: int,
                                                       peers: int, topology: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The default transport: ranks in their own network namespaces reach each other over the
    network (each namespace a host), and share memory when DDLCOMM_HOST_ID names one host. Two
    ranks in each of two namespaces: shared memory inside each, and the hierarchical all-reduce.
    (One rank per namespace, 4 hosts: the lossy-network test above checks that topology.)"""
    monkeypatch.setenv("DDLCOMM_TRANSPORT", "auto")
    if host_id is not None:
        monkeypatch.setenv("DDLCOMM_HOST_ID", host_id)
    with SlowNet(ranks=namespaces, rate="1gbit") as net:
        ranks = Ranks(net, tmp_path, "hosts", str(peers), topology, per_host=4 // namespaces)
        ranks.finish(timeout=90)


@dataclass
class Cut:
    """What each rank did after the link of the host holding ``ranks`` went down."""

    ranks: list[int]  # cut off: every rank of that host
    timeout: float
    failed_after: dict[int, float]  # rank -> s from the cut to its DistBackendError
    errors: dict[int, str]
    exited: dict[int, bool]  # rank -> exited by itself within the time allowed


# (cut at the switch port?, ranks per host): 4 hosts of one rank, its own interface down; 2 hosts
# of 2 ranks (shared memory inside, the hierarchical all-reduce across), its switch port down.
CUTS = {"host-side": (False, 1), "switch-side-2x2": (True, 2)}


@pytest.fixture(scope="module", params=list(CUTS))
def cut(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        impairable: None) -> Cut:
    """4 ranks all-reduce in a loop over the lossy, slow network until host 1's link (rank 1's,
    or ranks 2 and 3's) goes down (its own interface or its switch port). Survivors get
    timeout + 5 s, the cut-off ranks 2 * timeout + 5 s (their timeout, then their store's) to exit."""
    timeout, host = 5.0, 1  # not host 0: its namespace holds the store
    at_switch, per_host = CUTS[request.param]
    numel = 1000 if per_host == 1 else 300_000  # above the small-message size: hierarchical
    with SlowNet(ranks=4 // per_host, rate="1gbit", delay=LINK_DELAY, loss=LINK_LOSS) as net:
        ranks = Ranks(net, tmp_path_factory.mktemp("cut"), "link_down", str(timeout), str(numel), per_host=per_host)
        world = len(ranks.procs)
        victims = [r for r in range(world) if r // per_host == host]
        ranks.wait_for("READY", timeout=60)  # the group is up, a first all-reduce passed
        topology, hierarchical = json.loads(ranks.first("READY")[0].split(" ", 1)[1])
        assert topology == f"{4 // per_host} hosts x {per_host} rank{'s' * (per_host > 1)}", topology
        assert hierarchical == (per_host > 1), hierarchical
        cut_at = time.monotonic()
        net.set_link(host, False, at_switch=at_switch)
        survivors = [r for r in range(world) if r not in victims]
        hung = ranks.wait_exit(survivors, timeout + 5)
        hung += ranks.wait_exit(victims, cut_at + 2 * timeout + 5 - time.monotonic())
        reports = {r: json.loads(line.split(" ", 1)[1]) for r, line in ranks.first("FAILED ").items()}
    result = Cut(victims, timeout, {r: f["failed_at"] - cut_at for r, f in reports.items()},
                 {r: f["error"] for r, f in reports.items()}, {r: r not in hung for r in range(world)})
    side = "switch port" if at_switch else "own interface"
    for r in range(world):
        if r in reports:
            f = reports[r]
            print(f"\n[{side} of ranks {victims} down] rank {r}: DistBackendError "
                  f"{result.failed_after[r]:.2f} s after the cut ({f['in_call']:.2f} s into its "
                  f"all-reduce), exited: {result.exited[r]}: {f['error'][:300]}")
        else:
            print(f"\n[{side} of ranks {victims} down] rank {r}: no error, "
                  f"{'exited' if result.exited[r] else 'hung, killed'}: "
                  + " | ".join(ranks.output[r][-3:])[:300])
    return result


def test_cut_link_survivors_raise_within_timeout(cut: Cut) -> None:
    for r, exited in cut.exited.items():
        if r not in cut.ranks:
            assert r in cut.failed_after, f"rank {r} raised no DistBackendError"
            assert cut.failed_after[r] < cut.timeout + 3, f"rank {r} took {cut.failed_after[r]:.2f} s"
            assert exited, f"rank {r} hung after its error"


def test_cut_link_survivors_name_the_cut_rank(cut: Cut) -> None:
    """Every survivor leads with a cut-off rank as the likely cause (docs/failure-modes.md),
    not merely mentions it somewhere: a survivor that waited for it names it further on anyway."""
    for r in cut.exited:
        if r not in cut.ranks:
            assert r in cut.errors, f"rank {r} raised no DistBackendError"
            headline = cut.errors[r].split("] ", 1)[-1].split(";")[0]  # after "[ddlcomm rank r/n]"
            named = re.search(r"likely cause: (rank \d+(?:, rank \d+)*) (?:was|were) not waiting", headline)
            blamed = {int(x) for x in re.findall(r"\d+", named.group(1))} if named else set()
            assert blamed and blamed <= set(cut.ranks), \
                f"rank {r}'s error does not lead with cut-off ranks {cut.ranks}: {cut.errors[r]}"


def test_cut_link_cut_rank_raises(cut: Cut) -> None:
    for v in cut.ranks:
        assert v in cut.failed_after, f"rank {v} (cut off) raised nothing"
        assert cut.exited[v], f"rank {v} (cut off) hung"
