"""A group's own transport: ddlcomm.Options (ProcessGroupDdlcomm.Options) as the pg_options of
init_process_group/new_group, over DDLCOMM_TRANSPORT. The multi-rank scenarios are in
tests/workers/backend_options.py."""

from __future__ import annotations

import copy
import pickle
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import ddlcomm
from harness import assert_all_ok, launch
from workers import backend_options

NAMES = "auto, tcp, shm or ucx"  # every name the transport table knows, built or not


def test_groups_get_the_transport_they_ask_for_over_the_environment() -> None:
    # Under DDLCOMM_TRANSPORT=shm the tcp group's option beats the environment, and a group
    # with Options() gets shm from it.
    assert_all_ok(launch(backend_options.two_transports, 3, timeout=180, env={"DDLCOMM_TRANSPORT": "shm"}))


def test_a_groups_options_come_back_from_its_backend() -> None:
    assert_all_ok(launch(backend_options.options_round_trip, 2,
                         env={"DDLCOMM_TCP_SPIN_US": "9", "DDLCOMM_SHM_SPIN_US": "7"}))


def test_bad_options_fail_at_group_creation_and_the_ranks_go_on() -> None:
    assert_all_ok(launch(backend_options.bad_options, 2))


def test_options_class() -> None:
    assert ddlcomm.Options is ddlcomm.ProcessGroupDdlcomm.Options
    options = ddlcomm.Options()
    assert isinstance(options, torch._C._distributed_c10d.Backend.Options)  # c10d's, as NCCL's and gloo's
    assert (options.transport, options.spin_us, options.allreduce_algorithm, options.backend) == (None, {}, None,
                                                                                                    "ddlcomm")
    assert options._timeout == timedelta(minutes=30)  # c10d's default
    options = ddlcomm.Options("shm", {"tcp": 20}, "hierarchical")
    assert (options.transport, options.spin_us, options.allreduce_algorithm) == ("shm", {"tcp": 20}, "hierarchical")
    assert repr(options) == "ddlcomm.Options(transport='shm', spin_us={'tcp': 20}, allreduce_algorithm='hierarchical')"
    for name in ["auto", *ddlcomm.transports(), None]:
        options.transport = name
        assert options.transport == name
    for name in ["auto", "ring", "recursive_doubling", "halving_doubling", "hierarchical", None]:
        options.allreduce_algorithm = name
        assert options.allreduce_algorithm == name


def test_unknown_allreduce_algorithm_is_a_value_error_naming_the_valid_ones() -> None:
    expected = "expected auto, ring, recursive_doubling, halving_doubling or hierarchical"
    with pytest.raises(ValueError, match=f"ddlcomm.Options.allreduce_algorithm='tree' is invalid: {expected}"):
        ddlcomm.Options(allreduce_algorithm="tree")
    options = ddlcomm.Options(allreduce_algorithm="ring")
    with pytest.raises(ValueError, match=expected):
        options.allreduce_algorithm = "Ring"
    assert options.allreduce_algorithm == "ring"


def test_unknown_transport_is_a_value_error_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=f"ddlcomm.Options.transport='rdma' is invalid: expected {NAMES}"):
        ddlcomm.Options(transport="rdma")
    options = ddlcomm.Options(transport="tcp")
    with pytest.raises(ValueError, match=f"expected {NAMES}"):
        options.transport = "TCP"
    assert options.transport == "tcp"


def test_a_transport_left_out_of_the_build_is_refused() -> None:
    if "ucx" in ddlcomm.transports():
        pytest.skip("this build has UCX")
    with pytest.raises(ValueError, match="ucx', but this build of ddlcomm has no UCX transport"):
        ddlcomm.Options(transport="ucx")


@pytest.mark.parametrize("spin, message", [({"rdma": 5}, "spin_us\\['rdma'\\] is invalid: expected a key among"),
                                           ({"tcp": -1}, "spin_us\\['tcp'\\]=-1 is invalid"),
                                           ({"shm": 1_000_001}, "spin_us\\['shm'\\]=1000001 is invalid")])
def test_bad_spins_are_value_errors(spin: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ddlcomm.Options(spin_us=spin)
    options = ddlcomm.Options(spin_us={"tcp": 0})
    with pytest.raises(ValueError, match=message):
        options.spin_us = spin
    assert options.spin_us == {"tcp": 0}


def test_options_copy_and_pickle() -> None:
    options = ddlcomm.Options(transport="shm", spin_us={"shm": 3}, allreduce_algorithm="ring")
    options._timeout = timedelta(seconds=45)
    for clone in (copy.copy(options), copy.deepcopy(options), pickle.loads(pickle.dumps(options))):
        assert type(clone) is ddlcomm.Options and clone is not options
        assert (clone.transport, clone.spin_us, clone.allreduce_algorithm, clone._timeout) == (
            "shm", {"shm": 3}, "ring", timedelta(seconds=45))
    clone = copy.deepcopy(options)
    clone.transport = "tcp"
    assert options.transport == "shm"


@pytest.mark.parametrize("other", [dist.ProcessGroupGloo._Options(), "shm", {"transport": "shm"}],
                         ids=["gloo", "str", "dict"])
def test_other_options_are_a_type_error(other: object) -> None:
    # Raised before the creator reads anything else of torch's arguments.
    with pytest.raises(TypeError, match="a ddlcomm group takes pg_options=ddlcomm.Options\\(...\\) or None, not "):
        ddlcomm._create_backend(SimpleNamespace(), other)
