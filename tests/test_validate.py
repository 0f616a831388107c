"""One set of validators for the optimizers and the accounting: same rules, errors naming
the argument, and one meaning of noise_multiplier = inf (no privacy loss)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import dpoptim
from dpoptim import validate
from dpoptim.accounting import UNLIMITED_STEPS, RDPAccountant, epsilon, epsilon_of_ledger, max_steps
from dpoptim.accounting.ledger import Ledger


@pytest.mark.parametrize(
    "check, good, bad",
    [
        (validate.noise_multiplier, [0, 0.5, 3, np.float32(2.0), torch.tensor(1.5), math.inf],
         [-1.0, math.nan, True, "1.0", None, torch.ones(2)]),
        (validate.sample_rate, [1e-9, 0.5, 1, np.float64(0.1)], [0, -0.1, 1.0001, math.nan, math.inf, False, "0.1"]),
        (validate.delta, [1e-12, 0.5], [0, 1, math.nan, -1e-5, "1e-5"]),
        (validate.epsilon, [0, 1.0, math.inf], [-1e-9, math.nan, True]),
        (validate.count, [0, 7, 1e4, np.int64(3), 2.0**60], [-1, 1.5, math.nan, math.inf, True, "10"]),
        (validate.max_grad_norm, [1e-6, 1.0], [0, -1, math.inf, math.nan]),
    ],
)
def test_each_validator_accepts_and_refuses_naming_the_argument(check, good, bad):
    for value in good:
        result = check(value, "the_argument")
        assert result == (int(float(value)) if check is validate.count else float(value))
    for value in bad:
        with pytest.raises(ValueError, match=r"^the_argument must be"):
            check(value, "the_argument")


def test_count_and_positive_epsilon_return_canonical_types():
    assert type(validate.count(1e4)) is int and validate.count(1e4) == 10_000
    assert type(validate.noise_multiplier(np.float32(2.0))) is float
    with pytest.raises(ValueError, match="^target_epsilon must be > 0"):
        validate.epsilon(0.0, "target_epsilon", positive=True)


def _make_opt(**overrides):
    kwargs = dict(lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, sample_rate=0.1)
    kwargs.update(overrides)
    return dpoptim.DPSGD(nn.Linear(2, 2).parameters(), **kwargs)


@pytest.mark.parametrize(
    "argument, value",
    [("noise_multiplier", -1.0), ("noise_multiplier", math.nan), ("noise_multiplier", True),
     ("sample_rate", 0.0), ("sample_rate", 1.5), ("sample_rate", "0.1"),
     ("max_grad_norm", 0.0), ("max_grad_norm", math.inf)],
)
def test_optimizer_and_accounting_refuse_the_same_values(argument, value):
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        _make_opt(**{argument: value})
    if argument == "max_grad_norm":
        return  # not an accounting parameter
    run = {"noise_multiplier": 1.0, "sample_rate": 0.1, argument: value}
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        epsilon(run["noise_multiplier"], run["sample_rate"], 10, 1e-5)
    with pytest.raises(ValueError, match=f"^{argument} must be"):
        RDPAccountant().compose(run["noise_multiplier"], run["sample_rate"])


def test_infinite_noise_costs_no_privacy_in_the_accounting():
    assert epsilon(math.inf, 0.5, 10**6, 1e-5) == 0.0
    assert epsilon(math.inf, 0.5, 10**6, 1e-5, accountant="rdp") == 0.0
    spent = [(1.0, 0.01, 1000)]
    with_inf = [*spent, (math.inf, 1.0, 10**9)]
    for accountant in ("pld", "rdp"):
        assert epsilon_of_ledger(with_inf, 1e-5, accountant) == epsilon_of_ledger(spent, 1e-5, accountant)
        assert max_steps(math.inf, 0.3, 1e-5, 10.0, ledger=spent, accountant=accountant) == UNLIMITED_STEPS
    assert Ledger(with_inf).runs[-1].noise_multiplier == math.inf


def test_the_optimizer_refuses_infinite_noise_as_a_setting_and_says_why():
    # It cannot draw it: the step would write inf or nan into every parameter. The
    # meaning is the same as in the accounting (nothing revealed), the message says so.
    with pytest.raises(ValueError, match=r"^noise_multiplier must be finite to take steps.*charges it no privacy"):
        _make_opt(noise_multiplier=math.inf)
    opt = _make_opt()
    with pytest.raises(ValueError, match="^noise_multiplier must be finite"):
        opt.noise_multiplier = math.inf
    assert opt.noise_multiplier == 1.0  # a refused value changes nothing


def test_a_ledger_holding_infinite_noise_is_accounted_as_free_by_the_optimizer():
    opt = _make_opt(noise_multiplier=1.0, sample_rate=0.01)
    opt._ledger = [[1.0, 0.01, 100], [math.inf, 0.01, 10**6]]
    reference = epsilon_of_ledger([(1.0, 0.01, 100)], opt.delta)
    assert opt.privacy_spent().epsilon == reference
