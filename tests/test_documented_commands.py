"""Every benchmark that README.md and docs/ tell a reader to run, run in its shortest form.

Each ``python -m bench...`` / ``torchrun ... -m bench...`` module (the benchmarks of a source
checkout, run from the repository root) and ``python -m ddlcomm.slownet`` named in README.md,
docs/*.md and docs/results/*.md has a case in ``CASES``: the smallest sizes, steps and
iterations its own options allow, 2 ranks where torchrun starts them
(``torchrun --standalone --nproc-per-node 2``), run from the repository root as the docs say,
output into the test's temporary folder. A
case passes when the command exits 0 and writes the files and the table line it is expected
to. ``test_every_documented_benchmark_has_a_case`` keeps ``CASES`` and the docs in step: a
newly documented benchmark without a case fails it.

The emulator and the emulated-network drivers (``ddlcomm.slownet``, ``bench.slownet.run_*``) run
only where ``python -m ddlcomm.slownet --check`` exits 0 (root, network namespaces, tc);
``bench.cuda.*`` only with a CUDA GPU; ``bench.torchft_diloco`` only with
torchft installed (not a dependency of ddlcomm). Skipped otherwise, with the reason.

matplotlib is optional (the ``plots`` extra): a benchmark without it writes its tables and
files and skips its figure with one line on stderr (``bench.plots.pyplot``);
``test_plot_is_skipped_in_one_line_without_matplotlib`` runs plotting benchmarks with
``import matplotlib`` failing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300

# `-m bench.X` or `-m ddlcomm.slownet` after python or torchrun (a command may break across
# lines of the markdown source); ``--module bench.X`` (an argument) and ``bench.NAME``
# (a placeholder) are not benchmarks of their own.
_MODULE = r"(bench(?:\.[a-z_][a-z0-9_]*)+|ddlcomm\.slownet(?:\.[a-z_][a-z0-9_]*)*)\b"
_DOCUMENTED = re.compile(r"(?<![\w-])-m\s+" + _MODULE)

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]  # after the module; "{out}" is the test's temporary folder
    torchrun: bool = False  # 2 ranks under torchrun --standalone
    files: tuple[str, ...] = ()  # expected under {out}
    plots: tuple[str, ...] = ()  # expected under {out} where matplotlib is installed
    line: str = ""  # expected in stdout
    needs: str = ""  # "slownet", "cuda", "torchft"
    slow: bool = False
    inputs: dict[str, Path] = field(default_factory=dict)  # copied into {out} first


TRAIN = """\
import torch, torch.distributed as dist
import ddlcomm  # noqa: F401
dist.init_process_group("ddlcomm")
t = torch.ones(4)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.tolist()}", flush=True)
dist.destroy_process_group()
"""

# The smallest DDP model of bench.compressed (--width/--depth/--batch) and its fewest steps.
_SMALL_DDP = ("--numel", "4096", "--repeats", "1", "--width", "16", "--depth", "1", "--iters", "1", "--batch", "2")

CASES: dict[str, Case] = {
    "bench.adaptive_paired": Case(
        ("--rounds", "1", "--width", "16", "--depth", "1", "--batch", "2", "--methods", "no hook,adaptive 1-bit hook"),
        torchrun=True, line='"method": "adaptive 1-bit hook"'),
    "bench.collectives": Case(
        ("--ops", "all_reduce", "--sizes", "4096", "--budget", "0.01"), torchrun=True, line="  all_reduce "),
    "bench.compress_kernels": Case(("--sizes", "1", "--reps", "1", "--only", "1-bit"), line="1-bit "),
    "bench.compressed": Case(_SMALL_DDP, torchrun=True, line='"kind": "ddp", "method": "ddlcomm 1-bit hook"'),
    "bench.engine": Case(("--sizes-mb", "0.1", "--compressors", "1-bit", "--repeats", "1", "--out", "{out}/engine.md"),
                         torchrun=True, files=("engine.md",), line="| 1-bit, 0.1 MB |"),
    "bench.convergence": Case(
        ("--tasks", "mlp", "--optimizers", "sgd", "--methods", "all-reduce,1-bit", "--seeds", "1", "--steps", "3",
         "--start-compress-iter", "2", "--out", "{out}"),
        torchrun=True, files=("convergence.json", "convergence.md"), line="| 1-bit | "),
    "bench.cost_model": Case(
        ("--measurements", str(ROOT / "docs" / "results" / "cost_model" / "measurements.json"), "--out", "{out}"),
        files=("model.json", "errors.md"), plots=("model.png",), line="median abs. error"),
    "bench.cuda.ddp_step": Case(
        ("--width", "64", "--layers", "1", "--batch", "8", "--warmup", "2", "--steps", "1",
         "--json", "{out}/ddp_step.json"), files=("ddp_step.json",), line="vs all-reduce", needs="cuda"),
    "bench.diloco": Case(
        ("--recipe", "mlp-nesterov", "--methods", "DiLoCo 1-bit", "--seeds", "1", "--steps", "2", "--sync-every", "1",
         "--out", "{out}"), torchrun=True, files=("diloco.json", "diloco.md"), line="| DiLoCo 1-bit | "),
    # One path of one cycle still starts 4 ranks under torchrun four times (an uninterrupted
    # run, then one killed twice and resumed): about a minute on 2 cores.
    "bench.outer_steps": Case(
        ("--recipes", "mlp-nesterov", "--settings", "1:0.5", "--seeds", "1", "--steps", "2", "--sync-every", "1",
         "--out", "{out}"), files=("README.md",), line="| 1 | 0.5 | ", slow=True),
    "bench.elastic_soak": Case(
        ("--minutes", "0.01", "--paths", "ddp-fp16", "--json", "{out}/elastic_soak.json"),
        files=("elastic_soak.json",), line="1 passed", slow=True),
    "bench.soak": Case(("--ops", "24", "--max-mib", "0.0625", "--ranks", "2", "--timeout", "240"),
                               line="| **all** | **24** |"),
    "bench.time_to_accuracy": Case(
        ("--task", "mlp", "--steps", "2", "--eval-every", "1", "--methods", "gloo fp32,DiLoCo 1-bit",
         "--sync-every", "1"), torchrun=True, line='RESULT {"method": "DiLoCo 1-bit"'),
    "bench.torchft_diloco": Case(
        ("--recipe", "mlp-nesterov", "--replicas", "2", "--seeds", "1", "--steps", "2", "--sync-every", "1",
         "--out", "{out}/torchft_diloco.json"), files=("torchft_diloco.json",), line="RESULT ", needs="torchft"),
    "ddlcomm.slownet": Case(
        ("--ranks", "2", "--rate", "1gbit", "--", sys.executable, "{out}/train.py"), line="rank 1 of 2: [2.0",
        needs="slownet"),
    "bench.slownet.run_compressed": Case(
        ("--rates", "1gbit", "--ranks", "2", "--out", "{out}", "--", *_SMALL_DDP),
        files=("slownet.json",), plots=("slownet.png",), line="| ddlcomm 1-bit hook | ", needs="slownet"),
    "bench.slownet.run_cost_model": Case(
        ("--hosts", "2", "--ranks-per-host", "1", "--rates", "1gbit", "--delays", "0.05ms", "--out", "{out}", "--",
         "--sizes", "65536", "--repeats", "1", "--warmup", "0", "--algorithms", "gloo,ring"),
        files=("measurements.json",), line="ring ", needs="slownet"),
    # 4 ranks: the driver has no --ranks. --allocator system where tcmalloc is not installed.
    "bench.slownet.run_fsdp_step": Case(
        ("--rates", "1gbit", "--out", "{out}", "--", "--width", "64", "--depth", "1", "--batch", "2",
         "--iters", "1", "--methods", "gloo,1-bit"),
        files=("fsdp_step.json", "fsdp_step.md"), line="| 1-bit | ", needs="slownet"),
    # 4 ranks: the driver has no --ranks; the language model (the cheaper task), one step.
    "bench.slownet.run_time_to_accuracy": Case(
        ("--rates", "1gbit", "--tasks", "lm", "--steps", "1", "--methods", "gloo fp32", "--out", "{out}"),
        files=("time_to_accuracy.json", "time_to_accuracy.md"), plots=("time_to_accuracy.png",),
        line="| gloo fp32 | ", needs="slownet", slow=True),
    # 4 hosts; a narrow CNN, one failure in each of the two ways of recovering (torchft's
    # rejoin, torchrun's restart of every rank): the replica restarted under torchft may come
    # back after the others finished (then stopped after --grace, and said so).
    "bench.slownet.run_torchft_faults": Case(
        ("--rates", "1gbit", "--configs", "ddlcomm-ternary,elastic-ternary", "--faults", "faults", "--die-at", "2",
         "--outer-steps", "4", "--width", "64", "--grace", "3", "--out", "{out}"),
        files=("torchft_faults.json", "torchft_faults.md"), line="| torchrun restarts, ternary | ranks lost",
        needs="slownet", slow=True),
    "bench.slownet.run_tcp_streams": Case(
        ("--rates", "1gbit", "--streams", "1", "--repeats", "1", "--bytes", "1000000"),
        line="1 stream(s) each way", needs="slownet"),
}


def documented_modules() -> dict[str, list[str]]:
    """Module -> the docs (relative paths) that give a command running it."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for module in _DOCUMENTED.findall(doc.read_text(encoding="utf-8")):
            where = found.setdefault(module, [])
            if str(doc.relative_to(ROOT)) not in where:
                where.append(str(doc.relative_to(ROOT)))
    return found


@functools.cache
def slownet_unavailable() -> str:
    """Empty where ``python -m ddlcomm.slownet --check`` exits 0, else why not."""
    try:
        check = subprocess.run([sys.executable, "-m", "ddlcomm.slownet", "--check"], capture_output=True,
                               text=True, timeout=120, cwd=ROOT / "tests")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`python -m ddlcomm.slownet --check` did not run: {e}"
    if check.returncode == 0:
        return ""
    said = (check.stdout + check.stderr).strip().splitlines()
    return (f"needs root and network namespaces: `python -m ddlcomm.slownet --check` exits "
            f"{check.returncode}: {said[-1] if said else '(no output)'}")


def skip_reason(needs: str) -> str:
    if needs == "slownet":
        return slownet_unavailable()
    if needs == "cuda":
        import torch

        return "" if torch.cuda.is_available() else "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if needs == "torchft":
        return "" if importlib.util.find_spec("torchft") else \
            "needs torchft (pip install --no-deps torchft; not a dependency of ddlcomm)"
    return ""


def environment(**extra: str) -> dict[str, str]:
    """This environment without a launcher's rendezvous variables (a rank's own would leak in)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def command(module: str, case: Case, out: Path) -> list[str]:
    args = [a.replace("{out}", str(out)) for a in case.args]
    if module == "bench.slownet.run_fsdp_step" and not _has_tcmalloc():
        args = ["--allocator", "system", *args]
    if case.torchrun:
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", module, *args]
    return [sys.executable, "-m", module, *args]


def _has_tcmalloc() -> bool:
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") is not None


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _tail(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"


def test_every_documented_benchmark_has_a_case():
    documented = documented_modules()
    assert "bench.slownet.run_compressed" in documented, "the docs' commands were not found: check _DOCUMENTED"
    missing = {m: documented[m] for m in sorted(set(documented) - set(CASES))}
    stale = sorted(set(CASES) - set(documented))
    assert not missing, (f"benchmarks documented without a short-form case in tests/test_documented_commands.py "
                         f"CASES (module: docs): {missing}")
    assert not stale, f"CASES has modules no doc runs any more (remove them): {stale}"
    absent = [m for m in documented if importlib.util.find_spec(m) is None]
    assert not absent, f"the docs run modules that do not exist: {absent}"


# Not after "-- ": ``python -m ddlcomm.slownet ... -- python -m bench.X`` starts each rank itself.
_PLAIN_PYTHON = re.compile(r"(?<!-- )(?<![\w-])python3?\s+-m\s+" + _MODULE)


def test_benchmarks_whose_ranks_torchrun_starts_are_documented_with_torchrun():
    """``python -m bench.collectives`` only says to start it with torchrun (exit 1)."""
    wrong = [f"{doc.relative_to(ROOT)}: python -m {module}" for doc in DOCS
             for module in _PLAIN_PYTHON.findall(doc.read_text(encoding="utf-8"))
             if module in CASES and CASES[module].torchrun]
    assert not wrong, f"commands that cannot run as written (their ranks need torchrun): {wrong}"


def test_the_command_pattern_reads_wrapped_commands_and_skips_arguments():
    text = ("`torchrun --standalone --nproc-per-node 4\n-m bench.diloco --out DIR`; `python -m\n"
            "bench.slownet.run_compressed --module bench.adaptive_paired`; each "
            "`python -m bench.NAME`; `bench.tasks` is a library; `sudo python -m ddlcomm.slownet --check`; "
            "`-m benchmarks`, `-m ddlcomm.slownetwork`.")
    assert _DOCUMENTED.findall(text) == ["bench.diloco", "bench.slownet.run_compressed", "ddlcomm.slownet"]


@pytest.mark.parametrize("module", [pytest.param(m, id=m, marks=[pytest.mark.slow] if c.slow else [])
                                    for m, c in CASES.items()])
def test_documented_benchmark_runs_in_its_shortest_form(module: str, tmp_path: Path):
    case = CASES[module]
    reason = skip_reason(case.needs)
    if reason:
        pytest.skip(reason)
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.py").write_text(TRAIN)  # the training script of `python -m ddlcomm.slownet -- ...`
    result = run(command(module, case, out), ROOT, environment())
    assert result.returncode == 0, _tail(result)
    assert "Traceback" not in result.stderr, _tail(result)
    assert case.line in result.stdout, f"no line with {case.line!r}\n{_tail(result)}"
    expected = case.files + (case.plots if HAS_MATPLOTLIB else ())
    missing = [name for name in expected if not (out / name).is_file()]
    assert not missing, f"{module} did not write {missing} into {out}\n{_tail(result)}"



def test_engine_ddp_form_runs_and_writes_its_table(tmp_path: Path):
    """``bench.engine --ddp`` (engine.md's DDP tables): one row per group with all seven figures."""
    args = ("--ddp", "--width", "16", "--depth", "1", "--batch", "2", "--repeats", "1", "--out", f"{tmp_path}/e.md")
    result = run(command("bench.engine", Case(args, torchrun=True), tmp_path), ROOT, environment())
    assert result.returncode == 0, _tail(result)
    rows = [line for line in (tmp_path / "e.md").read_text().splitlines() if line.startswith(("| ddlcomm |", "| gloo |"))]
    assert len(rows) == 2 and all(len(row.strip("|").split("|")) == 8 for row in rows), rows

# Options below what a benchmark can run, each with the minimum its usage error must name. Both
# are refused before any rank starts (plain python, no torchrun): one usage line, exit 2.
BELOW_MINIMUM = {
    "bench.soak --ops 8": (("--ops", "8", "--max-mib", "0.0625", "--ranks", "2", "--timeout", "60"),
                           "at least 24 operations"),
    "bench.convergence --start-compress-iter 1": (
        ("--tasks", "mlp", "--optimizers", "sgd", "--methods", "1-bit", "--seeds", "1", "--steps", "3",
         "--start-compress-iter", "1"), "must be at least 2"),
}


@pytest.mark.parametrize("name", list(BELOW_MINIMUM))
def test_option_below_its_minimum_is_a_usage_error(name: str):
    module, option = name.split(" ", 1)
    args, minimum = BELOW_MINIMUM[name]
    result = run([sys.executable, "-m", module, *args], ROOT, environment())
    assert result.returncode == 2, _tail(result)
    assert "Traceback" not in result.stderr + result.stdout, _tail(result)
    assert f"error: {option}: " in result.stderr and minimum in result.stderr, _tail(result)


# Plotting benchmarks, each with what it writes besides its figure and the figure.
HIDDEN = {
    "bench.cost_model": (CASES["bench.cost_model"], "model.png"),
    "bench.slownet.run_time_to_accuracy --render": (
        Case(("--render", "{out}/time_to_accuracy.json"), files=("time_to_accuracy.md",), line="| gloo fp32 | ",
             inputs={"time_to_accuracy.json": ROOT / "docs" / "results" / "time_to_accuracy.json"}),
        "time_to_accuracy.png"),
    # The report of issue #67: the tables, then ModuleNotFoundError, exit 1, no slownet.json.
    "bench.slownet.run_compressed": (
        Case(("--rates", "1gbit", "--ranks", "2", "--out", "{out}", "--", "--skip-ddp", "--numel", "4096",
              "--repeats", "1"), files=("slownet.json",), line="| ddlcomm 1-bit | ", needs="slownet"),
        "slownet.png"),
}


@pytest.mark.parametrize("name", list(HIDDEN))
def test_plot_is_skipped_in_one_line_without_matplotlib(name: str, tmp_path: Path):
    """``import matplotlib`` fails (a package of that name on PYTHONPATH raises ImportError):
    the benchmark still exits 0 with its tables and files, and says in one line on stderr how
    to get the figure."""
    module = name.split()[0]
    case, figure = HIDDEN[name]
    reason = skip_reason(case.needs)
    if reason:
        pytest.skip(reason)
    hidden = tmp_path / "hidden"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text('raise ImportError("matplotlib is hidden by the test")\n')
    out = tmp_path / "out"
    out.mkdir()
    for target, source in case.inputs.items():
        shutil.copy(source, out / target)
    pythonpath = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH", "")) if p)
    result = run(command(module, case, out), ROOT, environment(PYTHONPATH=pythonpath))
    assert result.returncode == 0, _tail(result)
    assert "Traceback" not in result.stderr, _tail(result)
    notes = [line for line in result.stderr.splitlines() if "matplotlib" in line]
    assert len(notes) == 1, f"expected one line about matplotlib on stderr\n{_tail(result)}"
    assert "pip install matplotlib" in notes[0] and figure in notes[0], notes[0]
    assert case.line in result.stdout, f"no line with {case.line!r}\n{_tail(result)}"
    missing = [n for n in case.files if not (out / n).is_file()]
    assert not missing, f"{module} did not write {missing}\n{_tail(result)}"
    assert not (out / figure).exists(), f"{figure} written without matplotlib?"


def test_only_the_shared_helper_imports_matplotlib():
    """Every figure goes through bench.plots.pyplot, which copes with its absence."""
    helper = ROOT / "bench" / "plots.py"
    importing = [str(p.relative_to(ROOT)) for p in sorted([*(ROOT / "ddlcomm").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
                 if p != helper and re.search(r"^\s*(?:import|from)\s+matplotlib\b", p.read_text(), re.MULTILINE)]
    assert not importing, f"import matplotlib outside bench/plots.py (use its pyplot()): {importing}"
