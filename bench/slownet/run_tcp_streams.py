"""Raw TCP throughput on the emulated link: k streams from each of 2 hosts to the other at once
(both directions, as a ring's traffic crosses a host's link; ``--one-way``: host 0 to host 1
only), for each k of ``--streams``: the ceiling the collectives' transfers across hosts are
measured against.

    sudo python -m bench.slownet.run_tcp_streams --rates 100mbit --streams 1,2,4

Each host runs a sink (its k connections drained by threads) and a source (k threads, each
sending its share of ``--bytes``); a direction's rate is its bytes over the time from its first to
its last byte received. The standard library only, beside ddlcomm.slownet.
"""

from __future__ import annotations

import subprocess
import sys

from ddlcomm.slownet import SlowNet

from bench.slownet.driver import bench_parser, require_slownet

PORT = 29700
SINK = r"""
import socket, sys, threading, time
k = int(sys.argv[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[2])))
server.listen(k)
print("ready", flush=True)
lock, received, first, last = threading.Lock(), [0], [], []
def drain(conn):
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        with lock:
            if not first:
                first.append(time.monotonic())
            received[0] += len(chunk)
    last.append(time.monotonic())
threads = [threading.Thread(target=drain, args=(server.accept()[0],)) for _ in range(k)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(received[0], max(last) - first[0], flush=True)
"""
SOURCE = r"""
import socket, sys, threading
k, share, host, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
block = b"x" * (1 << 20)
def send():
    with socket.create_connection((host, port)) as s:
        left = share
        while left > 0:
            s.sendall(block[:min(left, len(block))])
            left -= len(block)
threads = [threading.Thread(target=send) for _ in range(k)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def measure(rate: str, delay: str, streams: int, nbytes: int, timeout: float, both: bool = True) -> list[float]:
    """Bits per second into each receiving host (1, and 0 too when ``both``), with ``streams``
    connections each way."""
    receivers = (1, 0) if both else (1,)
    with SlowNet(ranks=2, rate=rate, delay=delay) as net:
        sinks = [net.popen(h, [sys.executable, "-c", SINK, str(streams), str(PORT)], stdout=subprocess.PIPE,
                           text=True) for h in receivers]
        for sink in sinks:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        sources = [net.popen(1 - h, [sys.executable, "-c", SOURCE, str(streams), str(nbytes // streams),
                                     net.address(h), str(PORT)]) for h in receivers]
        for source in sources:
            source.wait(timeout=timeout)
        rates = []
        for sink in sinks:
            assert sink.stdout is not None
            received, seconds = sink.stdout.readline().split()
            sink.wait(timeout=60)
            rates.append(int(received) * 8 / float(seconds))
    return rates


def main() -> None:
    parser = bench_parser(__doc__, "", 600)
    parser.add_argument("--streams", default="1,2,4", help="comma-separated connections each way")
    parser.add_argument("--delay", default="0", help="one-way delay of every link (tc syntax)")
    parser.add_argument("--bytes", type=int, default=50_000_000, help="bytes each way, split over the streams")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (each printed)")
    parser.add_argument("--one-way", action="store_true", help="host 0 sends to host 1 only")
    args = parser.parse_args()
    require_slownet("bench.slownet.run_tcp_streams")
    for rate in args.rates.split(","):
        for k in (int(s) for s in args.streams.split(",")):
            for _ in range(args.repeats):
                into = measure(rate, args.delay, k, args.bytes, args.timeout, both=not args.one_way)
                print(f"{rate}, delay {args.delay}, {k} stream(s) {'one way' if args.one_way else 'each way'}: "
                      + ", ".join(f"into host {h} {r / 1e6:.1f} Mbit/s" for h, r in zip((1, 0), into)), flush=True)


if __name__ == "__main__":
    main()
