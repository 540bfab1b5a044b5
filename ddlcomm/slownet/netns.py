"""Named network namespaces: the names this process gives them (``ddl-<pid>-...``), listing
them, killing what runs in one, and deleting those whose creating process is gone. The
standard library only."""

from __future__ import annotations

import itertools
import os
import re
import signal

from .commands import SlowNetError, sh

PREFIX = "ddl"
_instance_ids = itertools.count()


def unique_name(kind: str = "") -> str:
    """``ddl-<pid>-<kind><n>``: n counts every name this process made (networks and probes
    alike), so concurrent runs and successive networks never collide."""
    return f"{PREFIX}-{os.getpid()}-{kind}{next(_instance_ids)}"


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still living in namespace ``ns``."""
    try:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns).split()]
    except SlowNetError:
        return
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete ``ddl-<pid>-*`` namespaces whose creating process is gone."""
    removed = []
    for ns in list_namespaces():
        m = re.match(rf"{PREFIX}-(\d+)-", ns)
        if m and not _pid_alive(int(m[1])):
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns)
            removed.append(ns)
    return removed
