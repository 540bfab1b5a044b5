"""What the trainer-integration workers share (tests/test_trainers.py): running a docs page's
script as written, and measuring a classifier on the whole of its data."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def page_script(page: str) -> str:
    """The first ```python block of ``docs/<page>``: the page's complete script."""
    found = _BLOCK.search((DOCS / page).read_text(encoding="utf-8"))
    if found is None:
        raise AssertionError(f"docs/{page} has no ```python block")
    return found.group(1)


def run_page(page: str, definitions_only: bool = False, replace: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``docs/<page>``'s script as written; returns its globals (its model, trainer, ...).

    ``definitions_only``: only its imports, functions and classes (what the seed measurements
    reuse); ``replace``: text replaced in it first (their seeds)."""
    source = page_script(page)
    for old, new in (replace or {}).items():
        if old not in source:
            raise AssertionError(f"docs/{page}'s script has no {old!r}")
        source = source.replace(old, new)
    tree = ast.parse(source, f"docs/{page}")
    if definitions_only:
        kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        tree.body = [node for node in tree.body if isinstance(node, kept)]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(tree, f"docs/{page}", "exec"), namespace)
    return namespace


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in module.parameters()])


def equal_on_every_rank(tensor: torch.Tensor, group=None) -> bool:
    """Whether every rank holds bitwise this tensor."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor, group=group)
    return all(torch.equal(e, tensor) for e in everyone)


def replicas_equal(module: torch.nn.Module, group=None) -> bool:
    """Whether every rank holds bitwise the same parameters."""
    return equal_on_every_rank(flat(module), group)


@torch.no_grad()
def quality(forward, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``forward`` on all of ``x``, ``y``."""
    logits = forward(x)
    return {"accuracy": (logits.argmax(-1) == y).float().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, y).item()}


def report(result: dict[str, Any]) -> None:
    """Rank 0 prints ``RESULT {json}``, the line the test reads."""
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
