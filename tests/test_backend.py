"""The ddlcomm torch.distributed backend on CPU tensors, 2-4 ranks on loopback, checked
against direct computations and against gloo."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import assert_all_ok, launch, transport_env, transports
from workers import collectives

ROOT = Path(__file__).resolve().parent.parent
# A one-rank group on a FileStore: enough for whatever a rank does on its own.
ONE_RANK = """
import os, tempfile, torch, torch.distributed as dist, ddlcomm
def init(backend="ddlcomm"):
    store = dist.FileStore(tempfile.mktemp(dir=os.getcwd()), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
"""


def run_python(code: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `python -c code args` (or `python args` without code) in tmp_path, off the source tree."""
    command = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(command, cwd=tmp_path, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


# Every transport at 4 ranks (oversubscribed on these 2 cores), and smaller groups.
# Uneven slices (3 ranks) over shared memory: test_shared_memory_rings_and_windows_smaller_than_the_messages.
@pytest.mark.parametrize("transport, world_size", [(t, 4) for t in transports()] + [("shm", 2)])
def test_allreduce_every_dtype_and_op(transport: str, world_size: int) -> None:
    assert_all_ok(launch(collectives.allreduce, world_size, timeout=240, env=transport_env(transport)))


@pytest.mark.parametrize("transport, world_size", [(t, 4) for t in transports()] + [("shm", 2)])
def test_other_collectives(transport: str, world_size: int) -> None:
    assert_all_ok(launch(collectives.collectives, world_size, timeout=240, env=transport_env(transport)))


def test_shared_memory_rings_and_windows_smaller_than_the_messages() -> None:
    """Rings of 4 KiB (headers split across the wrap, messages many times the ring) and windows
    of 64 KiB (a large all-reduce in many fills, alternating halves)."""
    env = {"DDLCOMM_TRANSPORT": "shm", "DDLCOMM_SHM_RING_BYTES": "4096", "DDLCOMM_SHM_WINDOW_BYTES": "65536",
           "DDLCOMM_SHM_ONESHOT_BYTES": "1024"}
    assert_all_ok(launch(collectives.allreduce, 3, timeout=240, env=env))
    assert_all_ok(launch(collectives.collectives, 2, timeout=240, env=env))


# Halving-doubling on 3 ranks folds the third into the first; on 4 it folds none.
@pytest.mark.parametrize("algorithm, world_size", [("ring", 3), ("recursive_doubling", 3), ("hierarchical", 3),
                                                   ("halving_doubling", 3), ("halving_doubling", 4)])
def test_forced_allreduce_algorithms(algorithm: str, world_size: int) -> None:
    # The forced algorithms exchange messages: through the shared-memory rings here (auto).
    env = {"DDLCOMM_ALLREDUCE_ALGO": algorithm, "DDLCOMM_SEGMENT_BYTES": "4096"}
    assert_all_ok(launch(collectives.allreduce, world_size, timeout=240, env=env))


def test_striped_connections() -> None:
    env = {"DDLCOMM_TRANSPORT": "tcp", "DDLCOMM_SOCKETS_PER_PEER": "3", "DDLCOMM_STRIPE_MIN_BYTES": "4096"}
    assert_all_ok(launch(collectives.collectives, 2, timeout=240, env=env))


def test_async_work_and_futures() -> None:
    assert_all_ok(launch(collectives.async_ops, 4))


@pytest.mark.parametrize("transport, world_size", [("tcp", 2), ("shm", 3)])
def test_direct_allreduce_is_dist_all_reduce(transport: str, world_size: int) -> None:
    assert_all_ok(launch(collectives.direct, world_size, timeout=240, env=transport_env(transport)))


def test_subgroups() -> None:
    assert_all_ok(launch(collectives.subgroups, 4))


def test_world_size_one() -> None:
    assert_all_ok(launch(collectives.single_rank, 1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_gloo(world_size: int) -> None:
    assert_all_ok(launch(collectives.ddp, world_size, timeout=240))


@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorch_comm_hooks_match_gloo(world_size: int) -> None:
    """allreduce, fp16 compress and PowerSGD hooks: bitwise as on gloo on 2 ranks, close on 4."""
    assert_all_ok(launch(collectives.torch_hooks_vs_gloo, world_size, timeout=120))


def test_compressed_allreduce_bytes_on_the_wire_match_wire_bytes() -> None:
    """Bytes measured on the group's sockets (TCP_INFO), not the formula re-checked."""
    assert_all_ok(launch(collectives.wire_bytes_measured, 3, timeout=120, env=transport_env("tcp")))


BAD_ENVIRONMENT = {
    "DDLCOMM_SEGMENT_BYTES": "-5",  # crashed in vector::_M_default_append
    "DDLCOMM_SMALL_MESSAGE_BYTES": "-1",  # was taken as 2**64 - 1
    "DDLCOMM_HALVING_DOUBLING_BYTES": "1 MiB",
    "DDLCOMM_SOCKETS_PER_PEER": "0",
    "DDLCOMM_STRIPE_MIN_BYTES": "1MB",
    "DDLCOMM_SOCKET_BUFFER_BYTES": "99999999999999999999",
    "DDLCOMM_HANDSHAKE_TIMEOUT_MS": " 100",
    "DDLCOMM_NUM_THREADS": "two",
    "DDLCOMM_ALLREDUCE_ALGO": "tree",
    "DDLCOMM_TRANSPORT": "rdma",
    "DDLCOMM_SHM_RING_BYTES": "5000",  # not a power of two
    "DDLCOMM_SHM_WINDOW_BYTES": "-1",
    "DDLCOMM_SHM_SPIN_US": "1e3",
    "DDLCOMM_INLINE_BYTES": "64k",
    "DDLCOMM_HOST_ID": "rack 1",  # a space
}


def test_bad_environment_values_fail_at_init_naming_the_variable(tmp_path: Path) -> None:
    code = ONE_RANK + """
import sys
for name, value in zip(sys.argv[1::2], sys.argv[2::2]):
    os.environ[name] = value
    try:
        init()
        print(f"{name}={value!r} accepted")
    except ValueError as e:
        print(e)
    del os.environ[name]
os.environ["DDLCOMM_SEGMENT_BYTES"] = "4096"  # in range
init()
print("valid setting accepted")
"""
    result = run_python(code, tmp_path, *[item for pair in BAD_ENVIRONMENT.items() for item in pair])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(BAD_ENVIRONMENT) + 1 and lines[-1] == "valid setting accepted", result.stdout
    for (name, value), line in zip(BAD_ENVIRONMENT.items(), lines):
        assert f"{name}='{value}' is invalid: expected " in line, line


def test_unsupported_dtype_messages_use_torch_names(tmp_path: Path) -> None:
    code = ONE_RANK + """
init()
for dtype, op in ((torch.int16, dist.ReduceOp.SUM), (torch.int32, dist.ReduceOp.AVG)):
    try:
        dist.all_reduce(torch.ones(4, dtype=dtype), op=op)
    except TypeError as e:
        print(e)
dist.destroy_process_group()
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert "dtype torch.int16; supported: torch.float32, torch.float64," in lines[0]
    assert "AVG needs a floating-point tensor, got torch.int32" in lines[1]
    assert "Short" not in result.stdout and "Int" not in result.stdout


def test_backend_strings(tmp_path: Path) -> None:
    """"ddlcomm" makes a group torch names "custom" that shuts down quietly; "cpu:ddlcomm" works
    too, before torch 2.14 with a warning about its undefined default backend
    (docs/configuration.md, "Backend strings": ddlcomm reads no torch internals to hide it)."""
    code = ONE_RANK + """
import sys
init(sys.argv[1])
t = torch.ones(3)
dist.all_reduce(t)
print(dist.group.WORLD.name(), t.tolist())
dist.destroy_process_group()
"""
    import torch

    fixed = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)
    mapped = ("custom", False) if fixed else ("undefined", True)
    for backend, name, warned in (("ddlcomm", "custom", False), ("cpu:ddlcomm", *mapped)):
        result = run_python(code, tmp_path, backend)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [name, "[1.0,", "1.0,", "1.0]"], result.stdout
        assert ("No backend of type" in result.stderr) == warned, result.stderr


def test_collectives_write_into_parameters_that_require_grad(tmp_path: Path) -> None:
    """A broadcast or all-reduce into a model's parameters (leaves that require grad; here a
    non-contiguous one, which the backend writes through a copy, as it writes a CUDA tensor
    staged through the host) works as on gloo: autograd records none of it."""
    code = ONE_RANK + """
init()
p = torch.nn.Parameter(torch.arange(12.).reshape(3, 4).t())
dist.broadcast(p, src=0)
dist.all_reduce(p)
print(p.requires_grad, p.is_contiguous(), p.detach().sum().item())
dist.destroy_process_group()
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "66.0"], result.stdout


def test_version_is_the_pyproject_version() -> None:
    import ddlcomm

    with open(ROOT / "pyproject.toml", "rb") as f:
        assert ddlcomm.__version__ == tomllib.load(f)["project"]["version"]


def test_source_tree_without_the_extension_explains_itself(tmp_path: Path) -> None:
    """From a clone's root after a non-editable install, ./ddlcomm (no _C) shadows the installed
    package; Python's own message blamed a circular import."""
    shutil.copytree(ROOT / "ddlcomm", tmp_path / "ddlcomm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # The editable install's finders would redirect `ddlcomm` to the real package: drop them, as
    # a non-editable install has none.
    code = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
sys.path.insert(0, "")
import ddlcomm
"""
    result = run_python(code, tmp_path)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: ddlcomm was imported from ") and "no compiled extension" in message
    assert "circular import" not in result.stderr and "pip install --no-build-isolation -e ." in message
    # An extension that is there but does not load keeps its own message.
    (tmp_path / "ddlcomm" / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a library")
    result = run_python(code, tmp_path)
    assert result.returncode != 0 and "no compiled extension" not in result.stderr
    assert "ImportError" in result.stderr, result.stderr


def test_autoload_registers_the_backend_without_an_import(tmp_path: Path) -> None:
    """The torch.backends entry point: init_process_group("ddlcomm") in a fresh interpreter that
    never imports ddlcomm; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off."""
    code = f"""
import sys, torch, torch.distributed as dist
print("ddlcomm" in sys.modules)
dist.init_process_group("ddlcomm", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
print(t.tolist())
dist.destroy_process_group()
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0 and result.stdout.split("\n")[:2] == ["True", "[1.0, 1.0, 1.0]"], result.stderr
    result = run_python("import sys, torch; print('ddlcomm' in sys.modules)", tmp_path,
                        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.stdout.strip() == "False", result.stderr


def test_autoload_never_breaks_import_torch(tmp_path: Path) -> None:
    """A ddlcomm that fails to import is logged by the entry point, and `import torch` works."""
    (tmp_path / "ddlcomm").mkdir()
    (tmp_path / "ddlcomm" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    shutil.copytree(ROOT / "ddlcomm_autoload", tmp_path / "ddlcomm_autoload")
    code = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
sys.path.insert(0, "")
import torch
print("torch", torch.__version__)
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("torch "), result.stderr
    assert "ddlcomm could not be loaded" in result.stderr and "a broken install" in result.stderr, result.stderr


def test_the_checkout_root_imports_the_built_package() -> None:
    """scripts/setup.sh installs in editable mode: Python run in the clone's root (the README's
    `-m bench...` commands) imports the checkout, with its extension."""
    code = "import ddlcomm, ddlcomm._C, ddlcomm.hooks; print(ddlcomm.__file__, ddlcomm.is_available())"
    result = run_python(code, ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(ROOT / "ddlcomm" / "__init__.py"), "True"], result.stdout


@pytest.mark.parametrize("args, message", [
    (("--ops", "allreduce"), "unknown collective 'allreduce': choose from all_reduce, all_gather, reduce_scatter, "
                             "broadcast, send_recv"),
    (("--sizes", "1k"), "argument --sizes: '1k' is not"),
    (("--budget", "0"), "argument --budget: '0' is not"),
])
def test_collectives_benchmark_refuses_bad_arguments_before_running(args: tuple, message: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    import torch.distributed as dist

    from bench import collectives

    # In this process (a fresh one per case cost 2 s each): argparse's usage error, exit 2,
    # before any process group exists.
    monkeypatch.setattr(sys, "argv", ["collectives", *args])
    with pytest.raises(SystemExit) as exited:
        collectives.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and not dist.is_initialized(), err
