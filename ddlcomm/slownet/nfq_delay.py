#!/usr/bin/env python3
"""Delay every packet of an NFQUEUE by a fixed time: netem's ``delay`` for kernels without netem.

Run it inside a network namespace, then send packets to the queue there, e.g.::

    ip netns exec NS python3 ddlcomm/slownet/nfq_delay.py --queue 0 --delay 0.005   # "ready"; Ctrl-D stops it
    ip netns exec NS iptables -A INPUT -i veth0 -j NFQUEUE --queue-num 0   # another shell

It binds the queue over an AF_NETLINK/NETLINK_NETFILTER socket (the nfnetlink_queue
protocol, spoken directly with ``struct``: no libnetfilter_queue), asks for metadata
only (the payload stays in the kernel) and accepts each packet ``delay`` seconds after
it arrived.  Packets leave in arrival order: the kernel numbers them in that order, so
one batch verdict ("accept every id <= N") releases all packets that are due.

It prints ``ready`` (or ``error: ...``) on stdout once, and exits when stdin reaches EOF,
so its owner's death cannot leave it running.  While it is gone the queue is unbound and
the kernel drops queued packets (the rule has no --queue-bypass: fail closed).
Needs CAP_NET_ADMIN.  Standard library only: netfilter.py starts it by its path, as a
script, so a delayer does not import ddlcomm and torch (as ``-m`` would) before "ready".
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import select
import socket
import struct
import sys
import time
from typing import Iterator

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
SO_RCVBUFFORCE = 33  # not in the socket module before Python 3.12
NETLINK_NO_ENOBUFS = 5
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
NFQNL_SUBSYS = 3 << 8  # NFNL_SUBSYS_QUEUE
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4  # queue GSO packets whole instead of segmenting them first
NF_ACCEPT = 1
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, port id
NLA_HDR = struct.Struct("=HH")  # len, type
QUEUE_MAXLEN = 1 << 16  # packets held at once; beyond this the kernel drops (like a full netem)


def _attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    data = NLA_HDR.pack(NLA_HDR.size + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    """An nfnetlink_queue message of type ``kind`` about ``queue``."""
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attrs  # nfgenmsg
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), NFQNL_SUBSYS | kind, flags, seq, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Yield (type, payload after nlmsghdr) for each netlink message in ``data``."""
    offset = 0
    while offset + NLMSG_HDR.size <= len(data):
        length, kind, _, _, _ = NLMSG_HDR.unpack_from(data, offset)
        if length < NLMSG_HDR.size:
            break
        yield kind, data[offset + NLMSG_HDR.size: offset + length]
        offset += (length + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    """The packet id in an NFQNL_MSG_PACKET (payload: nfgenmsg, then attributes)."""
    offset = 4
    while offset + NLA_HDR.size <= len(payload):
        length, kind = NLA_HDR.unpack_from(payload, offset)
        if length < NLA_HDR.size:
            break
        if kind & 0x3FFF == NFQA_PACKET_HDR:
            return struct.unpack_from("!I", payload, offset + NLA_HDR.size)[0]
        offset += (length + 3) & ~3
    return None


def bind(queue: int) -> socket.socket:
    """Open the netlink socket and bind ``queue`` (metadata only, GSO packets whole)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    # A burst that overflows the socket must not abort us: a later batch verdict
    # releases the packets whose notifications were lost.
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    attrs = (_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0))
             + _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
             + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
             + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
             + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq=1))
    for kind, payload in _messages(sock.recv(65536)):
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", payload)[0]
            if code:
                raise OSError(code, f"binding NFQUEUE {queue}: {os.strerror(code)}")
            return sock
    raise OSError(errno.EPROTO, f"binding NFQUEUE {queue}: no acknowledgement")


def run(sock: socket.socket, queue: int, delay: float) -> None:
    """Accept every queued packet ``delay`` s after it arrived, in arrival order, until stdin closes."""
    due: collections.deque[tuple[float, int]] = collections.deque()  # (release time, packet id)
    stdin = sys.stdin.fileno()
    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([sock, stdin], [], [], timeout)
        if stdin in readable and not os.read(stdin, 4096):
            return
        if sock in readable:
            for _ in range(256):  # bounded, so a flood cannot hold back due releases
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                arrived = time.monotonic()
                for kind, payload in _messages(data):
                    if kind == NFQNL_SUBSYS | NFQNL_MSG_PACKET:
                        packet = _packet_id(payload)
                        if packet is not None:
                            due.append((arrived + delay, packet))
                    elif kind == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", payload)[0]
                        # ENOENT: the kernel already dropped those packets (their device went down).
                        if code not in (0, errno.ENOENT):
                            raise OSError(code, f"verdict rejected: {os.strerror(code)}")
        now, last = time.monotonic(), None
        while due and due[0][0] <= now:
            last = due.popleft()[1]
        if last is not None:
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, verdict))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queue", type=int, default=0, help="NFQUEUE number (default 0)")
    ap.add_argument("--delay", type=float, required=True, help="seconds each packet is held")
    args = ap.parse_args()
    try:
        sock = bind(args.queue)
    except OSError as e:
        print(f"error: {e}", flush=True)
        return 1
    print("ready", flush=True)
    try:
        run(sock, args.queue, args.delay)
    except OSError as e:
        print(f"nfq_delay: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
