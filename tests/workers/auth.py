"""Hostile clients against the connection handshake: rank 3 attacks the other ranks'
listening ports before joining, and the job must still connect and compute correctly.

The ranks build ProcessGroupDdlcomm directly on a plain TCPStore (no torch prefixes), so
the attacker finds each rank's address under the transport's own key."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ddlcomm
from common import run

CHALLENGE_BYTES = 40  # magic, version, 32-byte nonce
HELLO = struct.Struct("<IIiiii")  # magic, version, rank, size, index, connections per peer


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def closed_by_peer(s: socket.socket, wait_s: float) -> bool:
    """True if the other side closed or reset the connection within `wait_s`."""
    s.settimeout(wait_s)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def proof(address: tuple[str, int], key: bytes, flip: int = -1) -> bytes:
    """Speaks the protocol correctly with `key`, the MAC's byte `flip` (if any) inverted;
    returns what came back."""
    s = socket.create_connection(address, timeout=10)
    challenge = recv_exact(s, CHALLENGE_BYTES)
    _, version = struct.unpack_from("<II", challenge)  # magic, version
    hello = HELLO.pack(0x4F4C4548, version, 3, 4, 0, 1)
    nonce = os.urandom(32)
    mac = bytearray(hmac.new(key, b"ddlcomm connector" + challenge[8:] + nonce + hello, hashlib.sha256).digest())
    if flip >= 0:
        mac[flip] ^= 0xFF
    s.sendall(hello + nonce + bytes(mac))
    answer = recv_exact(s, 4)  # "REJC", or the start of an acceptor's Hello
    s.close()
    return answer


def hostile_clients() -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    handshake_s = int(os.environ["DDLCOMM_HANDSHAKE_TIMEOUT_MS"]) / 1000
    held: list[socket.socket] = []
    targets: list[tuple[str, int]] = []
    if rank == size - 1:
        for peer in range(size - 1):
            host, port = store.get(f"ddlcomm/addr/{peer}").decode().rsplit(":", 1)
            targets.append((host, int(port)))
        for address in targets:
            garbage = socket.create_connection(address)
            garbage.sendall(os.urandom(200))
            assert closed_by_peer(garbage, 10), "garbage was not dropped"
            assert proof(address, os.urandom(32)) == b"REJC", "a wrong key was not rejected"
            # The group's key (the store's secret, without DDLCOMM_AUTH_KEY), one MAC byte wrong:
            # every byte of the MAC is checked.
            key = store.get("ddlcomm/auth_secret")
            for byte in range(32):
                assert proof(address, key, flip=byte) == b"REJC", f"a MAC wrong in byte {byte} was accepted"
            # A flood larger than the acceptor's backlog of half-open connections, then
            # slow clients that send a little or nothing and never finish.
            held += [socket.create_connection(address) for _ in range(150)]
            slow = socket.create_connection(address)
            slow.sendall(os.urandom(10))
            held += [slow, socket.create_connection(address)]
        time.sleep(handshake_s + 0.5)  # the slow ones must be dropped by the handshake deadline

    pg = ddlcomm.ProcessGroupDdlcomm(store, rank, size, timedelta(seconds=60))
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    pg.allreduce([t]).wait()
    expected = torch.arange(1000, dtype=torch.float32) * sum(range(1, size + 1))
    assert torch.equal(t, expected), f"wrong all-reduce result {t[:4].tolist()}"

    if rank == size - 1:
        lingering = [s for s in held if not closed_by_peer(s, 2)]
        assert not lingering, f"{len(lingering)} of {len(held)} attacker connections are still open"
        for address in targets:  # once connected, ranks no longer listen at all
            try:
                socket.create_connection(address, timeout=5).close()
            except ConnectionRefusedError:
                continue
            raise AssertionError(f"{address} still accepts connections after the group connected")
    pg.allreduce([t]).wait()  # everyone is done with the checks above before any rank leaves


def disagreeing_keys() -> None:
    """Rank 1 has a different DDLCOMM_AUTH_KEY: it fails at once, rank 0 at its timeout.
    Both exit with code 4 after printing the error."""
    start = time.monotonic()
    try:
        dist.init_process_group("ddlcomm", timeout=timedelta(seconds=5))
    except dist.DistBackendError as e:
        print(f"DistBackendError after {time.monotonic() - start:.2f} s: {e}", flush=True)
        sys.exit(4)
    raise AssertionError("init_process_group succeeded with different keys")


def disagreeing_sizes() -> None:
    """Rank 1 believes the group has 3 ranks: the error says the world sizes differ. Both exit
    with code 4 after printing the error (rank 1 at its timeout, waiting for a rank 2)."""
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=30))
    try:
        ddlcomm.ProcessGroupDdlcomm(store, rank, 2 + rank, timedelta(seconds=5))
    except dist.DistBackendError as e:
        print(f"DistBackendError: {e}", flush=True)
        sys.exit(4)
    raise AssertionError("a group of ranks that disagree on its size connected")


if __name__ == "__main__":
    run()
