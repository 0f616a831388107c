"""Small data sets shipped with dpoptim, for the demo, the examples and the docs.

Only one for now: 1797 handwritten digits as 8x8 images (E. Alpaydin and C. Kaynak, UCI
Machine Learning Repository, CC BY 4.0; see ``README.md`` beside this file).

>>> X, y = load_digits()
>>> X.shape, y.shape
(torch.Size([1797, 64]), torch.Size([1797]))
>>> X_train, y_train, X_test, y_test = train_test_split(X, y)
>>> len(y_train), len(y_test)
(1438, 359)
"""

from __future__ import annotations

import functools
import gzip
import random
from importlib import resources

import numpy as np
import torch

__all__ = ["load_digits", "train_test_split"]

_DIGITS_FILE = "digits.csv.gz"


@functools.lru_cache(maxsize=1)
def _digits_array() -> np.ndarray:
    with resources.files(__name__).joinpath(_DIGITS_FILE).open("rb") as raw, gzip.open(raw, "rt") as text:
        data = np.loadtxt(text, delimiter=",", dtype=np.int64)
    if data.shape != (1797, 65):
        raise RuntimeError(f"{_DIGITS_FILE} is damaged: expected 1797 rows of 65 integers, found shape {data.shape}")
    data.setflags(write=False)
    return data


def load_digits(*, images: bool = False, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 handwritten digits: pixels scaled to [0, 1] and labels 0..9.

    Returns ``(X, y)`` with ``X`` of shape ``[1797, 64]`` (or ``[1797, 1, 8, 8]`` with
    ``images=True``, ready for ``nn.Conv2d``) in ``dtype``, and ``y`` of shape ``[1797]``,
    ``torch.long``. Each call returns fresh tensors.
    """
    data = _digits_array()
    X = torch.from_numpy(data[:, :64].astype(np.float64) / 16.0).to(dtype)
    y = torch.from_numpy(data[:, 64].copy())
    if images:
        X = X.reshape(-1, 1, 8, 8)
    return X, y


def train_test_split(
    X: torch.Tensor, y: torch.Tensor, test_fraction: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed, stratified split: ``(X_train, y_train, X_test, y_test)``.

    From each class, ``round(test_fraction * count)`` examples go to the test set, chosen
    by a seeded shuffle that does not depend on torch's random number generator, so the
    same ``seed`` gives the same split on every machine and torch version. Both parts keep
    the original order of the examples.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if len(X) != len(y):
        raise ValueError(f"X and y must have the same length, got {len(X)} and {len(y)}")
    labels = y.tolist()
    by_class: dict = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    shuffle = random.Random(seed).shuffle
    test = []
    for label in sorted(by_class):
        members = by_class[label]
        shuffle(members)
        test.extend(members[: round(test_fraction * len(members))])
    is_test = torch.zeros(len(labels), dtype=torch.bool)
    is_test[torch.tensor(test, dtype=torch.long)] = True
    return X[~is_test], y[~is_test], X[is_test], y[is_test]
