"""The ddlcomm torch.distributed backend on CPU tensors, 2-4 ranks on loopback, checked
against direct computations and against gloo."""

from __future__ import annotations

import pytest

from harness import assert_all_ok, launch


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_every_dtype_and_op(world_size: int) -> None:
    assert_all_ok(launch("collectives", "allreduce", world_size, timeout=240))


@pytest.mark.parametrize("world_size", [2, 4])
def test_other_collectives(world_size: int) -> None:
    assert_all_ok(launch("collectives", "collectives", world_size, timeout=240))


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_forced_allreduce_algorithms(algorithm: str) -> None:
    env = {"DDLCOMM_ALLREDUCE_ALGO": algorithm, "DDLCOMM_SEGMENT_BYTES": "4096"}
    assert_all_ok(launch("collectives", "allreduce", 3, timeout=240, env=env))


def test_striped_connections() -> None:
    env = {"DDLCOMM_SOCKETS_PER_PEER": "3", "DDLCOMM_STRIPE_MIN_BYTES": "4096"}
    assert_all_ok(launch("collectives", "collectives", 2, timeout=240, env=env))


def test_async_work_and_futures() -> None:
    assert_all_ok(launch("collectives", "async_ops", 4))


def test_subgroups() -> None:
    assert_all_ok(launch("collectives", "subgroups", 4))


def test_world_size_one() -> None:
    assert_all_ok(launch("collectives", "single_rank", 1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_gloo(world_size: int) -> None:
    assert_all_ok(launch("collectives", "ddp", world_size, timeout=240))


def test_pytorch_comm_hooks_powersgd_and_fp16() -> None:
    assert_all_ok(launch("collectives", "torch_hooks", 2, timeout=120))
