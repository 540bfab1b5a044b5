"""The documentation runs as written.

* Every ```python block of README.md and docs/*.md is a complete program, and runs: blocks
  that use torch.distributed on 2 ranks, README.md's under torchrun (``python -m
  torch.distributed.run --standalone --nproc-per-node 2``, as a newcomer runs them), the other
  docs' with the environment torchrun gives, forked from the tests' zygote (tests/harness.py:
  a torchrun start costs ~7 s on 2 cores; exit under torchrun is tested by tests/test_exit.py),
  the others in a plain interpreter. Each block runs in
  an empty temporary directory, so it may write files there. A new block is picked up
  automatically. A fragment that cannot run on its own (a signature, an excerpt) does not
  belong in a ```python block: fence it as ```text, or indent it.
* Every markdown link to a relative path (``[text](path)``, ``[id]: path``) names a file or
  folder that exists in the repository, and every ``../`` path the docs mention stays inside
  the repository and exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import launch_script

ROOT = Path(__file__).resolve().parents[1]
# Documents whose python blocks must run (docs/results/ holds measurement reports, not guides).
SNIPPET_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Documents whose links must resolve.
LINK_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET_TIMEOUT_S = 180

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_USES_DISTRIBUTED = re.compile(r"torch\.distributed|from torch import distributed|init_process_group")


@dataclass(frozen=True)
class Block:
    doc: Path
    number: int  # 1-based, among the doc's python blocks
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence (past the end when the block is not closed)
    language: str
    source: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.number}"


def fenced_blocks(doc: Path) -> list[Block]:
    """Every fenced code block of `doc` (CommonMark fences: ``` or ~~~, up to 3 spaces indent)."""
    blocks, lines = [], doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        words = opening["info"].split()
        language = words[0].lower() if words else ""
        body, j = [], i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (closing is not None and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence)
                    and not closing["info"].strip()):
                break
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        blocks.append(Block(doc, 0, i + 1, j + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks(doc: Path) -> list[Block]:
    found = [b for b in fenced_blocks(doc) if b.language in ("python", "py", "python3")]
    return [Block(b.doc, n, b.line, b.end, b.language, b.source) for n, b in enumerate(found, 1)]


BLOCKS = [block for doc in SNIPPET_DOCS for block in python_blocks(doc)]


def _clip(text: str, limit: int = 8000) -> str:
    # Both ends: a rank's traceback comes first, torchrun's summary of the failure last.
    half = limit // 2
    return text if len(text) <= limit else text[:half] + "\n[...]\n" + text[-half:]


def _kill_marked(marker: str) -> None:
    """SIGKILLs every process whose environment holds `marker` (torchrun's ranks run in
    sessions of their own, so killing torchrun's process group does not reach them)."""
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone, or not ours


def run_block(block: Block, timeout: float = SNIPPET_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Runs `block` as a program in a fresh temporary directory; returns the finished process."""
    distributed = _USES_DISTRIBUTED.search(block.source) is not None
    marker = f"DDLCOMM_DOC_SNIPPET={uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update([marker.split("=", 1)])
    with tempfile.TemporaryDirectory(prefix="ddlcomm-doc-") as cwd:
        script = Path(cwd) / "snippet.py"
        script.write_text(block.source, encoding="utf-8")
        if distributed and block.doc.name != "README.md":
            ranks = launch_script(script, 2, timeout=timeout, env=env)
            output = "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output}" for r in ranks)
            return subprocess.CompletedProcess(["2 ranks:", script.name], next((r.returncode for r in ranks
                                                                                if r.returncode), 0), output, "")
        if distributed:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   script.name]
        else:
            cmd = [sys.executable, script.name]
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_marked(marker)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"{block.name} (the ```python block at line {block.line}) did not finish within {timeout} s: "
                        f"{' '.join(cmd)}\n--- stdout\n{_clip(out)}\n--- stderr\n{_clip(err)}", pytrace=False)
        finally:
            _kill_marked(marker)  # nothing may outlive the test (normally there is nothing left)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_docs_have_python_blocks():
    # Guards the parser: the README's examples must be found, or every snippet test would vanish.
    readme = [b for b in BLOCKS if b.doc.name == "README.md"]
    assert len(readme) >= 2, [b.name for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_python_block_runs(block: Block):
    compile(block.source, f"{block.name} (line {block.line})", "exec")  # a syntax error, named plainly
    done = run_block(block)
    if done.returncode != 0:
        pytest.fail(f"{block.name} (the ```python block at line {block.line}) exited with {done.returncode}: "
                    f"{' '.join(map(str, done.args))}\n--- source\n{block.source}--- stdout\n{_clip(done.stdout)}\n"
                    f"--- stderr\n{_clip(done.stderr)}", pytrace=False)


# -- links -----------------------------------------------------------------------------------

_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
_PARENT_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.\-/]*\w)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(doc: Path) -> str:
    """The doc's text without fenced code blocks and code spans (links are not parsed there)."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    for block in fenced_blocks(doc):
        for k in range(block.line - 1, min(block.end, len(lines))):
            lines[k] = ""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", "\n".join(lines))


def relative_links(doc: Path) -> list[str]:
    text = _prose(doc)
    targets = [m.group(1) for m in _INLINE_LINK.finditer(text)] + _REFERENCE_DEF.findall(text)
    return [t for t in targets if not t.startswith("#") and not _SCHEME.match(t)]


def _resolve(doc: Path, target: str) -> Path:
    path = target.split("#", 1)[0].split("?", 1)[0]
    base = ROOT if path.startswith("/") else doc.parent
    return (base / path.lstrip("/")).resolve()


@pytest.mark.parametrize("doc", LINK_DOCS, ids=[str(d.relative_to(ROOT)) for d in LINK_DOCS])
def test_relative_links_exist(doc: Path):
    broken = []
    for target in relative_links(doc):
        path = _resolve(doc, target)
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to paths that are not in the repository: {broken}"


@pytest.mark.parametrize("doc", LINK_DOCS, ids=[str(d.relative_to(ROOT)) for d in LINK_DOCS])
def test_parent_paths_stay_in_repository(doc: Path):
    # `../x` written anywhere in a doc (code spans and prose included) is a path relative to
    # the doc; it must name a file of this repository, not one beside it.
    bad = []
    for target in _PARENT_PATH.findall(doc.read_text(encoding="utf-8")):
        path = _resolve(doc, target)
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, f"{doc.relative_to(ROOT)} refers to paths outside the repository or missing: {bad}"


def test_link_checks_catch_missing_and_outside_paths(tmp_path: Path):
    # The checks themselves: a missing file, a path outside the repository, and the ones to ignore.
    doc = ROOT / "docs" / "example.md"  # never written: only its location matters
    text = ("[a](missing-file.md) [b](../README.md#x) [c](https://example.com) [d](#anchor)\n"
            "`[e](in-code.md)`\n```python\n[f](in-block.md)\n```\n[g]: ../../outside.md\n")
    fake = tmp_path / "example.md"
    fake.write_text(text)
    links = relative_links(fake)
    assert links == ["missing-file.md", "../README.md#x", "../../outside.md"], links
    assert _resolve(doc, "../README.md#x") == ROOT / "README.md"
    assert not _resolve(doc, "missing-file.md").exists()
    assert not _resolve(doc, "../../outside.md").is_relative_to(ROOT)
    assert _PARENT_PATH.findall("the account of `../shared/DESIGN.md`.") == ["../shared/DESIGN.md"]


def test_support_matrix_is_current():
    """docs/support-matrix.md is what scripts/support_matrix.py finds by calling every
    collective with every dtype and reduce op on ddlcomm and gloo."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "support_matrix.py"), "--check"],
                            cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_source_layout_names_only_existing_paths():
    """The first column of docs/design.md's "Layout" block names folders that exist, and
    every folder of csrc/ is among them."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    block = section[section.index("```text") + len("```text"):section.index("```", section.index("```text") + 3)]
    named = [line.split()[0] for line in block.splitlines() if line and not line.startswith(" ")]
    assert named, "no layout block"
    missing = [path for path in named if not (ROOT / path).exists()]
    assert not missing, f"the layout names paths that do not exist: {missing}"
    unnamed = [f"csrc/{d.name}/" for d in sorted((ROOT / "csrc").iterdir()) if d.is_dir()
               and f"csrc/{d.name}/" not in named]
    assert not unnamed, f"the layout leaves out {unnamed}"


@pytest.mark.parametrize("module", ["convergence", "collectives"])
def test_benchmark_started_without_torchrun_says_how(module: str):
    """Not torch's raw "RANK expected": one line naming the launcher and the command (run from
    the repository root, as the docs say)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-m", f"bench.{module}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"torchrun --nproc-per-node 4 -m bench.{module}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


HELP_CHECK = r'''
import contextlib, io, pkgutil, re, runpy, sys
import bench, ddlcomm.slownet
modules = [m.name for package in (bench, ddlcomm.slownet)
           for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".") if not m.ispkg]
assert "bench.ddp_demo" in modules and "ddlcomm.slownet.__main__" in modules, modules
for module in modules:
    out = io.StringIO()
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module(module, run_name="__main__")
    except SystemExit:
        pass
    lines = out.getvalue().split("options:", 1)[-1].splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^  (-[-\w]+(?:[ ,][^ ].*?)?)(\s{2,}\S.*)?$", line)
        described = match and (match.group(2) or (i + 1 < len(lines) and lines[i + 1].startswith("      ")
                                                  and not lines[i + 1].strip().startswith("-")))
        if match and not described:
            print(f"UNDESCRIBED {module} {line.strip()}")
'''


def test_every_command_line_option_is_described():
    """Every benchmark's, the demo's and the emulator's ``--help`` describes each option it
    lists (run from the repository root, where ``bench`` is found)."""
    result = subprocess.run([sys.executable, "-c", HELP_CHECK], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "UNDESCRIBED" not in result.stdout, result.stdout


# How the code reads a DDLCOMM_* environment variable: the C++ helpers and the transport
# table's spin entries (csrc), os.environ (ddlcomm/ and the benchmarks, bench/).
_ENVIRON = re.compile(r'environ(?:\.get\(|\[)"(DDLCOMM_[A-Z_]+)"')
_ENV_READS = [(ROOT / "csrc", "*.cc", re.compile(r'env(?:String|Integer)\("(DDLCOMM_[A-Z_]+)"|"(DDLCOMM_[A-Z]+_SPIN_US)"')),
              (ROOT / "ddlcomm", "*.py", _ENVIRON), (ROOT / "bench", "*.py", _ENVIRON)]


def test_every_environment_variable_is_in_the_configuration_table():
    """Each DDLCOMM_* variable the code reads has its row in docs/configuration.md."""
    table = (ROOT / "docs" / "configuration.md").read_text()
    read = {name for folder, pattern, regex in _ENV_READS for path in folder.rglob(pattern)
            for match in regex.finditer(path.read_text()) for name in match.groups() if name}
    assert {"DDLCOMM_TRANSPORT", "DDLCOMM_NUM_THREADS", "DDLCOMM_SHM_SPIN_US"} <= read, sorted(read)
    missing = sorted(name for name in read if f"| `{name}` |" not in table)
    assert not missing, f"read by the code, not in docs/configuration.md's table: {missing}"


def test_help_of_the_package_is_short():
    """help(ddlcomm) is the package's own text, not the backend class's inherited c10d methods."""
    import pydoc

    import ddlcomm

    text = pydoc.render_doc(ddlcomm, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 100, len(text.splitlines())
    assert "ProcessGroupDdlcomm" in text  # named in the description, for help() on it


def test_no_module_imports_another_modules_private_names():
    """What ddlcomm's modules and the benchmarks (bench/) share has a public name
    (ddlcomm.wire, ddlcomm.options); the compiled extension ``_C`` is the one underscore module
    they import."""
    import ast

    offenders = []
    for path in sorted([*(ROOT / "ddlcomm").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ("ddlcomm", "bench")):
                offenders += [f"{path.relative_to(ROOT)}: {alias.name}" for alias in node.names
                              if alias.name.startswith("_") and alias.name != "_C"]
    assert not offenders, offenders
