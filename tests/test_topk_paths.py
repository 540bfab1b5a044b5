"""Approximate top-k takes the path it claims: the sampled threshold on ordinary data, the exact
fallback on ties, and neither below its minimum size; the payload is exact top-k's every time.
The path is counted by a TopKStats given to the encode (ddlcomm._C.compress)."""

from __future__ import annotations

import pytest
import torch

from ddlcomm import _C, compressors

# topk.cc: the sampled path needs at least 8 * 2**15 elements.
SAMPLED_MIN_NUMEL = 8 * (1 << 15)


def encode_counted(compressor: compressors.Compressor, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The payload of encoding x (no residual), and the paths the encode took."""
    stats = _C.compress.TopKStats()
    nbytes = compressor.compressed_nbytes(x.numel())
    payload = torch.empty(nbytes, dtype=torch.uint8)
    _C.compress.encode(compressor.config, compressors._DTYPE_CODES[x.dtype], x.data_ptr(), 0, x.numel(), 7,
                       payload.data_ptr(), nbytes, top_k_stats=stats)
    return payload, {"sampled": stats.sampled, "exact_fallbacks": stats.exact_fallbacks}


INPUTS = {
    # Distinct magnitudes: the sample's threshold leaves between k and 4k + 2**15 candidates.
    "gaussian": (lambda: torch.randn(SAMPLED_MIN_NUMEL * 2, generator=torch.Generator().manual_seed(0)),
                 {"sampled": 1, "exact_fallbacks": 0}),
    # One magnitude everywhere: every element is a candidate, too many to hold: the fallback.
    "all_ties": (lambda: torch.full((SAMPLED_MIN_NUMEL * 2,), -0.5), {"sampled": 0, "exact_fallbacks": 1}),
    # A tie block larger than the candidate limit at the sampled threshold's key.
    "mostly_ties": (lambda: torch.cat([torch.full((SAMPLED_MIN_NUMEL * 2,), 0.25),
                                       torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 0.01]),
                    {"sampled": 0, "exact_fallbacks": 1}),
    # Too small to sample: the exact path, which is no fallback.
    "small": (lambda: torch.randn(SAMPLED_MIN_NUMEL - 1, generator=torch.Generator().manual_seed(2)),
              {"sampled": 0, "exact_fallbacks": 0}),
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_approximate_top_k_takes_the_path_it_claims(name: str) -> None:
    make, expected_paths = INPUTS[name]
    x = make()
    approximate, exact = compressors.TopK(ratio=0.01, approximate=True), compressors.TopK(ratio=0.01)
    payload, paths = encode_counted(approximate, x)
    assert paths == expected_paths, paths
    reference, exact_paths = encode_counted(exact, x)
    assert exact_paths == {"sampled": 0, "exact_fallbacks": 0}, exact_paths
    assert torch.equal(payload, reference), "approximate top-k sent other entries than exact top-k"


def test_top_k_stats_accumulate_and_default_to_none() -> None:
    x = torch.randn(SAMPLED_MIN_NUMEL, generator=torch.Generator().manual_seed(3))
    comp = compressors.TopK(ratio=0.01, approximate=True)
    stats = _C.compress.TopKStats()
    nbytes = comp.compressed_nbytes(x.numel())
    payload = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(3):
        _C.compress.encode(comp.config, compressors._DTYPE_CODES[x.dtype], x.data_ptr(), 0, x.numel(), 0,
                           payload.data_ptr(), nbytes, top_k_stats=stats)
    assert (stats.sampled, stats.exact_fallbacks) == (3, 0)
    assert torch.equal(comp.encode(x), payload)  # the wrapper passes no stats: same bytes
