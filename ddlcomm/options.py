"""What every compressed path's state holds alike (the DDP hooks' ``CompressionState``,
``ddlcomm.fsdp``'s states): the compressor and its options, the traffic statistics, and the
reasons already logged once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from .compressors import Compressor

__all__ = ["CompressionOptions", "CompressionStats", "LogOnce"]


@dataclass
class CompressionStats:
    """Bytes this rank put on the wire, against what a plain ring all-reduce would send.

    Both are the flat algorithms' bytes, from their plans; where a ddlcomm group takes two
    levels over hosts (docs/collectives.md) each host's link carries fewer, and shared
    memory the rest."""

    bytes_sent: int = 0  # everything, warm-up and small buckets included
    bytes_uncompressed: int = 0
    compressed_buckets: int = 0
    uncompressed_buckets: int = 0
    compressed_bytes_sent: int = 0  # the compressed buckets alone
    compressed_bytes_uncompressed: int = 0

    def count(self, sent: int, uncompressed: int, compressed: bool) -> None:
        """One bucket (or module) that put `sent` bytes on the wire where a plain ring would
        have put `uncompressed`: through the compressor, or plainly (warm-up, small, refused)."""
        self.bytes_sent += sent
        self.bytes_uncompressed += uncompressed
        if compressed:
            self.compressed_buckets += 1
            self.compressed_bytes_sent += sent
            self.compressed_bytes_uncompressed += uncompressed
        else:
            self.uncompressed_buckets += 1

    @property
    def ratio(self) -> float:
        """Uncompressed bytes per byte sent, over everything (higher is better)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes per byte sent, over the compressed buckets alone."""
        if not self.compressed_bytes_sent:
            return 1.0
        return self.compressed_bytes_uncompressed / self.compressed_bytes_sent


class LogOnce:
    """A state that logs each reason for leaving something uncompressed once."""

    _logger = logging.getLogger("ddlcomm")  # each path sets its own module's logger

    def __init__(self, logger: Optional[logging.Logger] = None) -> None:
        self._logged: set[str] = set()  # reasons already logged once
        if logger is not None:
            self._logger = logger

    def log_once(self, reason: str, message: str, *args: Any) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            self._logger.warning(message, *args)


class CompressionOptions(LogOnce):
    """What every compressed path's state (these hooks', ``ddlcomm.fsdp``'s) checks and keeps
    alike: the compressor, warm-up, minimum size, error feedback and momentum options, the
    statistics, and the reasons already logged once."""

    def __init__(self, compressor: Compressor, start_compress_iter: int, min_compression_bytes: int,
                 error_feedback: bool, momentum: float) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a ddlcomm.compressors compressor, got {type(compressor).__name__}")
        if start_compress_iter < 0:
            raise ValueError(f"start_compress_iter must be >= 0, got {start_compress_iter}")
        if min_compression_bytes < 0:
            raise ValueError(f"min_compression_bytes must be >= 0, got {min_compression_bytes}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__()
        self.compressor = compressor
        self.start_compress_iter = start_compress_iter
        self.min_compression_bytes = min_compression_bytes
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.stats = CompressionStats()
