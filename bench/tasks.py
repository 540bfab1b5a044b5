"""Training tasks for the convergence and time-to-accuracy benchmarks: no downloads.

* ``mlp``: an MLP (64-512-512-10) classifying scikit-learn's handwritten digits (8x8).
* ``cnn``: a small convolutional network (two conv + batch-norm blocks, two linear layers)
  on the same digits placed at random positions of a 16x16 canvas, so that it has to find
  them (fresh placements every batch, a fixed set of placements for the test).
* ``lm``: a character-level transformer language model (2 layers, width 128, context 64) on
  the Python documentation that ships with CPython (``pydoc_data.topics``); the metric is
  the validation loss in nats per character.
* ``gru``: a recurrent character model (one GRU layer, width 128) on the same text and metric.

Every task trains for ``steps`` optimizer steps with a linear learning-rate warm-up over the
first 5% of them and a cosine decay to zero, the schedule people use. ``width`` scales the
CNN's and the LM's parameter count for the time-to-accuracy benchmark, where communication
has to matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Task", "TASKS", "make_task", "lr_lambda"]


def lr_lambda(steps: int) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of ``steps``, then a cosine decay to zero."""
    warm = max(1, steps // 20)
    return lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / steps))


@dataclass
class Task:
    """One task: how to build the model, draw a batch and score the model."""

    name: str
    metric: str  # "accuracy" (percent, higher is better) or "loss" (lower is better)
    steps: int
    lr: dict[str, float]  # optimizer name -> the learning rate that is best for plain all-reduce
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], float]

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def _classification(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _accuracy(xt: torch.Tensor, yt: torch.Tensor) -> Callable[[nn.Module], float]:
    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        correct = (model(xt).argmax(1) == yt).float().mean().item()
        model.train(was_training)
        return 100.0 * correct

    return evaluate


def mlp_task(batch: int = 32, steps: int = 300) -> Task:
    x, y = _digits()
    train_x, train_y, test_x, test_y = x[:1400], y[:1400], x[1400:], y[1400:]

    def draw(g: torch.Generator):
        idx = torch.randint(0, len(train_x), (batch,), generator=g)
        return train_x[idx], train_y[idx]

    return Task("mlp", "accuracy", steps, {"sgd": 0.4, "adamw": 3e-3},
                lambda: nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
                draw, _classification, _accuracy(test_x, test_y))


def _place(digits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """8x8 digits (N, 64) at random offsets of a 16x16 canvas: (N, 1, 16, 16)."""
    n = len(digits)
    canvas = torch.zeros(n, 1, 16, 16)
    ox = torch.randint(0, 9, (n,), generator=g)
    oy = torch.randint(0, 9, (n,), generator=g)
    images = digits.view(n, 8, 8)
    for i in range(n):
        canvas[i, 0, oy[i] : oy[i] + 8, ox[i] : ox[i] + 8] = images[i]
    return canvas


def cnn_task(batch: int = 32, steps: int = 300, width: int = 256) -> Task:
    x, y = _digits()
    train_x, train_y = x[:1400], y[:1400]
    test_x = _place(x[1400:].repeat(4, 1), torch.Generator().manual_seed(1))
    test_y = y[1400:].repeat(4)

    def draw(g: torch.Generator):
        idx = torch.randint(0, len(train_x), (batch,), generator=g)
        return _place(train_x[idx], g), train_y[idx]

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, width), nn.ReLU(), nn.Linear(width, 10),
        )

    return Task("cnn", "accuracy", steps, {"sgd": 0.1, "adamw": 6e-3}, model, draw, _classification,
                _accuracy(test_x, test_y))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class CharTransformer(nn.Module):
    """A decoder-only transformer over characters (pre-norm blocks, learned positions)."""

    def __init__(self, vocab: int, d: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.randn(context, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.position[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.norm(x))


class CharGRU(nn.Module):
    """A recurrent character model: an embedding, one GRU layer, a linear head."""

    def __init__(self, vocab: int, d: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(idx))[0])


def _characters(name: str, batch: int, steps: int, context: int, lr: dict[str, float],
                model: Callable[[int], nn.Module]) -> Task:
    """A character-level language task on CPython's documentation: `model(vocab)` predicts the
    next character; the metric is the validation loss in nats per character."""
    import pydoc_data.topics as topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(data) * 0.9)
    train, val = data[:cut], data[cut:]
    starts = torch.randint(0, len(val) - context - 1, (128,), generator=torch.Generator().manual_seed(2))
    val_x = torch.stack([val[s : s + context] for s in starts])
    val_y = torch.stack([val[s + 1 : s + context + 1] for s in starts])

    def draw(g: torch.Generator):
        s = torch.randint(0, len(train) - context - 1, (batch,), generator=g)
        return (torch.stack([train[i : i + context] for i in s]), torch.stack([train[i + 1 : i + context + 1] for i in s]))

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        return loss(model, val_x, val_y).item()

    return Task(name, "loss", steps, lr, lambda: model(len(chars)), draw, loss, evaluate)


def lm_task(batch: int = 8, steps: int = 300, width: int = 128, context: int = 64) -> Task:
    return _characters("lm", batch, steps, context, {"sgd": 0.2, "adamw": 6e-3},
                       lambda vocab: CharTransformer(vocab, d=width, heads=max(1, width // 32), context=context))


def gru_task(batch: int = 8, steps: int = 300, width: int = 128, context: int = 64) -> Task:
    return _characters("gru", batch, steps, context, {"sgd": 1.0, "adamw": 3e-3},
                       lambda vocab: CharGRU(vocab, d=width))


TASKS: dict[str, Callable[..., Task]] = {"mlp": mlp_task, "cnn": cnn_task, "lm": lm_task, "gru": gru_task}


def make_task(name: str, **options) -> Task:
    """The task called ``name`` ("mlp", "cnn", "lm", "gru"), with size options passed through."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](**options)
