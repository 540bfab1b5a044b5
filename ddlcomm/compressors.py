"""Gradient compressors with error feedback, on CPU and CUDA tensors.

Every compressor turns a float32 / float16 / bfloat16 tensor into a self-describing
``torch.uint8`` payload (layout: ``csrc/compress/wire_format.h``) and back. With a float32
``residual`` the encode is error-feedback compression, fused in one pass::

    y = tensor + residual
    payload = encode(y)
    residual = y - decode(payload)      # updated in place

so nothing is lost, only delayed. Example::

    import torch
    from ddlcomm.compressors import OneBit

    compressor = OneBit(block_size=256)
    residual = torch.zeros(grad.numel())
    payload = compressor.encode(grad, residual, stream=step)
    grad_hat = compressor.decode(payload)            # float32, grad.numel() elements
    compressor.decode_accumulate(payload, total)     # total += decoded

Tensors are used in place: inputs and residuals must be contiguous tensors on one device
(any shape; they are read as flat vectors). Wrong types and dtypes raise TypeError; wrong
devices, layouts, sizes, out-of-range numbers and corrupt payloads raise ValueError.

CUDA tensors (a build against a CUDA torch; ``has_cuda()``) are compressed by the CUDA
kernels into the same bytes as on the CPU: a payload encoded on a GPU decodes on a CPU and
back. Their calls are asynchronous on the current CUDA stream, like torch's own operations,
except ``decode`` and ``decode_accumulate`` of a payload in device memory: they first read
its 32-byte header on the host (a wait for the stream) to check it against the compressor,
and check the size against the element count. The rest of such a payload is not validated
on the GPU (the kernels never read or write outside the buffers whatever the bytes are);
``inspect`` a copy on the CPU to validate everything.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from . import _C

# What `from ddlcomm.compressors import *` binds. inspect() is public but left out: a star import
# would shadow the standard library's inspect module (import it by name).
__all__ = ["Compressor", "OneBit", "Ternary", "TopK", "RandomK", "FP16", "BF16", "all_finite", "device_finite",
           "has_cuda"]

_native = _C.compress
# The table of formats (csrc/compress/formats.h): each subclass names its row.
_FORMATS = {row["name"]: row for row in _native.formats}

# csrc/common/dtype.h DataType values.
_DTYPE_CODES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}
_HEADER_BYTES = 32
_FORMAT_OFFSET = 5  # byte of the header that holds the format (wire_format.h)
_NUMEL_OFFSET = 16  # uint64 element count


def has_cuda() -> bool:
    """Whether this build has the CUDA kernels (it was built against a CUDA torch)."""
    return bool(_native.has_cuda)


def _integer(value: Any, name: str, low: int, bits: int) -> int:
    """``value`` as an int in [low, 2**bits): Python and numpy integers, not bools, floats or strings."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not low <= value < 2**bits:
        raise ValueError(f"{name} must be an integer in [{low}, 2**{bits}), got {value}")
    return value


def _check_tensor(tensor: Any, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        if not _native.has_cuda:
            raise ValueError(f"{name} is on {tensor.device}, but this build of ddlcomm has no CUDA kernels (it was "
                             f"built against a CPU-only torch): move it to the CPU or rebuild against a CUDA torch")
    elif tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU or CUDA tensor, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_device(tensor: torch.Tensor, other: torch.Tensor, name: str, of: str = "the tensor") -> None:
    if other.device != tensor.device:
        raise ValueError(f"{name} is on {other.device}, {of} on {tensor.device}: they must be on one device")


def _cuda_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _check_float(tensor: Any, name: str) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.dtype not in _DTYPE_CODES:
        raise TypeError(f"{name} must be torch.float32, torch.float16 or torch.bfloat16, got {tensor.dtype}")
    _check_tensor(tensor, name)


def _check_float32(tensor: Any, name: str) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.dtype != torch.float32:
        raise TypeError(f"{name} must be a torch.float32 tensor, got {tensor.dtype}")
    _check_tensor(tensor, name)


def _check_payload(payload: Any, name: str = "payload") -> None:
    if isinstance(payload, torch.Tensor) and payload.dtype != torch.uint8:
        raise TypeError(f"{name} must be a torch.uint8 tensor, got {payload.dtype}")
    _check_tensor(payload, name)


def inspect(payload: torch.Tensor) -> dict:
    """Validates a payload completely and describes it.

    Returns a dict with ``format`` ("one_bit", "ternary", "top_k", "random_k", "float16",
    "bfloat16"), ``version``, ``two_scales``, ``stochastic``, ``block_size``, ``numel``, ``k``,
    ``value_bits`` (top-k's value codes; 32 for float32 values) and ``nbytes``.
    Raises ValueError for a truncated, corrupt or unknown payload.
    """
    _check_payload(payload)
    if payload.is_cuda:
        raise ValueError("inspect() reads the payload on the host: pass payload.cpu()")
    return _native.inspect(payload.data_ptr(), payload.numel())


class Compressor:
    """Base class: encode with error feedback, decode, decode-accumulate.

    A compressor class names its row of the C++ table of formats
    (``class OneBit(Compressor, format="one_bit")``), which gives it ``format``, ``is_sparse``
    and ``samples_randomly``; its constructor turns its options into the native config.
    """

    _format: Any = None  # _C.compress.Format of the subclass
    _format_name = ""
    #: The payload carries a subset of the entries (top-k, random-k): what is not sent stays
    #: in the residual, and DGC's momentum correction applies.
    is_sparse: bool = False
    #: The subset is a random sample (random-k): a non-finite entry can be left out of the
    #: payload, so the compressed collectives check finiteness on the side.
    samples_randomly: bool = False

    def __init_subclass__(cls, format: Optional[str] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if format is not None:
            row = _FORMATS[format]
            cls._format, cls._format_name = row["format"], format
            cls.is_sparse = row["family"] == "sparse"
            cls.samples_randomly = row["samples_randomly"]

    def __init__(self, **options: Any) -> None:
        if self._format is None:
            raise TypeError("Compressor is a base class: use OneBit, Ternary, TopK, RandomK, FP16 or BF16")
        config = _native.Config()
        config.format = self._format
        for name, value in options.items():
            setattr(config, name, value)
        self._config = config
        self._options = options  # validated already: what pickling rebuilds the config from
        _native.encoded_bytes(config, 0)  # validates the options (ValueError)

    def __reduce__(self) -> tuple:
        # The native config does not pickle; a compressor (and a hook state holding one) does.
        return (_rebuild, (type(self), self._options))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._options == other._options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self._options.items()))))

    @property
    def config(self) -> Any:
        """The native configuration (``_C.compress.Config``) that the kernels and the compressed
        collectives take; read-only by convention: a compressor is immutable."""
        return self._config

    @property
    def format(self) -> str:
        """The payload format name, as ``inspect(payload)["format"]`` reports it."""
        return self._format_name

    def compressed_nbytes(self, numel: int) -> int:
        """Size in bytes of the payload of a tensor with ``numel`` elements."""
        return _native.encoded_bytes(self._config, _integer(numel, "numel", 0, 63))

    def encode(self, tensor: torch.Tensor, residual: Optional[torch.Tensor] = None, stream: int = 0,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Compresses ``tensor`` (+ ``residual``) into a uint8 payload.

        ``residual``: float32 tensor with as many elements as ``tensor``, updated in place to
        ``tensor + residual - decode(payload)``; None disables error feedback.
        ``stream``: any integer in [0, 2**64) that differs between calls that must draw
        different random numbers (e.g. ``rank << 32 | step``); same input and stream give
        the same bytes on any thread count.
        ``out``: a contiguous uint8 CPU tensor of at least ``compressed_nbytes(numel)`` bytes
        to write into (saves an allocation per call); the payload is its leading view.
        """
        _check_float(tensor, "tensor")
        residual_ptr = 0
        if residual is not None:
            _check_float32(residual, "residual")
            _check_device(tensor, residual, "residual")
            if residual.numel() != tensor.numel():
                raise ValueError(f"residual has {residual.numel()} elements, the tensor has {tensor.numel()}")
            residual_ptr = residual.data_ptr()
        stream = _integer(stream, "stream", 0, 64)
        numel = tensor.numel()
        nbytes = self.compressed_nbytes(numel)
        if out is None:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
        else:
            _check_payload(out, "out")
            _check_device(tensor, out, "out")
            if out.numel() < nbytes:
                raise ValueError(f"out holds {out.numel()} bytes, the payload needs {nbytes}")
            payload = out.view(-1)[:nbytes]
        if not tensor.is_cuda:
            _native.encode(self._config, _DTYPE_CODES[tensor.dtype], tensor.data_ptr(), residual_ptr, numel, stream,
                           payload.data_ptr(), nbytes)  # writes exactly compressed_nbytes(numel) bytes
            return payload
        if payload.data_ptr() % 4:
            raise ValueError("out must start at a 4-byte aligned address on a GPU")
        code = _DTYPE_CODES[tensor.dtype]
        with torch.cuda.device(tensor.device):
            scratch = _native.encode_workspace_bytes_cuda(self._config, code, numel)
            # From torch's caching allocator on the current stream: reused, never synchronized.
            workspace = torch.empty(scratch, dtype=torch.uint8, device=tensor.device) if scratch else None
            _native.encode_cuda(self._config, code, tensor.data_ptr(), residual_ptr, numel, stream,
                                payload.data_ptr(), nbytes, 0 if workspace is None else workspace.data_ptr(), scratch,
                                _cuda_stream(tensor.device))
        return payload

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None, numel: Optional[int] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Decodes ``payload`` into ``out`` (allocated as a flat ``dtype`` tensor if None).

        ``dtype``: torch.float32 (the default), torch.float16 or torch.bfloat16; with ``out``
        it may only repeat ``out.dtype``. ``numel``, when given, must match the payload (and
        ``out``). Returns ``out``.
        """
        self._check_format(payload)
        if numel is not None:
            numel = _integer(numel, "numel", 0, 63)
        if dtype is not None and dtype not in _DTYPE_CODES:
            raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        carried = self._device_header(payload) if payload.is_cuda else None
        if out is None:
            if numel is None:
                numel = inspect(payload)["numel"] if carried is None else carried
            out = torch.empty(numel, dtype=torch.float32 if dtype is None else dtype, device=payload.device)
        else:
            _check_float(out, "out")
            _check_device(payload, out, "out", "the payload")
            if dtype is not None and dtype != out.dtype:
                raise TypeError(f"dtype={dtype} but out is {out.dtype}: pass one of them")
            if numel is not None and numel != out.numel():
                raise ValueError(f"numel={numel} but out has {out.numel()} elements")
        if carried is None:
            _native.decode(payload.data_ptr(), payload.numel(), _DTYPE_CODES[out.dtype], out.data_ptr(), out.numel())
            return out
        if carried != out.numel():
            raise ValueError(f"the payload carries {carried} elements, out has {out.numel()}")
        return self._decode_device(payload, out, accumulate=False)

    def decode_accumulate(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += decode(payload)`` in float32 (``out`` must be float32). Returns ``out``."""
        self._check_format(payload)
        _check_float32(out, "out")
        _check_device(payload, out, "out", "the payload")
        if not payload.is_cuda:
            _native.decode_accumulate(payload.data_ptr(), payload.numel(), out.data_ptr(), out.numel())
            return out
        carried = self._device_header(payload)
        if carried != out.numel():
            raise ValueError(f"the payload carries {carried} elements, out has {out.numel()}")
        return self._decode_device(payload, out, accumulate=True)

    def _device_header(self, payload: torch.Tensor) -> int:
        """Checks the header of a payload in device memory against this compressor, on the host
        (waits for the current stream); returns its element count."""
        header = payload[:_HEADER_BYTES].cpu()
        _native.check_payload_config(header.data_ptr(), header.numel(), self._config)
        return int(header[_NUMEL_OFFSET:_NUMEL_OFFSET + 8].view(torch.int64))

    def _decode_device(self, payload: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """The CUDA decode of a payload already checked (or produced here) for ``out.numel()``
        elements: enqueued on the current stream, no host synchronization."""
        with torch.cuda.device(out.device):
            _native.decode_cuda(self._config, out.numel(), payload.data_ptr(), payload.numel(),
                                _DTYPE_CODES[out.dtype], out.data_ptr(), accumulate, _cuda_stream(out.device))
        return out

    def _check_format(self, payload: Any) -> None:
        # Float16 and BFloat16 payloads have the same layout: only the format byte tells them apart.
        _check_payload(payload)
        if payload.is_cuda:
            return  # _device_header checks it, with the rest of the header, in one copy
        if payload.numel() > _FORMAT_OFFSET and int(payload[_FORMAT_OFFSET]) != int(self._format):
            raise ValueError(f"{type(self).__name__} cannot decode a payload of format byte "
                             f"{int(payload[_FORMAT_OFFSET])} (expected {int(self._format)}, {self.format})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"

    def _describe(self) -> str:
        return ""


def device_finite(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """For a GPU tensor, whether every element is finite as a 0-dim bool tensor on its device,
    for code that masks with it rather than reading it (``all_finite`` would wait for the GPU);
    None on the CPU, where ``all_finite`` costs one pass and no wait."""
    return torch.isfinite(tensor).all() if tensor.is_cuda else None


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite; one pass over it.

    A float32 sum is non-finite whenever an element is (inf and NaN propagate through it), and
    a finite sum means every element was finite unless it overflowed; only then is each
    element checked. ``torch.isfinite(tensor).all()`` would make three temporaries of the
    tensor's size, which on a CPU cost more than the sum.
    """
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def _rebuild(cls: type, options: dict[str, Any]) -> Compressor:
    compressor = cls.__new__(cls)
    Compressor.__init__(compressor, **options)
    return compressor


def _block_size(block_size: int) -> int:
    return _integer(block_size, "block_size", 1, 32)


class OneBit(Compressor, format="one_bit"):
    """Sign bits plus one float32 scale per block of ``block_size`` elements (about 32x smaller).

    The scale is the block's mean |y|; with ``two_scales`` (1-bit SGD) a block decodes to the
    mean of its y >= 0 entries or minus the mean |y| of its y < 0 entries.
    """


    def __init__(self, block_size: int = 256, two_scales: bool = False) -> None:
        super().__init__(block_size=_block_size(block_size), two_scales=bool(two_scales))

    def _describe(self) -> str:
        return f"block_size={self._config.block_size}, two_scales={self._config.two_scales}"


class Ternary(Compressor, format="ternary"):
    """Values in {-s, 0, +s} with one float32 scale s per block, 2 bits per element.

    Default (deterministic, the rule of ternary weight networks): elements with |y| above
    0.7 * the block's mean |y| are sent, and s is their mean |y|. Its error is always smaller
    than y, which is what error feedback needs to stay bounded.

    ``stochastic=True`` (TernGrad): s = max |y| per block and stochastic rounding
    (P(|q| = s) = |y| / s, counter-based randomness keyed by ``seed``, the ``stream`` of each
    encode and the element index), so the decoded value is an unbiased estimate of y. ``clip``
    > 0 caps s at ``clip`` * std of the block. Its error can exceed y, so with error feedback
    the residual can grow without bound: use it without error feedback.
    """


    def __init__(self, block_size: int = 256, stochastic: bool = False, clip: float = 0.0, seed: int = 0) -> None:
        if not clip >= 0.0:
            raise ValueError(f"clip must be >= 0, got {clip}")
        if not stochastic and (clip or seed):
            raise ValueError("clip and seed apply to stochastic ternary only (Ternary(stochastic=True, ...))")
        super().__init__(block_size=_block_size(block_size), stochastic=bool(stochastic), clip=float(clip),
                         seed=_integer(seed, "seed", 0, 64))

    def _describe(self) -> str:
        if not self._config.stochastic:
            return f"block_size={self._config.block_size}"
        return f"block_size={self._config.block_size}, stochastic=True, clip={self._config.clip}, seed={self._config.seed}"


class _Sparse(Compressor):
    _DEFAULT_RATIO = 0.01

    def __init__(self, ratio: Optional[float], k: Optional[int], **options: Any) -> None:
        # One of the two decides how many entries are kept; silently preferring k would hide a mistake.
        if ratio is not None and k is not None:
            raise ValueError(f"{type(self).__name__} takes ratio or k, not both (got ratio={ratio!r}, k={k!r})")
        if k is not None:
            k = _integer(k, "k", 1, 64)
        if ratio is None:
            ratio = self._DEFAULT_RATIO  # also stored (unused) with k, as it always was
        elif isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio must be a number in (0, 1], got {type(ratio).__name__} {ratio!r}")
        elif not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        super().__init__(ratio=float(ratio), k=k or 0, **options)

    def kept_entries(self, numel: int) -> int:
        """Entries kept for ``numel`` elements: min(k, numel), else round(ratio * numel) >= 1."""
        return _native.kept_entries(self._config, _integer(numel, "numel", 0, 63))

    def _describe(self) -> str:
        return f"k={self._config.k}" if self._config.k else f"ratio={self._config.ratio}"


class TopK(_Sparse, format="top_k"):
    """The k largest-magnitude entries (indices ascending + their values), ties to the lower index.

    Keeps a fraction ``ratio`` (default 0.01) of the entries, or exactly ``k``: give one, not both.

    ``approximate`` finds them Deep-Gradient-Compression style: a threshold estimated on a
    random sample, an exact selection among the candidates above it, and a fallback to the
    exact method when the sample was wrong. The payload is identical to exact top-k; only the
    speed differs (much faster for small ratios).

    ``value_bits`` (SparseLoCo's quantized values): 32 sends float32 values; 1, 2, 4 or 8 sends
    a code per entry instead: its sign and one of 2**(value_bits - 1) magnitude bins of equal
    count, decoded to the mean of the entries that share the code (a table of 2**value_bits
    float32 in the payload). A kept entry then costs 32 + value_bits bits instead of 64, and
    what the code loses stays in the residual. CPU tensors only for now.
    """


    def __init__(self, ratio: Optional[float] = None, k: Optional[int] = None, approximate: bool = False,
                 value_bits: int = 32) -> None:
        if _integer(value_bits, "value_bits", 1, 6) not in (1, 2, 4, 8, 32):
            raise ValueError(f"value_bits must be 1, 2, 4, 8 or 32 (float32 values), got {value_bits}")
        options = {} if value_bits == 32 else {"value_bits": int(value_bits)}
        super().__init__(ratio, k, approximate=bool(approximate), **options)

    def _describe(self) -> str:
        bits = "" if self._config.value_bits == 32 else f", value_bits={self._config.value_bits}"
        return f"{super()._describe()}, approximate={self._config.approximate}{bits}"


class RandomK(_Sparse, format="random_k"):
    """k entries at distinct random indices (Floyd's algorithm, counter-based from ``seed`` and ``stream``).

    Keeps a fraction ``ratio`` (default 0.01) of the entries, or exactly ``k``: give one, not both.

    Values are y at those indices; ``scaled`` multiplies them by numel / k, which makes the
    decoded vector an unbiased estimate of y (the residual then holds y - decoded).
    """


    def __init__(self, ratio: Optional[float] = None, k: Optional[int] = None, seed: int = 0,
                 scaled: bool = False) -> None:
        super().__init__(ratio, k, seed=_integer(seed, "seed", 0, 64), scaled=bool(scaled))

    def _describe(self) -> str:
        return f"{super()._describe()}, seed={self._config.seed}, scaled={self._config.scaled}"


class FP16(Compressor, format="float16"):
    """IEEE half precision (round to nearest even; beyond +-65504 becomes +-inf)."""


    def __init__(self) -> None:  # no options: a cast has none (block_size=... raises TypeError)
        super().__init__()


class BF16(Compressor, format="bfloat16"):
    """bfloat16 (round to nearest even)."""


    def __init__(self) -> None:  # no options, as FP16
        super().__init__()
