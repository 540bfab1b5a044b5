"""One torchft replica (a replica group of one rank) for tests/test_torchft.py: a torchft
Manager over ddlcomm.torchft.ProcessGroupDdlcomm, training a tiny model with torchft's DiLoCo.

    python tests/workers/torchft_replica.py LIGHTHOUSE REPLICA_ID OUT_DIR [--compress] [...]

Trains until it has committed the outer step the test writes to OUT_DIR/stop, in a quorum of
--replicas replicas (every replica of that quorum stops after the same commit). After every
committed outer step it appends ``{"step", "participants", "sha", ...}`` (``sha``: a hash of
its parameters' bytes) to OUT_DIR/replica<ID>.<pid>.jsonl, so the test sees when it synced,
with whom, and whether the replicas hold the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

# torchft advertises socket.gethostname() for its manager and checkpoint servers (read at
# import): loopback only in the tests.
socket.gethostname = lambda: "localhost"

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

import ddlcomm.compressors  # noqa: E402
from ddlcomm.torchft import CompressedAverager, ProcessGroupDdlcomm  # noqa: E402
from torchft.local_sgd import DiLoCo  # noqa: E402
from torchft.manager import Manager  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("replica_id", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds per inner step")
    parser.add_argument("--compress", action="store_true", help="average through Ternary (CompressedAverager)")
    parser.add_argument("--die-after-full-syncs", type=int, default=0,
                        help="SIGKILL itself once this many outer steps ran with every replica, in the next sync: "
                             "after its quorum (the ddlcomm group is up), before its all-reduce")
    parser.add_argument("--abort-group-at-step", type=int, default=0,
                        help="abort its ddlcomm group (every replica's fails; none dies) in the sync at this step")
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(args.replica_id)  # replicas start apart: the first quorum heals them (init_sync)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, 1, is_master=True, wait_for_workers=False)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])

    pg = ProcessGroupDdlcomm(timeout=timedelta(seconds=10))
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=str(args.replica_id), store_addr="127.0.0.1", store_port=store_port, rank=0,
                      world_size=1, lighthouse_addr=args.lighthouse, hostname="localhost", use_async_quorum=False,
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=10))
    averager = None
    if args.compress:
        averager = CompressedAverager(manager, ddlcomm.compressors.Ternary(), model.parameters()).install()
    full_syncs = 0
    if args.die_after_full_syncs:
        allreduce = manager.allreduce

        def die_in_sync(tensor: torch.Tensor, *rest, **options):
            if full_syncs >= args.die_after_full_syncs:
                os.kill(os.getpid(), signal.SIGKILL)  # the peers are waiting in the all-reduce
            return allreduce(tensor, *rest, **options)

        manager.allreduce = die_in_sync
    if args.abort_group_at_step:
        allreduce_ = manager.allreduce
        aborted = []

        def abort_in_sync(tensor: torch.Tensor, *rest, **options):
            if manager.current_step() >= args.abort_group_at_step and not aborted:
                aborted.append(manager.current_step())
                pg.backend.abort()  # a failure that changes no quorum
            return allreduce_(tensor, *rest, **options)

        manager.allreduce = abort_in_sync
    log = (args.out / f"replica{args.replica_id}.{os.getpid()}.jsonl").open("a")
    g = torch.Generator().manual_seed(1000 + args.replica_id)
    w = torch.arange(8, dtype=torch.float32) / 8
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        while True:
            step = manager.current_step()
            inner.zero_grad()
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w)
            loss.backward()
            inner.step()  # DiLoCo's hook syncs every sync_every inner steps
            time.sleep(args.step_sleep)
            if manager.current_step() != step:  # an outer step was committed
                sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
                participants = manager.num_participants()
                full_syncs += participants == args.replicas
                log.write(json.dumps({"step": manager.current_step(), "participants": participants,
                                      "sha": sha, "loss": loss.item(),
                                      "compressed": averager.calls if averager else 0}) + "\n")
                log.flush()
                stop = args.out / "stop"
                if participants == args.replicas and stop.exists() and manager.current_step() >= int(stop.read_text()):
                    break
    log.close()
    manager.shutdown(wait=False)
    pg.shutdown()
    del store


if __name__ == "__main__":
    main()
