"""An alpha-beta cost model of ddlcomm's all-reduce algorithms over h hosts x l ranks, fitted to
measurements on the emulated cluster (bench.slownet.run_cost_model) and used to project
all-reduce and DDP step times to many hosts, beside NCCL's ring and tree formulas.

    python -m bench.cost_model --measurements docs/results/cost_model/measurements.json \
        --out docs/results/cost_model

The link is known (its rate B and one-way delay d: a path between hosts crosses two links, so its
latency is 2d and its round trip 4d); what the software adds is fitted, once for all links:
``alpha_net`` (seconds per step across hosts beyond the path's delay), ``eta`` (link time per
byte as a multiple of 1/B: framing, headers, the shaper), ``alpha_shm`` and ``beta_shm`` (a
step inside a host, over shared memory, and its cost per byte, the reduction included), and a
TCP window ``window``: one connection moves at most window / round trip. The time is linear in
the first four (``Terms``), so they are fitted by non-negative least squares on relative errors
for each window of a grid. The fit uses the clusters of the smallest host count only; the other
host counts are predicted, and their errors reported: the test of a model meant to extrapolate
in hosts. With ``--compressed`` the compressed all-reduces too: the exact model's transfers, and
fitted seconds per byte encoded for each compressor and per byte of their phases inside a host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ddlcomm.slownet.units import parse_rate, parse_time

from bench.plots import pyplot, say_written

PARAMETERS = ("alpha_net", "eta", "alpha_shm", "beta_shm")
# DDLCOMM_HALVING_DOUBLING_BYTES's default: the largest shard a hierarchical all-reduce sends
# across 8 or more hosts by halving-doubling (csrc/collectives/allreduce.cc).
HALVING_DOUBLING_BYTES = float(1 << 20)
WINDOWS = [float(1 << k) for k in range(19, 26)] + [math.inf]  # 512 KiB .. 32 MiB, unlimited


@dataclass(frozen=True)
class Cluster:
    hosts: int
    ranks_per_host: int

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host


@dataclass(frozen=True)
class Link:
    """A host's link: ``rate`` in bytes/s, ``delay`` one way in s (of each link: host to switch)."""

    rate: float
    delay: float

    @classmethod
    def named(cls, rate: str, delay: str) -> "Link":
        return cls(parse_rate(rate) / 8, parse_time(delay))

    def seconds_per_byte(self, streams: int, window: float) -> float:
        """Link time per byte with ``streams`` connections sharing it, each window-limited."""
        return max(1 / self.rate, 4 * self.delay / (streams * window))


@dataclass(frozen=True)
class Terms:
    """One all-reduce's steps and bytes: across hosts (``streams`` connections share a host's
    link) and inside a host."""

    net_steps: float
    net_bytes: float
    streams: int
    shm_steps: float
    shm_bytes: float


def terms(algorithm: str, cluster: Cluster, nbytes: float, halving_bytes: float = HALVING_DOUBLING_BYTES) -> Terms:
    """What one all-reduce of ``nbytes`` costs. Every step waits for its slowest link; ranks of
    one host that cross the network at once share its link.

    - ring (and gloo's, also a ring): 2(n-1) steps of m/n bytes over consecutive ranks, one
      ring edge per host link. Bandwidth: every step waits for the network edge, 2(n-1)/n of the
      buffer on each host link. Latency: steps pipeline, so a chunk's path around the ring sets
      it, and h of its n hops per turn cross hosts: 2(n-1) h/n network hops, the rest in memory.
    - recursive_doubling: log2 n exchanges of m bytes with the partner r ^ 2^k; partners inside
      a host (2^k < l) use shared memory; across hosts all l ranks of a host exchange at once.
      Each exchange's m bytes are reduced after they arrive (not overlapped, as in the ring):
      counted with the bytes inside a host.
    - halving_doubling: log2 n exchanges of m/2, m/4, ..., m/n with the partner r ^ n/2,
      r ^ n/4, ..., then the same back; the first log2 h of each way cross hosts, all l ranks
      of a host at once: 2(n-l)/n of the buffer per rank, 2 l (h-1)/h m on each host link.
      The reductions pipeline behind the transfers, as the ring's.
    - hierarchical: ring reduce-scatter and all-gather inside the host (2(l-1) steps of m/l),
      then for each local rank's m/l shard an all-reduce over the h hosts, the l of them
      sharing the link, with 2(h-1)/h of the buffer per link: halving-doubling (2 log2 h steps)
      over a power of two of at least 8 hosts for shards up to ``halving_bytes``, else a ring
      (2(h-1) steps; csrc/collectives/allreduce.cc).
    """
    h, l, n, m = cluster.hosts, cluster.ranks_per_host, cluster.ranks, float(nbytes)
    if algorithm in ("ring", "gloo"):
        hops = 2 * (n - 1)
        if h == 1:
            return Terms(0, 0, 1, hops, hops * m / n)
        return Terms(hops * h / n, hops * m / n, 1, hops * (n - h) / n, 0)
    if algorithm == "recursive_doubling":
        if n & (n - 1):
            raise ValueError(f"recursive doubling is modelled for a power-of-two group, not {n}")
        inside = int(math.log2(l)) if l & (l - 1) == 0 else 0
        across = int(math.log2(n)) - inside
        return Terms(across, across * l * m, l, inside, (inside + across) * m)
    if algorithm == "halving_doubling":
        if n & (n - 1) or l & (l - 1):
            raise ValueError(f"halving-doubling is modelled for a power-of-two group and host, not {h} x {l}")
        inside = int(math.log2(l))
        return Terms(2 * (int(math.log2(n)) - inside), 2 * l * (h - 1) / h * m, l, 2 * inside, 2 * (l - 1) / n * m)
    if algorithm == "hierarchical":
        halving = h >= 8 and h & (h - 1) == 0 and m / l <= halving_bytes
        across = 2 * math.log2(h) if halving else 2 * (h - 1)
        return Terms(across, 2 * (h - 1) * m / h, l, 2 * (l - 1), 2 * (l - 1) * m / l)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def coefficients(t: Terms, link: Link, window: float) -> tuple[list[float], float]:
    """(the multipliers of PARAMETERS, the seconds the link itself adds: its delay)."""
    per_byte = link.seconds_per_byte(t.streams, window) * link.rate  # in units of 1/B
    return [t.net_steps, t.net_bytes * per_byte / link.rate, t.shm_steps, t.shm_bytes], t.net_steps * 2 * link.delay


def predict(algorithm: str, cluster: Cluster, nbytes: float, link: Link, params: dict[str, float],
            halving_bytes: float = HALVING_DOUBLING_BYTES) -> float:
    row, fixed = coefficients(terms(algorithm, cluster, nbytes, halving_bytes), link, params["window"])
    return fixed + sum(c * params[p] for c, p in zip(row, PARAMETERS))


def _link(record: dict) -> Link:
    return Link.named(record["rate"], record["delay"])


def nnls(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Non-negative least squares of ``a x = b`` for a few columns: every subset of them held at
    zero is tried and the best fit with all others >= 0 kept (the first found among equals)."""
    best, best_error = torch.zeros(a.shape[1], dtype=a.dtype), math.inf
    for k in range(1, a.shape[1] + 1):
        for cols in map(list, itertools.combinations(range(a.shape[1]), k)):
            sub = a[:, cols]
            if torch.linalg.matrix_rank(sub) < len(cols):
                continue
            x = torch.linalg.lstsq(sub, b[:, None]).solution.flatten()
            error = float(((sub @ x) - b).square().sum())
            if bool((x >= 0).all()) and error < best_error - 1e-12 * len(b):
                best = torch.zeros(a.shape[1], dtype=a.dtype)
                best[cols] = x
                best_error = error
    return best, best_error


def fit(records: list[dict]) -> dict[str, float]:
    """For each window of the grid, non-negative least squares of the relative error over
    ``records`` (algorithm, hosts, ranks_per_host, bytes, rate, delay, seconds); then the window
    whose fit is best. Fits equal to rounding keep the first found (alpha_net before
    alpha_shm): where the data cannot tell the two latencies apart, which one takes both must
    not depend on the machine's rounding."""
    seconds = torch.tensor([r["seconds"] for r in records], dtype=torch.float64)
    best: dict[str, float] = {}
    best_error = math.inf
    for window in WINDOWS:
        rows, fixed = zip(*(coefficients(terms(r["algorithm"], Cluster(r["hosts"], r["ranks_per_host"]), r["bytes"]),
                                         _link(r), window) for r in records))
        a = torch.tensor(rows, dtype=torch.float64) / seconds[:, None]
        b = 1 - torch.tensor(fixed, dtype=torch.float64) / seconds  # relative residuals
        x, error = nnls(a, b)
        if error < best_error - 1e-12 * len(b):
            best, best_error = {**dict(zip(PARAMETERS, map(float, x))), "window": window}, error
    return best


def evaluate(records: list[dict]) -> tuple[dict[str, float], list[dict]]:
    """The parameters fitted on ddlcomm's algorithms at the smallest host count (every link),
    and every record with its prediction and relative error (``fitted``: whether it was in the
    fit; gloo's ring, never fitted, is predicted by ddlcomm's ring)."""
    smallest = min(r["hosts"] for r in records)
    params = fit([r for r in records if r["hosts"] == smallest and r["algorithm"] != "gloo"])
    rows = []
    for r in records:
        predicted = predict(r["algorithm"], Cluster(r["hosts"], r["ranks_per_host"]), r["bytes"], _link(r), params)
        rows.append({**r, "predicted": predicted, "error": (predicted - r["seconds"]) / r["seconds"],
                     "fitted": r["hosts"] == smallest and r["algorithm"] != "gloo"})
    return params, rows


# The compressors of bench.compressed's rows ("ddlcomm 1-bit flat", "... hierarchical").
COMPRESSORS = {"fp16": "FP16", "1-bit": "OneBit", "ternary": "Ternary"}


def payload_ratio(name: str, numel: int = 1 << 24) -> float:
    """Payload bytes per float32 byte of compressor ``name``, from the plan the C++ all-reduce
    sizes its messages with (ddlcomm.compressed.wire_bytes: 2 (n-1)/n chunks of payload)."""
    from ddlcomm import compressed, compressors

    n = 4
    return compressed.wire_bytes(getattr(compressors, COMPRESSORS[name])(), numel, n) / (2 * (n - 1) / n * 4 * numel)


def compressed_terms(plan: str, cluster: Cluster, nbytes: float, ratio: float) -> tuple[Terms, float]:
    """(terms, float32 bytes each rank encodes) of a compressed all-reduce of ``nbytes`` float32
    bytes whose payload is ``ratio`` of them (csrc/torch/collective_compressed.cc): a
    scatter-reduce-gather, two steps across hosts (each payload leaves as it is encoded, the
    pieces pipeline), with 2 (k-1)/k of a rank's vector as payload among k members. ``flat``:
    the n ranks, each sending to the n - l off its host; ``hierarchical``: an exact ring
    reduce-scatter and all-gather inside the host, and the host's l shards compressed across
    the h hosts, one copy of the traffic per host link."""
    h, l, n, m = cluster.hosts, cluster.ranks_per_host, cluster.ranks, float(nbytes)
    if plan == "flat":
        return Terms(2 if h > 1 else 0, 2 * l * (n - l) / n * m * ratio, max(1, l * (n - l)), 0, 0), m
    if plan == "hierarchical":
        return Terms(2 if h > 1 else 0, 2 * (h - 1) / h * m * ratio, max(1, l * (h - 1)), 2 * (l - 1),
                     2 * (l - 1) / l * m), m / l
    raise ValueError(f"unknown plan {plan!r}")


def _compressed_row(name: str, plan: str, cluster: Cluster, nbytes: float, link: Link, params: dict[str, float],
                    load: float) -> tuple[float, float, float]:
    """(seconds of the transfers, float32 bytes encoded x load, bytes of the phases inside a host)."""
    t, encoded = compressed_terms(plan, cluster, nbytes, payload_ratio(name))
    row, fixed = coefficients(t, link, params["window"])
    net = fixed + row[0] * params["alpha_net"] + row[1] * params["eta"] + row[2] * params["alpha_shm"]
    return net, encoded * load, row[3]


def predict_compressed(name: str, plan: str, cluster: Cluster, nbytes: float, link: Link, params: dict[str, float],
                       codec: dict[str, float], load: float = 1.0) -> float:
    """Seconds of a compressed all-reduce: the exact model's terms for its transfers, ``codec[name]``
    seconds per float32 byte encoded (encode, reduce and decode together) times ``load`` (the
    ranks that share a core), and ``codec["beta_shm"]`` per byte of its phases inside a host."""
    net, encoded, shm = _compressed_row(name, plan, cluster, nbytes, link, params, load)
    return net + codec[name] * encoded + codec["beta_shm"] * shm


def _load(record: dict, cores: int) -> float:
    """Ranks per core in a measurement: every emulated host shares the one machine's cores."""
    return max(1.0, record["hosts"] * record["ranks_per_host"] / cores)


def _record_row(record: dict, params: dict[str, float], cores: int) -> tuple[float, float, float]:
    return _compressed_row(record["name"], record["plan"], Cluster(record["hosts"], record["ranks_per_host"]),
                           record["bytes"], _link(record), params, _load(record, cores))


def fit_codec(records: list[dict], params: dict[str, float], cores: int) -> dict[str, float]:
    """Seconds per encoded byte of each compressor, and per byte of the phases inside a host
    (``beta_shm``: the exact model's, refitted, as these phases share the cores with the
    encoding), by non-negative least squares of the relative error of ``records``, the exact
    model's other constants held."""
    names = list(dict.fromkeys(r["name"] for r in records))
    seconds = torch.tensor([r["seconds"] for r in records], dtype=torch.float64)
    rows, b = [], []
    for r in records:
        net, encoded, shm = _record_row(r, params, cores)
        rows.append([encoded if r["name"] == name else 0.0 for name in names] + [shm])
        b.append(1 - net / r["seconds"])
    x, _ = nnls(torch.tensor(rows, dtype=torch.float64) / seconds[:, None], torch.tensor(b, dtype=torch.float64))
    return dict(zip(names + ["beta_shm"], map(float, x)))


def evaluate_compressed(records: list[dict], params: dict[str, float], cores: int
                        ) -> tuple[dict[str, float], list[dict]]:
    """The codec constants fitted at the smallest host count, and every record with its
    prediction, relative error and whether it was fitted."""
    smallest = min(r["hosts"] for r in records)
    codec = fit_codec([r for r in records if r["hosts"] == smallest], params, cores)
    rows = []
    for r in records:
        net, encoded, shm = _record_row(r, params, cores)
        predicted = net + codec[r["name"]] * encoded + codec["beta_shm"] * shm
        rows.append({**r, "predicted": predicted, "error": (predicted - r["seconds"]) / r["seconds"],
                     "fitted": r["hosts"] == smallest})
    return codec, rows


def compressed_records(path: str) -> list[dict]:
    """The compressed all-reduce rows of a bench.slownet.run_compressed slownet.json,
    given as ``FILE:HxL`` (its hosts x ranks per host) or ``FILE:HxL:DELAY``."""
    name, layout, *delay = path.split(":")
    hosts, per_host = (int(v) for v in layout.split("x"))
    rows = json.loads(Path(name).read_text())
    numel = next(r["numel"] for r in rows if "numel" in r)  # the run's gloo row carries it
    out = []
    for r in rows:
        words = r["method"].split()
        if r["kind"] == "allreduce" and len(words) == 3 and words[1] in COMPRESSORS:
            out.append({"name": words[1], "plan": words[2], "hosts": hosts, "ranks_per_host": per_host,
                        "bytes": 4 * numel, "rate": r["rate"], "delay": delay[0] if delay else "0ms",
                        "seconds": r["seconds"], "source": name})
    return out


def nccl_ring(cluster: Cluster, nbytes: float, link: Link, params: dict[str, float]) -> float:
    """NCCL's ring all-reduce as its tuning model counts it (src/graph/tuning.cc): 2(n-1) steps,
    2(h-1) of them across hosts at the network's latency, the others inside at the host's;
    2(n-1)/n of the buffer on each host link (one connection)."""
    h, n = cluster.hosts, cluster.ranks
    inter = 2 * (h - 1)
    per_byte = params["eta"] * link.seconds_per_byte(1, params["window"])
    return (inter * (params["alpha_net"] + 2 * link.delay) + (2 * (n - 1) - inter) * params["alpha_shm"]
            + 2 * (n - 1) / n * nbytes * per_byte)


def nccl_tree(cluster: Cluster, nbytes: float, link: Link, params: dict[str, float]) -> float:
    """NCCL's double binary tree across hosts (a chain inside each), as its tuning model counts
    it: a reduce up and a broadcast down, pipelined, so 2 m on each link, 2 log2(h) latency steps
    across hosts and 2(l - 1) inside."""
    h, l = cluster.hosts, cluster.ranks_per_host
    per_byte = params["eta"] * link.seconds_per_byte(1, params["window"])
    return (2 * math.ceil(math.log2(max(h, 2))) * (params["alpha_net"] + 2 * link.delay) + 2 * nbytes * per_byte
            + 2 * (l - 1) * params["alpha_shm"])


def projections(params: dict[str, float], link: Link, nbytes: float, compute: float,
                hosts: tuple[int, ...] = (8, 64, 1000, 1024), ranks_per_host: int = 8,
                codec: dict[str, float] | None = None) -> list[dict]:
    """All-reduce time of ``nbytes`` and DDP step time (``compute`` seconds plus the all-reduce,
    none of it overlapped: an upper bound) at each host count x ``ranks_per_host`` (1,000 hosts
    take the ring across them; "hierarchical, halving-doubling across", for a power of two of
    hosts only, is what DDLCOMM_HALVING_DOUBLING_BYTES at or above the shard gives).
    With ``codec`` (fit_codec's), the 1-bit all-reduce too, up to 64 hosts, each rank with a
    core of its own."""
    out = []
    for h in hosts:
        cluster = Cluster(h, ranks_per_host)
        times = {"ring": predict("ring", cluster, nbytes, link, params),
                 "hierarchical": predict("hierarchical", cluster, nbytes, link, params),
                 "NCCL ring": nccl_ring(cluster, nbytes, link, params),
                 "NCCL tree": nccl_tree(cluster, nbytes, link, params)}
        if h & (h - 1) == 0:
            times["hierarchical, halving-doubling across"] = predict("hierarchical", cluster, nbytes, link, params,
                                                                     math.inf)
        # Its exchanges are all-to-alls: 2 (k-1) messages a rank, whose own cost the model has
        # no term for, small beside the rest up to tens of hosts.
        if codec and "1-bit" in codec and h <= 64:
            for plan in ("flat", "hierarchical"):
                times[f"1-bit {plan}"] = predict_compressed("1-bit", plan, cluster, nbytes, link, params, codec)
        out.append({"hosts": h, "ranks_per_host": ranks_per_host, "allreduce": times,
                    "step": {k: compute + v for k, v in times.items()}})
    return out


def error_table(rows: list[dict]) -> str:
    lines = ["| hosts x ranks | rate | delay | algorithm | fitted on | median abs. error | max abs. error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    keys = dict.fromkeys((r["hosts"], r["ranks_per_host"], r["rate"], r["delay"], r["algorithm"]) for r in rows)
    for hosts, per_host, rate, delay, algorithm in keys:
        errors = [abs(r["error"]) for r in rows if (r["hosts"], r["ranks_per_host"], r["rate"], r["delay"],
                                                     r["algorithm"]) == (hosts, per_host, rate, delay, algorithm)]
        fitted = next(r["fitted"] for r in rows if (r["hosts"], r["rate"], r["delay"], r["algorithm"])
                      == (hosts, rate, delay, algorithm))
        basis = "these" if fitted else "ddlcomm's" if algorithm == "gloo" and hosts == min(
            x["hosts"] for x in rows if (x["rate"], x["delay"]) == (rate, delay)) else "fewer hosts"
        lines.append(f"| {hosts} x {per_host} | {rate} | {delay} | {algorithm} | {basis} "
                     f"| {100 * statistics.median(errors):.0f}% | {100 * max(errors):.0f}% |")
    return "\n".join(lines)


def compressed_table(rows: list[dict]) -> str:
    lines = ["| hosts x ranks | rate | compressor | plan | fitted on | measured | predicted | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['hosts']} x {r['ranks_per_host']} | {r['rate']} | {r['name']} | {r['plan']} | "
                     f"{'these' if r['fitted'] else 'fewer hosts'} | {r['seconds']:.3f} s | {r['predicted']:.3f} s | "
                     f"{100 * r['error']:+.0f}% |")
    return "\n".join(lines)


def plot(rows: list[dict], projected: dict[str, list[dict]], path: Path, compressed_rows: list[dict] = ()) -> bool:
    """Measured against predicted (every record, the compressed ones as squares), and the
    projected all-reduce time by hosts; False (nothing written) without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.2))
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows if r["algorithm"] != "gloo"):
        for fitted, marker in ((True, "o"), (False, "x")):
            points = [(r["seconds"], r["predicted"]) for r in rows if r["algorithm"] == algorithm and r["fitted"] == fitted]
            if points:
                left.scatter(*zip(*points), marker=marker, s=18,
                             label=f"{algorithm} ({'fitted' if fitted else 'more hosts, predicted'})")
    for name in dict.fromkeys(r["name"] for r in compressed_rows):
        points = [(r["seconds"], r["predicted"]) for r in compressed_rows if r["name"] == name]
        left.scatter(*zip(*points), marker="s", s=18, label=f"compressed {name}")
    every = [*rows, *compressed_rows]
    low = min(min(r["seconds"], r["predicted"]) for r in every)
    high = max(max(r["seconds"], r["predicted"]) for r in every)
    left.plot([low, high], [low, high], color="grey", linewidth=0.8)
    left.set(xscale="log", yscale="log", xlabel="measured (s)", ylabel="predicted (s)",
             title="all-reduce on the emulated cluster")
    left.legend(fontsize=7)
    for style, (key, points) in zip(("-", "--", ":"), projected.items()):  # a line style per link,
        names = dict.fromkeys(name for p in points for name in p["allreduce"])
        for color, name in enumerate(names):                               # a colour per algorithm
            mine = [p for p in points if name in p["allreduce"]]
            right.plot([p["hosts"] for p in mine], [p["allreduce"][name] for p in mine], marker="o",
                       linestyle=style, color=f"C{color}", label=f"{name}, {key}")
    right.set(xscale="log", yscale="log", xlabel="hosts (8 ranks each)", ylabel="seconds",
              title="projected all-reduce of the gradient")
    right.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measurements", required=True, help="measurements.json of run_cost_model")
    parser.add_argument("--out", help="folder for model.json (fit, errors, projections) and model.png (matplotlib)")
    parser.add_argument("--project", default="10gbit/0.05ms,1gbit/5ms,100mbit/25ms",
                        help="links (rate/one-way delay of each link) to project to many hosts")
    parser.add_argument("--bytes", type=float, default=100e6, help="gradient bytes of the projection")
    parser.add_argument("--compute", type=float, default=0.3, help="compute seconds of a DDP step in the projection")
    parser.add_argument("--compressed", action="append", default=[], metavar="FILE:HxL[:DELAY]",
                        help="a run_compressed slownet.json and its hosts x ranks per host (one-way delay, "
                             "default 0): its compressed all-reduces; repeatable")
    parser.add_argument("--cores", type=int, default=2, help="cores of the machine the emulated hosts shared")
    args = parser.parse_args()
    records = json.loads(Path(args.measurements).read_text())
    params, rows = evaluate(records)
    ours = [abs(r["error"]) for r in rows if r["algorithm"] != "gloo"]
    held_out = [abs(r["error"]) for r in rows if not r["fitted"] and r["algorithm"] != "gloo"]
    print(error_table(rows))
    print("\nfitted on the smallest host count: " + ", ".join(f"{k} {v:.3g}" for k, v in params.items()))
    print(f"median abs. error, ddlcomm's algorithms: {100 * statistics.median(ours):.1f}% over {len(ours)} "
          f"measurements; on the host counts not fitted: {100 * statistics.median(held_out):.1f}% over "
          f"{len(held_out)}")
    # The projection's constants come from every host count: with 2 ranks per host alone,
    # latency inside a host cannot be told from latency across (as many steps of each).
    every = fit([r for r in records if r["algorithm"] != "gloo"])
    print("fitted on every host count (for the projection): " + ", ".join(f"{k} {v:.3g}" for k, v in every.items()))
    compressed = [r for path in args.compressed for r in compressed_records(path)]
    codec, codec_every, compressed_rows = None, None, []
    if compressed:
        codec, compressed_rows = evaluate_compressed(compressed, params, args.cores)
        print("\ncompressed all-reduces (codec fitted on the smallest host count, s per float32 byte: "
              + ", ".join(f"{k} {v:.3g}" for k, v in codec.items()) + ")")
        print(compressed_table(compressed_rows))
        for fitted in (True, False):
            errors = [abs(r["error"]) for r in compressed_rows if r["fitted"] == fitted]
            if errors:
                print(f"median abs. error, {'fitted' if fitted else 'more hosts'}: "
                      f"{100 * statistics.median(errors):.1f}% over {len(errors)}")
        codec_every = fit_codec(compressed, every, args.cores)
    projected = {}
    for key in args.project.split(","):
        link = Link.named(*key.split("/"))
        projected[key] = projections(every, link, args.bytes, args.compute, codec=codec_every)
        print(f"\nprojected, {key}: {args.bytes / 1e6:.0f} MB all-reduce, s")
        for p in projected[key]:
            print(f"  {p['hosts']} x {p['ranks_per_host']}: " + ", ".join(f"{k} {v:.3f}" for k, v in p["allreduce"].items()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps({"fit": params, "fit_every_host_count": every, "rows": rows,
                                                    "codec": codec, "codec_every_host_count": codec_every,
                                                    "compressed_rows": compressed_rows,
                                                    "projections": projected,
                                                    "bytes": args.bytes, "compute": args.compute}, indent=1))
        command = " ".join(["python -m bench.cost_model --measurements", args.measurements,
                            *(f"--compressed {c}" for c in args.compressed), "--out", args.out])
        extra = f"\n## Compressed all-reduces\n\n{compressed_table(compressed_rows)}\n" if compressed_rows else ""
        (out / "errors.md").write_text(f"# Cost model: prediction error per configuration\n\n`{command}` "
                                       f"(docs/cost-model.md).\n\n{error_table(rows)}\n{extra}")
        print()
        say_written([out / "model.json", out / "errors.md"], out / "model.png",
                    plot(rows, projected, out / "model.png", compressed_rows))


if __name__ == "__main__":
    main()
