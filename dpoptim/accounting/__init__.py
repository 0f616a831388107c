"""Privacy accounting for DP training with the Poisson-subsampled Gaussian mechanism.

Each training step adds Gaussian noise of standard deviation ``noise_multiplier * C`` to
the sum of clipped per-example gradients of a Poisson-sampled batch (rate
``sample_rate``). A run is recorded as a ledger of ``(noise_multiplier, sample_rate,
count)`` runs, and an accountant turns the ledger into ``(epsilon, delta)``:

* :class:`PLDAccountant` (default, ``'pld'``): privacy loss distributions composed by
  FFT, and the minimum with the other sound bounds (RDP, and a Gaussian mixture that is
  tight for tiny sigma). Never below the exact epsilon, the rounding of its grid masses
  and transforms included (see ``docs/accounting.md``), and within 1% of it except where
  ``docs/accounting.md`` says otherwise, with the measured bracket.
* :class:`RDPAccountant` (``'rdp'``): Rényi DP with the improved conversion. Looser
  (typically 5-15% more epsilon), always sound, very fast.

>>> from dpoptim.accounting import epsilon, calibrate_noise
>>> eps = epsilon(noise_multiplier=1.1, sample_rate=0.004, steps=10_000, delta=1e-5)
>>> sigma = calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=10_000)
"""

from .calibrate import (
    ACCOUNTANTS,
    UNLIMITED_STEPS,
    calibrate_noise,
    epsilon,
    epsilon_of_ledger,
    make_accountant,
    max_steps,
)
from .gaussian import gaussian_delta, gaussian_epsilon
from .ledger import Accountant, Ledger, Run
from .pld import PLDAccountant
from .rdp import DEFAULT_ORDERS, RDPAccountant, epsilon_from_rdp, rdp_subsampled_gaussian

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "DEFAULT_ORDERS",
    "Ledger",
    "PLDAccountant",
    "RDPAccountant",
    "Run",
    "UNLIMITED_STEPS",
    "calibrate_noise",
    "epsilon",
    "epsilon_from_rdp",
    "epsilon_of_ledger",
    "gaussian_delta",
    "gaussian_epsilon",
    "make_accountant",
    "max_steps",
    "rdp_subsampled_gaussian",
]
