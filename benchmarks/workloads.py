"""The benchmark's workloads (model + data) and modes (how one training step is taken).

A *workload* builds a model and batches of synthetic data; a *mode* wraps it in an
optimizer and exposes ``step()``: zero the gradients, forward, cross-entropy loss,
backward, optimizer step. Every mode of a workload starts from the same initial weights
and sees the same batches, so their step times differ only by how they train.

Modes:

``non-private``   ``torch.optim.SGD``, the baseline every ratio is taken against.
``dpoptim``       ``dpoptim.DPSGD`` (clipping, noise and accounting inside ``step()``).
``opacus-hooks``  Opacus ``PrivacyEngine``, per-sample gradients from module hooks.
``opacus-ghost``  Opacus ``PrivacyEngine``, ghost clipping (two backward passes).

Opacus needs its own layers for LSTM and attention; ``ModuleValidator.fix`` swaps them in
(``DPLSTM``, ``DPMultiheadAttention``) for the Opacus modes only.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch
from torch import nn

__all__ = ["WORKLOADS", "MODES", "Workload", "Trainer", "build", "opacus_available", "first_line", "quiet"]

MODES = ("non-private", "dpoptim", "opacus-hooks", "opacus-ghost")

# DP settings shared by every private mode. sample_rate only feeds the accountants.
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
DATASET_SIZE = 50_000
LEARNING_RATE = 0.05
CLASSES = 10
VOCAB = 5000
SEQ_LEN = 64


# ---------------------------------------------------------------------------- models
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, CLASSES))


def tiny() -> nn.Module:
    """The demo's model, 64-32-10: small enough that the step time is the fixed cost of a
    step (Python around the hooks, the noise draw), not arithmetic."""
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def cnn() -> nn.Module:
    """CIFAR-size: three conv blocks (conv, GroupNorm, ReLU, pooling), a Linear head."""

    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(3, 32), *block(32, 64), *block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, CLASSES),
    )


class LSTMClassifier(nn.Module):
    """Embedding 5000x64, LSTM 64->128, Linear head on the last hidden state."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, CLASSES)

    def forward(self, tokens):
        out, _ = self.lstm(self.embedding(tokens))
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    """Token and learned position embeddings (d = 128), a 2-layer post-norm encoder
    (4 heads, feed-forward 512), mean pooling, a Linear head. Dropout is 0 throughout,
    so every mode runs the same computation (Opacus' attention is its own module)."""

    def __init__(self, d: int = 128, heads: int = 4, ff: int = 512, layers: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d)
        self.positions = nn.Embedding(SEQ_LEN, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, tokens):
        n, T = tokens.shape
        where = torch.arange(T, device=tokens.device).expand(n, T)
        h = self.encoder(self.tokens(tokens) + self.positions(where))
        return self.head(h.mean(1))


# ---------------------------------------------------------------------------- workloads
def _images(shape):
    def make(n, generator, device):
        x = torch.randn(n, *shape, generator=generator)
        y = torch.randint(0, CLASSES, (n,), generator=generator)
        return x.to(device), y.to(device)

    return make


def _tokens(n, generator, device):
    x = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=generator)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return x.to(device), y.to(device)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model: Callable[[], nn.Module]
    batch: Callable  # (n, generator, device) -> (inputs, labels)
    batch_size: int  # for step time
    memory_batch_size: int | None  # for peak memory (None: not measured)
    quick_batch_size: int  # --quick


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tiny", "Tiny MLP 64-32-10 (fixed cost of a step)", tiny, _images((64,)), 32, None, 32),
        Workload("mlp", "MLP 784-512-512-10", mlp, _images((784,)), 256, 1024, 64),
        Workload("cnn", "CNN 3 conv + GroupNorm, 3x32x32", cnn, _images((3, 32, 32)), 128, None, 16),
        Workload("lstm", "Embedding 5000x64 + LSTM 64->128, T=64", LSTMClassifier, _tokens, 64, None, 8),
        Workload("transformer", "Transformer encoder 2x(d=128, 4 heads, ff 512), T=64", TransformerClassifier,
                 _tokens, 32, 64, 8),
    )
}


# ---------------------------------------------------------------------------- modes
def opacus_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("opacus") is not None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class Trainer:
    """One mode of one workload: a model, an optimizer, fixed batches and ``step()``."""

    def __init__(self, mode, model, optimizer, batches, criterion=None, device="cpu"):
        self.mode = mode
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.criterion = criterion or nn.CrossEntropyLoss()
        self.device = torch.device(device)
        self.steps = 0
        self._paused: list = []

    def step(self) -> None:
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.criterion(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # dpoptim's engine watches module calls through process-wide forward hooks until its
    # first step has been checked (then through hooks on its own model's modules only).
    # When several modes share a process (the timing run), process-wide hooks would also
    # fire, and cost time, on the other modes' models; the harness pauses them while
    # another mode steps, so every mode is timed as if it were alone.
    def pause_global_hooks(self) -> None:
        if self._paused:
            return
        engine = getattr(self.optimizer, "_engine", None)
        for handle in getattr(engine, "_handles", ()):
            dicts = [handle.hooks_dict_ref()] + [ref() for ref in getattr(handle, "extra_dict_ref", ())]
            if not any(d is g for d in dicts for g in _global_hook_dicts()):
                continue
            for d in dicts:
                if d is not None and handle.id in d:
                    self._paused.append((d, handle.id, d.pop(handle.id)))

    def resume_global_hooks(self) -> None:
        for d, key, value in self._paused:
            d[key] = value
        self._paused.clear()


def _global_hook_dicts():
    module = nn.modules.module
    return (module._global_forward_pre_hooks, module._global_forward_hooks)


def quiet() -> None:
    """Benchmarks reuse a few fixed-size batches: silence, for the whole process, the
    warnings that (rightly) point out that this is not Poisson sampling, and Opacus'
    setup chatter. Process-wide, so that no mode pays for a warnings context per step."""
    warnings.simplefilter("ignore")


def build(workload: Workload, mode: str, batch_size: int, device="cpu", seed: int = 0, n_batches: int = 4) -> Trainer:
    """A :class:`Trainer` for ``mode`` on ``workload``. Raises if the mode cannot be set up
    (Opacus missing, a layer it or dpoptim cannot handle)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    device = torch.device(device)
    torch.manual_seed(seed)
    model = workload.model().to(device)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [workload.batch(batch_size, generator, device) for _ in range(n_batches)]
    model.train()
    if mode == "non-private":
        return Trainer(mode, model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), batches, device=device)
    if mode == "dpoptim":
        import dpoptim

        optimizer = dpoptim.DPSGD(
            model.parameters(), lr=LEARNING_RATE, noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM, expected_batch_size=batch_size,
            sample_rate=batch_size / DATASET_SIZE,
        )
        return Trainer(mode, model, optimizer, batches, device=device)
    return _opacus(mode, model, batches, batch_size, device)


def _opacus(mode, model, batches, batch_size, device) -> Trainer:
    try:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator
    except ImportError as exc:
        raise RuntimeError("Opacus is not installed (pip install '.[bench]')") from exc
    from torch.utils.data import DataLoader, TensorDataset

    if not ModuleValidator.is_valid(model):
        model = ModuleValidator.fix(model).to(device)  # LSTM -> DPLSTM, attention -> DPMultiheadAttention
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    x, y = batches[0]
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    engine = PrivacyEngine(accountant="rdp")
    criterion = nn.CrossEntropyLoss()
    common = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=NOISE_MULTIPLIER,
                  max_grad_norm=MAX_GRAD_NORM, poisson_sampling=False)
    if mode == "opacus-hooks":
        model, optimizer, _ = engine.make_private(**common, grad_sample_mode="hooks")
    else:
        model, optimizer, criterion, _ = engine.make_private(**common, criterion=criterion, grad_sample_mode="ghost")
    trainer = Trainer(mode, model, optimizer, batches, criterion=criterion, device=device)
    trainer.privacy_engine = engine
    return trainer


def parameter_count(workload: Workload) -> int:
    return sum(p.numel() for p in workload.model().parameters())
