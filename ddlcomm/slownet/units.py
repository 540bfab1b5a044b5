"""Rates, delays and losses as tc writes them ("1gbit", "0.1ms", "0.5%"), and the shaping of
one link direction made of them. The standard library only."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
       "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIME = {"s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
         "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "ns": 1e-9, "nsec": 1e-9, "nsecs": 1e-9}


def parse_rate(text: str) -> float:
    """Parse a tc-style rate ("1gbit", "200mbit", "1.5gbps" = bytes) into bit/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(|k|m|g|t|ki|mi|gi|ti)(bit|bps)?\s*", text.lower())
    if not m:
        raise ValueError(f"bad rate {text!r} (examples: 1gbit, 200mbit, 10gbit)")
    bits = float(m[1]) * _SI[m[2]] * (8 if m[3] == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return bits


def parse_time(text: str) -> float:
    """Parse a tc-style time ("0.1ms", "5ms", "100us", "0") into seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or (m[2] not in _TIME and not (m[2] == "" and float(m[1]) == 0)):
        raise ValueError(f"bad time {text!r} (examples: 0.1ms, 5ms, 100us, 0)")
    return float(m[1]) * _TIME.get(m[2], 0.0)


def parse_loss(text: str | None) -> float:
    """Parse a loss percentage ("0.5%", "1") into percent; None means 0."""
    if text is None:
        return 0.0
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%?\s*", text)
    if not m or float(m[1]) > 100:
        raise ValueError(f"bad loss {text!r} (examples: 0%, 0.1%, 1%)")
    return float(m[1])


@dataclass(frozen=True)
class Shaping:
    """Per-link, per-direction impairments."""

    rate_bps: float
    delay_s: float = 0.0
    loss_pct: float = 0.0

    @classmethod
    def parse(cls, rate: str, delay: str = "0", loss: str | None = None) -> "Shaping":
        return cls(parse_rate(rate), parse_time(delay), parse_loss(loss))

    @property
    def impairment(self) -> str:
        """The delay/loss part, e.g. "delay 5ms loss 1%" ("" for neither)."""
        parts = [f"delay {self.delay_s * 1e3:g}ms"] if self.delay_s else []
        return " ".join(parts + ([f"loss {self.loss_pct:g}%"] if self.loss_pct else []))

    def __str__(self) -> str:
        return f"rate {self.rate_bps / 1e6:g}mbit {self.impairment}".rstrip()
