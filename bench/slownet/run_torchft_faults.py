"""Lost replicas on an emulated slow network: DiLoCo over 4 hosts with two replicas killed
mid-training, recovered three ways: torchft with ddlcomm's compressed group, torchft with its
own gloo group, and torchrun restarting every rank from checkpoints.

    sudo python -m bench.slownet.run_torchft_faults --rates 1gbit,100mbit \
        --out docs/results/torchft_faults

For each link rate and each configuration of ``--configs`` it runs ``bench.torchft_faults`` on
every host: ``ddlcomm-ternary`` (torchft, ``ddlcomm.torchft.ProcessGroupDdlcomm``, ternary
pseudo-gradients), ``gloo-fp32`` (torchft's gloo group, float32), ``elastic-ternary``
(``ddlcomm.diloco.DiLoCo`` with ternary under ``torchrun --max-restarts``, checkpoints every 5
outer steps); each without faults and with them: under torchft, replica 3 killed in the sync of
outer step ``--die-at``'s first number and replica 2 in that of the second, each started again
at once (it rejoins and heals from a live peer; torchft's lighthouse runs on host 0); under
torchrun, a rank lost at the same outer steps and every rank restarted from the last checkpoint.
One rank saves its model every 3 outer steps; the driver evaluates those afterwards.

Columns: inner steps lost (work thrown away: the intervals of failed syncs, of the killed
replicas and of the restarted ones before they healed; under torchrun, every rank's steps
since the checkpoint it resumed from), the seconds each survivor stalled (torchft: its syncs'
time beyond its median sync, summed: failure detection, the quorums without and with the
restarted replica, serving its checkpoint), time lost per fault (training time to the last
outer step against the same configuration without faults, divided by the faults), time to
the target accuracy (0.5 points below the lower final accuracy of the runs without faults),
final accuracy, bytes the hosts sent (their interfaces' counters) and that traffic against DDP
float32 (a ring all-reduce of every gradient at every inner step). Writes torchft_faults.json
and torchft_faults.md into --out (``--append`` adds to a saved .json). Needs root, iproute2
and torchft; exits non-zero with the reason when namespaces are unavailable.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddlcomm.slownet import SlowNet
from ddlcomm.wire import ring_all_reduce_bytes

from bench.slownet.driver import ROOT, bench_parser, require_slownet
from bench.tasks import make_task

HOSTS = 4
LIGHTHOUSE_PORT = 29510
RDZV_PORT = 29400
# name in the tables, bench.torchft_faults' options
CONFIGS = {
    "ddlcomm-ternary": ("ddlcomm, ternary", ["--process-group", "ddlcomm", "--compressor", "ternary"]),
    "gloo-fp32": ("torchft gloo, float32", ["--process-group", "gloo"]),
    "elastic-ternary": ("torchrun restarts, ternary", ["--elastic", "--compressor", "ternary"]),
}


def tx_bytes(net: SlowNet) -> int:
    """Bytes every host has sent on its link so far."""
    total = 0
    for host in range(HOSTS):
        out = subprocess.run(["ip", "netns", "exec", net.namespace(host), "cat",
                              f"/sys/class/net/{net.ifname(host)}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        total += int(out)
    return total


def run_one(net: SlowNet, rate: str, config: str, faults: list[int], args, work: Path) -> dict:
    """One training run; returns its record (events of every replica, curve, bytes)."""
    name, options = CONFIGS[config]
    elastic = "--elastic" in options
    run = work / f"{rate}-{config}-{'faults' if faults else 'clean'}"
    shutil.rmtree(run, ignore_errors=True)
    for folder in ("snapshots", "checkpoints"):
        (run / folder).mkdir(parents=True)
    address = [net.address(h) for h in range(HOSTS)]
    die = {HOSTS - 1 - i: step for i, step in enumerate(faults)}  # torchft: replicas 3 and 2

    def start(host: int, first: bool) -> subprocess.Popen:
        env = net.env(host)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
        worker = ["-m", "bench.torchft_faults", "--replica", str(host), "--events", str(run / f"replica{host}.jsonl"),
                  "--outer-steps", str(args.outer_steps), "--sync-every", str(args.sync_every),
                  "--width", str(args.width), "--seed", str(args.seed), *options]
        if elastic:  # every host's torchrun agent; rank 0 (wherever it lands) saves the snapshots
            argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", str(HOSTS), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address[0]}:{RDZV_PORT}", "--rdzv-id", run.name,
                    # torchrun finds the endpoint, and tells the ranks rank 0's address, by the
                    # machine's name, which every namespace shares: give each its own address
                    "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", address[host],
                    "--max-restarts", str(len(faults)), "--monitor-interval", "0.5", *worker,
                    "--checkpoints", str(run / "checkpoints"), "--snapshots", str(run / "snapshots")]
            argv += ["--die-at", ",".join(map(str, faults))] if faults else []
        else:
            argv = [sys.executable, *worker, "--lighthouse", f"http://{address[0]}:{LIGHTHOUSE_PORT}",
                    "--address", address[host]]
            argv += ["--snapshots", str(run / "snapshots")] if host == 0 else []
            argv += ["--die-at", str(die[host])] if first and host in die else []
        return net.popen(host, argv, env=env, cwd="/", stdout=(run / f"replica{host}.out").open("a"),
                         stderr=subprocess.STDOUT)

    lighthouse = None if elastic else net.popen(
        0, [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"{address[0]}:{LIGHTHOUSE_PORT}",
            "--min_replicas", "2", "--join_timeout_ms", str(args.join_timeout_ms), "--heartbeat_timeout_ms", "1000",
            "--quorum_tick_ms", "50"], stdout=(run / "lighthouse.log").open("w"), stderr=subprocess.STDOUT)
    sent = tx_bytes(net)
    began = time.time()
    procs = {h: start(h, True) for h in range(HOSTS)}
    kills: list[dict] = []
    deadline = time.monotonic() + args.timeout
    late: list[int] = []  # restarted replicas still waiting to rejoin when the others had finished
    finished_at = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} at {rate}: timed out after {args.timeout:.0f} s (logs in {run})")
            for host, p in procs.items():
                code = p.poll()
                if (not elastic and code == -signal.SIGKILL and host in die
                        and not any(k["replica"] == host for k in kills)):
                    kills.append({"replica": host, "t": time.time()})
                    procs[host] = start(host, False)
                elif code not in (None, 0) and host not in late:
                    tail = (run / f"replica{host}.out").read_text()[-3000:]
                    raise SystemExit(f"{tail}\n{name} at {rate}: replica {host} exited {code}")
            # A replica that comes back after the others committed their last outer step finds
            # no quorum to join: stopped after --grace seconds, and said so in the record.
            if finished_at is None and all(procs[h].poll() == 0 for h in range(HOSTS) if h not in die):
                finished_at = time.monotonic()
            if finished_at is not None and not late and time.monotonic() - finished_at > args.grace:
                late = [h for h, p in procs.items() if p.poll() is None]
                for h in late:
                    procs[h].terminate()
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()  # none left behind, running or unreaped
        if lighthouse is not None:
            lighthouse.send_signal(signal.SIGTERM)
            lighthouse.wait()
    sent = tx_bytes(net) - sent
    events = [json.loads(line) for h in range(HOSTS) for line in (run / f"replica{h}.jsonl").read_text().splitlines()]
    if elastic:  # the ranks record each failure they cause (torchrun then restarts every rank)
        kills = [{"failure": f.name} for f in sorted((run / "checkpoints").glob("failure*"))]
    record = {"rate": rate, "config": config, "name": name, "faults": faults, "kills": kills, "late": late,
              "events": events, "bytes": sent, "wall_seconds": time.time() - began, "outer_steps": args.outer_steps,
              "width": args.width, "sync_every": args.sync_every, "seed": args.seed}
    record["curve"] = evaluate(record, run / "snapshots")
    shutil.rmtree(run)
    return record


def evaluate(record: dict, snapshots: Path) -> list[tuple[float, int, float]]:
    """(training seconds, outer step, accuracy) of the snapshots, in the order they were saved;
    the seconds count from the first replica's start and leave out the time spent saving them."""
    task = make_task("cnn", width=record["width"])
    t0 = min(e["t"] for e in record["events"] if e["kind"] == "start")
    model, curve, saving = task.model(), [], 0.0
    for e in sorted((e for e in record["events"] if e["kind"] == "snapshot"), key=lambda e: e["t"]):
        model.load_state_dict(torch.load(e["file"]))
        curve.append((e["t"] - e["seconds"] - saving - t0, e["step"], task.evaluate(model)))
        saving += e["seconds"]
    return curve


def restarts_every_rank(record: dict) -> bool:
    return "--elastic" in CONFIGS[record["config"]][1]


def summary(record: dict, clean: dict | None) -> dict:
    """Steps lost, survivors' stall, time lost per fault against the run without faults, the
    share of replica 0's (first process's) time spent in syncs, final accuracy, traffic against
    DDP float32."""
    h, steps = record["sync_every"], record["outer_steps"]
    syncs = [e for e in record["events"] if e["kind"] == "sync"]
    kills = len(record["kills"])
    if restarts_every_rank(record):
        # every rank restarts: what each did after the checkpoint it resumed from is done again
        lost = h * (len(syncs) + HOSTS * kills - HOSTS * steps)
        stalls = None
    else:
        restarts = sum(e["kind"] == "start" for e in record["events"]) - HOSTS
        lost = h * (sum(not e["committed"] for e in syncs) + kills + restarts)
        stalls = []
        for replica in set(range(HOSTS)) - {k["replica"] for k in record["kills"]}:
            took = [e["t"] - e["began"] for e in syncs if e["replica"] == replica]
            normal = statistics.median(took)
            stalls.append(sum(max(0.0, s - normal) for s in took))
    params = sum(p.numel() for p in make_task("cnn", width=record["width"]).model().parameters())
    ddp = steps * h * HOSTS * ring_all_reduce_bytes(4 * params, HOSTS)
    per_fault = (record["curve"][-1][0] - clean["curve"][-1][0]) / kills if clean and kills else None
    pid = min((e for e in record["events"] if e["replica"] == 0 and e["kind"] == "start"), key=lambda e: e["t"])["pid"]
    first = [e for e in record["events"] if e["pid"] == pid]  # replica 0's first process
    synced = sum(e["t"] - e["began"] for e in first if e["kind"] == "sync")
    sync_share = synced / (first[-1]["t"] - first[0]["t"])
    return {"lost": lost, "sync_share": sync_share, "stall_max": max(stalls) if stalls else None,
            "stall_mean": statistics.fmean(stalls) if stalls else None, "per_fault": per_fault,
            "final": record["curve"][-1][2], "reduction": ddp / record["bytes"]}


def time_to(curve: list, target: float) -> float | None:
    return next((seconds for seconds, _, metric in curve if metric >= target), None)


def report(records: list[dict], points: float) -> str:
    """A table per rate; the target is ``points`` below the lower final accuracy of the runs
    without faults, the speed-up against torchft's gloo group in float32 with the same faults."""
    lines = []
    for rate in dict.fromkeys(r["rate"] for r in records):
        mine = [r for r in records if r["rate"] == rate]
        finals = [r["curve"][-1][2] for r in mine if not r["faults"]]
        target = min(finals) - points if finals else None
        lines += [f"| {rate} | faults | inner steps lost | survivors' stall, s (max / mean) | time lost per fault, s "
                  "| replica 0's time in syncs | time to target, s (vs torchft gloo float32, same faults) | final accuracy % | bytes sent "
                  "| traffic ÷ vs DDP fp32 |", "| --- |" + " --- |" * 9]
        for r in mine:
            clean = next((c for c in mine if c["config"] == r["config"] and not c["faults"]), None)
            base = next((b for b in mine if b["config"] == "gloo-fp32" and bool(b["faults"]) == bool(r["faults"])),
                        None)
            s = summary(r, clean)
            t = time_to(r["curve"], target) if target is not None else None
            t0 = time_to(base["curve"], target) if base and target is not None else None
            speed = "not reached" if t is None else f"{t:.1f}" + (f" ({t0 / t:.2f}x)" if t0 else "")
            faults = "none" if not r["faults"] else (
                f"ranks lost at outer steps {', '.join(map(str, r['faults']))}, every rank restarted"
                if restarts_every_rank(r) else
                f"replicas 3, 2 killed at outer steps {', '.join(map(str, r['faults']))}, started again")
            if r["late"]:
                faults += f" (replicas {r['late']} came back after the last outer step and were stopped)"
            stall = "-" if s["stall_max"] is None else f"{s['stall_max']:.2f} / {s['stall_mean']:.2f}"
            per_fault = "-" if s["per_fault"] is None else f"{s['per_fault']:.1f}"
            lines.append(f"| {r['name']} | {faults} | {s['lost']} | {stall} | {per_fault} | {s['sync_share']:.0%} | {speed} | {s['final']:.2f} "
                         f"| {r['bytes'] / 1e6:.1f} MB | {s['reduction']:.0f}x |")
        if target is not None:
            lines.append(f"\nTarget at {rate}: accuracy >= {target:.2f} ({points:g} point{'s' if points != 1 else ''} below the lower final "
                         "accuracy of the runs without faults).\n")
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__, "docs/results/torchft_faults", 1800)
    parser.add_argument("--configs", default="ddlcomm-ternary,gloo-fp32,elastic-ternary",
                        help=f"comma-separated configurations: {', '.join(CONFIGS)}")
    parser.add_argument("--faults", default="clean,faults",
                        help="'clean' (no replica killed), 'faults' (two killed and restarted), or both")
    parser.add_argument("--die-at", default="8,18", help="the outer steps in whose sync replicas 3 and 2 die")
    parser.add_argument("--outer-steps", type=int, default=30, help="outer steps each run commits")
    parser.add_argument("--sync-every", type=int, default=10, help="inner steps between outer steps")
    parser.add_argument("--seed", type=int, default=0, help="model and batch seed")
    parser.add_argument("--width", type=int, default=8192, help="the CNN's hidden width (bench.tasks)")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds a restarted replica may still run after the others finished")
    parser.add_argument("--join-timeout-ms", type=int, default=2000,
                        help="how long the lighthouse waits for a replica that heartbeats but has not asked to join "
                             "(a restarted one still on its first inner steps) before forming a quorum without it")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in --out's torchft_faults.json (those of other rates and "
                             "configurations) and add these")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="rewrite the .md beside a saved torchft_faults.json, print the table and exit")
    parser.add_argument("--seeds", nargs="+", default=None, metavar="JSON",
                        help="saved torchft_faults.json files of runs with other seeds: write seeds.md into --out, "
                             "each configuration's final accuracy, stall and time lost per fault by seed, and exit")
    args = parser.parse_args()
    if args.render:
        saved = Path(args.render)
        write_report(json.loads(saved.read_text()), saved.parent)
        return
    if args.seeds:
        write_seeds([Path(f) for f in args.seeds], Path(args.out))
        return
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}: choose from {', '.join(CONFIGS)}")
    if shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) is None:
        raise SystemExit("bench.slownet.run_torchft_faults needs torchft (scripts/setup.sh installs it)")
    require_slownet("bench.slownet.run_torchft_faults")
    die_at = [int(s) for s in args.die_at.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "torchft_faults.json"
    records: list[dict] = json.loads(saved.read_text()) if args.append and saved.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            with SlowNet(ranks=HOSTS, rate=rate) as net:
                for config in configs:
                    for kind in args.faults.split(","):
                        record = run_one(net, rate, config, die_at if kind == "faults" else [], args, Path(tmp))
                        records = [r for r in records if (r["rate"], r["config"], bool(r["faults"])) !=
                                   (rate, config, kind == "faults")] + [record]
                        s = summary(record, None)
                        print(f"[{rate}] {record['name']:<26} {kind:<7} final {s['final']:.2f}, lost {s['lost']} "
                              f"steps, {record['wall_seconds']:.0f} s wall", flush=True)
                        # Saved after each run: an interrupted benchmark keeps what it measured.
                        (out / "torchft_faults.json").write_text(json.dumps(records, indent=1))
    write_report(records, out)


def write_report(records: list[dict], out: Path) -> None:
    first = records[0]
    configs = list(dict.fromkeys(r["config"] for r in records))
    options = "" if set(configs) == set(CONFIGS) else f" --configs {','.join(configs)}"
    options += f" --seed {first['seed']}" if first["seed"] else ""
    header = (f"# Lost replicas on an emulated network (4 hosts, one replica each)\n\n"
              f"`sudo python -m bench.slownet.run_torchft_faults --rates {','.join(dict.fromkeys(r['rate'] for r in records))}"
              f"{options} --out {out}` (seed {first['seed']}): the CNN of bench.tasks, width {first['width']}, Adam, "
              f"DiLoCo every {first['sync_every']} inner steps, {first['outer_steps']} outer steps; columns in the "
              "module's docstring.\n\n")
    text = f"{header}{report(records, 0.5)}\n\n{report(records, 1.0)}"
    (out / "torchft_faults.md").write_text(text + "\n")
    print("\n" + text, flush=True)


def write_seeds(files: list[Path], out: Path) -> None:
    """seeds.md: per rate and configuration, with and without faults, each seed's final
    accuracy (mean ± sd over the seeds), survivors' largest stall and time lost per fault."""
    rows: dict[tuple, list[tuple]] = {}
    for f in files:
        records = json.loads(f.read_text())
        for r in records:
            clean = next((c for c in records if (c["rate"], c["config"]) == (r["rate"], r["config"]) and not c["faults"]),
                         None)
            s = summary(r, clean)
            rows.setdefault((r["rate"], r["name"], bool(r["faults"])), []).append((r["seed"], s))
    lines = ["# Lost replicas on an emulated network: the seeds", "",
             f"`python -m bench.slownet.run_torchft_faults --seeds {' '.join(map(str, files))} --out {out}` from the "
             "runs of each seed (their folders' torchft_faults.md name the commands). By seed: final accuracy %, "
             "survivors' largest stall (s, over both faults), time lost per fault (s).", "",
             "| rate | configuration | faults | seeds | final accuracy %, mean ± sd | by seed: accuracy / stall / lost per fault |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (rate, name, faults), runs in rows.items():
        runs.sort(key=lambda run: run[0])
        finals = [s["final"] for _, s in runs]
        spread = f" ± {statistics.stdev(finals):.2f}" if len(finals) > 1 else ""
        cells = "; ".join(f"{seed}: {s['final']:.2f} / " + ("-" if s["stall_max"] is None else f"{s['stall_max']:.2f}")
                          + " / " + ("-" if s["per_fault"] is None else f"{s['per_fault']:.1f}") for seed, s in runs)
        lines.append(f"| {rate} | {name} | {'two' if faults else 'none'} | {len(runs)} | "
                     f"{statistics.fmean(finals):.2f}{spread} | {cells} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
