"""The all-reduce cost model (bench.cost_model): its formulas agree with each other where
the algorithms coincide, and its fit recovers the constants that made the data. Its accuracy on
the emulated cluster is measured by hand (docs/cost-model.md)."""

from __future__ import annotations

import math
import random

import pytest

from bench.cost_model import (Cluster, Link, compressed_terms, evaluate, evaluate_compressed, fit,
                                      nccl_ring, payload_ratio, predict, predict_compressed, projections, terms)

TRUE = {"alpha_net": 2e-4, "eta": 1.05, "alpha_shm": 2e-5, "beta_shm": 5e-10, "window": float(4 << 20)}
LINKS = [("100mbit", "0.05ms"), ("1gbit", "5ms"), ("10gbit", "25ms")]


def synthetic(noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"algorithm": a, "hosts": h, "ranks_per_host": 2, "bytes": m, "rate": rate, "delay": delay,
             "seconds": predict(a, Cluster(h, 2), m, Link.named(rate, delay), TRUE) * (1 + rng.uniform(-noise, noise))}
            for rate, delay in LINKS for h in (2, 4) for a in ("ring", "recursive_doubling", "halving_doubling", "hierarchical")
            for m in (65536, 1 << 20, 8 << 20)]


def test_algorithms_coincide_where_they_should() -> None:
    m = 1 << 20
    def cost(t):  # (streams matter only with bytes across hosts)
        return t.net_steps, t.net_bytes, t.shm_steps, t.shm_bytes

    # One rank per host: the hierarchy is the flat ring over 3 hosts (halving-doubling over 8, below).
    assert terms("hierarchical", Cluster(3, 1), m) == terms("ring", Cluster(3, 1), m)
    # One host: the hierarchy is the ring inside it, and the ring uses shared memory only.
    assert cost(terms("hierarchical", Cluster(1, 4), m)) == cost(terms("ring", Cluster(1, 4), m))
    assert (terms("ring", Cluster(1, 4), m).net_steps, terms("ring", Cluster(1, 4), m).net_bytes) == (0, 0)
    # The ring moves 2(n-1)/n of the buffer; the hierarchy puts 2(h-1)/h on each host's link.
    assert terms("ring", Cluster(2, 2), m).net_bytes == pytest.approx(2 * 3 / 4 * m)
    assert terms("hierarchical", Cluster(2, 2), m).net_bytes == pytest.approx(2 * 1 / 2 * m)
    ring = terms("ring", Cluster(2, 2), m)
    assert ring.net_steps + ring.shm_steps == 6
    # Recursive doubling: log2(n) exchanges, log2(l) of them inside a host, l streams across.
    rd = terms("recursive_doubling", Cluster(4, 2), m)
    assert (rd.net_steps, rd.net_bytes, rd.streams, rd.shm_steps) == (2, 2 * 2 * m, 2, 1)
    # Halving-doubling: the ring's bytes in 2 log2 steps; over one-rank hosts it is the hierarchy.
    hd = terms("halving_doubling", Cluster(4, 2), m)
    assert (hd.net_steps, hd.shm_steps, hd.streams) == (4, 2, 2)
    assert hd.net_bytes == pytest.approx(2 * terms("hierarchical", Cluster(4, 2), m).net_bytes)
    assert terms("halving_doubling", Cluster(8, 1), m) == terms("hierarchical", Cluster(8, 1), m)
    assert terms("hierarchical", Cluster(8, 1), m).net_steps == 6  # 2 log2 8, where the ring takes 14
    # ... up to a shard of DDLCOMM_HALVING_DOUBLING_BYTES, and from 8 hosts: a ring otherwise.
    assert terms("hierarchical", Cluster(8, 2), 4 * m).net_steps == 14
    assert terms("hierarchical", Cluster(8, 2), 4 * m, halving_bytes=2 * m).net_steps == 6
    assert terms("hierarchical", Cluster(4, 1), m) == terms("ring", Cluster(4, 1), m)
    # One rank per host, every hop crosses hosts: NCCL's count and the ring's agree.
    link = Link.named("1gbit", "5ms")
    assert nccl_ring(Cluster(8, 1), m, link, TRUE) == pytest.approx(predict("ring", Cluster(8, 1), m, link, TRUE))
    for algorithm in ("recursive_doubling", "halving_doubling"):
        with pytest.raises(ValueError, match="power-of-two"):
            terms(algorithm, Cluster(3, 1), m)


def test_a_window_limits_a_long_link() -> None:
    """1 Gbit/s at 25 ms a link (100 ms round trip): 4 MiB a round trip is 42 MB/s, not 125."""
    link = Link.named("1gbit", "25ms")
    assert link.seconds_per_byte(1, 4 << 20) == pytest.approx(0.1 / (4 << 20))
    assert link.seconds_per_byte(8, math.inf) == pytest.approx(8 / 1e9)


def test_fit_recovers_the_constants_and_predicts_more_hosts() -> None:
    records = synthetic()
    got = fit(records)
    for name, value in TRUE.items():
        assert got[name] == pytest.approx(value, rel=1e-6), (name, got)
    # With 2 ranks per host every algorithm takes as many steps inside a host as across, so
    # the two latencies cannot be told apart (alpha_net takes both): 4 hosts stay within 2%.
    params, rows = evaluate(records)
    assert params["alpha_net"] + params["alpha_shm"] == pytest.approx(TRUE["alpha_net"] + TRUE["alpha_shm"], rel=1e-6)
    assert {r["fitted"] for r in rows if r["hosts"] == 4} == {False}
    assert max(abs(r["error"]) for r in rows if r["fitted"]) < 1e-6
    assert max(abs(r["error"]) for r in rows) < 0.02


def test_fit_stays_non_negative_and_close_under_noise() -> None:
    records = synthetic(noise=0.1, seed=3)
    got = fit(records)
    assert all(v >= 0 for v in got.values()), got
    assert got["eta"] == pytest.approx(TRUE["eta"], rel=0.1)
    errors = sorted(abs(r["error"]) for r in evaluate(records)[1])
    assert errors[len(errors) // 2] < 0.1


def test_projection_orders_the_algorithms_as_their_formulas_say() -> None:
    rows = projections(TRUE, Link.named("1gbit", "5ms"), 100e6, compute=0.3, hosts=(8, 1000, 1024))
    big, power_of_two = rows[1]["allreduce"], rows[2]["allreduce"]
    # At 1000 hosts every ring's 2(h-1) latency steps dominate; the tree's are logarithmic.
    assert big["NCCL tree"] < big["hierarchical"] and big["NCCL tree"] < big["ring"]
    # 12.5 MB shards take the ring across hosts by default; with halving-doubling across 1024
    # hosts the hierarchy takes as many steps as the tree, with the same bytes on the link:
    # within its phases inside the host of the tree.
    halving = power_of_two["hierarchical, halving-doubling across"]
    assert power_of_two["hierarchical"] > power_of_two["ring"] / 2
    assert power_of_two["NCCL tree"] < halving < 1.1 * power_of_two["NCCL tree"]
    assert halving < power_of_two["hierarchical"] / 5
    assert rows[0]["step"]["ring"] == pytest.approx(0.3 + rows[0]["allreduce"]["ring"])


CODEC = {"fp16": 9e-10, "1-bit": 4e-10, "ternary": 7e-10, "beta_shm": 8e-10}


def test_compressed_terms_send_one_copy_per_host_link() -> None:
    m, q = float(1 << 26), 1 / 32
    flat, encoded = compressed_terms("flat", Cluster(2, 2), m, q)
    # Each rank sends 2 of its 4 chunks' payloads off the host, twice: both ranks share the link.
    assert (flat.net_steps, flat.net_bytes, encoded) == (2, pytest.approx(2 * 2 * 2 / 4 * m * q), m)
    hier, encoded = compressed_terms("hierarchical", Cluster(4, 2), m, q)
    assert (hier.net_bytes, hier.shm_bytes, encoded) == (pytest.approx(2 * 3 / 4 * m * q), m, m / 2)
    # The C++ plan's payload: 1-bit is a bit per element and a scale per block.
    assert 1 / 32 < payload_ratio("1-bit") < 1.2 / 32 and payload_ratio("fp16") == pytest.approx(0.5, rel=1e-3)


def test_codec_fit_recovers_its_constants_and_predicts_more_hosts() -> None:
    records = [{"name": name, "plan": plan, "hosts": h, "ranks_per_host": 2, "bytes": 1 << 26, "rate": rate,
                "delay": delay}
               for name in ("fp16", "1-bit", "ternary") for plan in ("flat", "hierarchical") for h in (2, 4)
               for rate, delay in LINKS]
    for r in records:
        load = r["hosts"] * 2 / 2
        r["seconds"] = predict_compressed(r["name"], r["plan"], Cluster(r["hosts"], 2), r["bytes"],
                                          Link.named(r["rate"], r["delay"]), TRUE, CODEC, load)
    codec, rows = evaluate_compressed(records, TRUE, cores=2)
    for name, value in CODEC.items():
        assert codec[name] == pytest.approx(value, rel=1e-6), (name, codec)
    assert {r["fitted"] for r in rows if r["hosts"] == 4} == {False}
    assert max(abs(r["error"]) for r in rows) < 1e-6
