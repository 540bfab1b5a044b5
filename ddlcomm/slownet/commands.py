"""The commands that build and control the emulated network (ip, tc, iptables), and the errors
every part of the emulation raises. The standard library only."""

from __future__ import annotations

import shlex
import subprocess


class SlowNetError(RuntimeError):
    """A command that sets up or controls the emulated network failed."""


class SlowNetUnavailable(SlowNetError):
    """This machine lacks something SlowNet needs (root, iproute2, netns, a qdisc)."""


def sh(*argv: str, timeout: float = 30.0) -> str:
    """Run ``argv`` and return its stdout; on failure raise SlowNetError naming
    the command and its stderr."""
    try:
        res = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or e.stdout or "").strip() or "no output"
        raise SlowNetError(f"`{shlex.join(argv)}` failed (exit {e.returncode}): {detail}") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlowNetError(f"`{shlex.join(argv)}` failed: {e}") from None
    return res.stdout
