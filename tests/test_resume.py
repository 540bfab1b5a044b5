"""Checkpoint and resume of the compressed DDP hooks: exact on every kind of memory and DDP
layout, refused with the reason where it cannot be, remapped where the layout changed."""

from __future__ import annotations

import pytest
import torch

from ddlcomm.compressed import server_chunks, server_residual_numel
from ddlcomm.ddp_memory import FeedbackMemory
from harness import assert_all_ok, launch
from workers import resume


def test_resume_is_exact() -> None:
    assert_all_ok(launch(resume.exact_resume, 4, timeout=300))


def test_pickled_state_resumes_exactly() -> None:
    assert_all_ok(launch(resume.pickled_state, 2, timeout=180))


def test_states_that_cannot_resume_are_refused() -> None:
    assert_all_ok(launch(resume.refused, 4, timeout=180))


def test_changed_bucket_layout_is_remapped() -> None:
    assert_all_ok(launch(resume.changed_layout, 4, timeout=180))


# Parameters of different sizes, and of equal sizes side by side before and after (where
# taking a neighbour's memory would go unnoticed by size).
@pytest.mark.parametrize("sizes", [{"a": 5000, "b": 7, "c": 3000, "d": 11},
                                   {"a": 3000, "b": 3000, "c": 3000, "d": 11}])
def test_remap_keeps_every_parameters_error(sizes: dict[str, int]) -> None:
    """Regrouping parameters into other buckets keeps each one's worker residual and momentum,
    and adds world_size x the server residual at the positions this rank reduced: the error
    the ranks hold together (their mean worker residual plus the server residuals) is kept."""
    rank, world = 1, 3
    old = [("a", "b"), ("c", "d")]
    memory = FeedbackMemory()
    g = torch.Generator().manual_seed(0)
    per_param, per_param_momentum = {}, {}
    for index, signature in enumerate(old):
        memory.note_bucket(index, signature, [sizes[k] for k in signature])
        worker, server, momentum = memory.buffers(signature, rank, world, momentum=True)
        worker.copy_(torch.randn(worker.numel(), generator=g))
        server.copy_(torch.randn(server.numel(), generator=g))
        momentum.copy_(torch.randn(momentum.numel(), generator=g))
        folded = worker.clone()
        at = 0
        for begin, end in server_chunks(worker.numel(), rank, world):
            folded[begin:end].add_(server[at : at + end - begin], alpha=world)
            at += end - begin
        assert at == server_residual_numel(worker.numel(), rank, world)
        at = 0
        for key in signature:
            per_param[key] = folded[at : at + sizes[key]]
            per_param_momentum[key] = momentum[at : at + sizes[key]]
            at += sizes[key]
    memory.end_iteration()

    new = [("d", "a"), ("b", "c")]
    for index, signature in enumerate(new):
        memory.note_bucket(index, signature, [sizes[k] for k in signature])
        worker, server, momentum = memory.buffers(signature, rank, world, momentum=True)
        torch.testing.assert_close(worker, torch.cat([per_param[k] for k in signature]), rtol=0, atol=0)
        torch.testing.assert_close(momentum, torch.cat([per_param_momentum[k] for k in signature]), rtol=0, atol=0)
        assert not server.any(), "the server residual was folded into the worker residual"
    memory.end_iteration()
    assert set(memory.worker_residuals) == set(new) == set(memory.layout), "old buckets' memory was not dropped"
