"""The Gaussian noise: its law and the generators it is drawn from."""

import pytest
import torch
from scipy import stats

from dpoptim.privatize import add_noise_, fresh_generator


@pytest.mark.parametrize("secure", [False, True])
def test_noise_is_standard_normal_with_the_scale_asked_for(secure):
    sums = [torch.zeros(s) for s in [(300, 200), (7,), (1,), (5, 3, 2)]]
    add_noise_(sums, 2.5, 1.0, fresh_generator(), secure)
    flat = torch.cat([s.flatten() for s in sums]).double() / 2.5
    # Kolmogorov-Smirnov against N(0, 1); p below 1e-6 would mean a wrong law.
    assert stats.kstest(flat.numpy(), "norm").pvalue > 1e-6
    assert abs(float(flat.std()) - 1.0) < 0.02


def _words(generator):
    return generator.get_state()[24:24 + 8 * 624].view(torch.int64)


def test_fresh_cpu_generators_get_a_full_random_state_not_a_32_bit_seed():
    """manual_seed keeps 32 bits of a seed, so two of ~10^5 per-step seeds would likely
    coincide; a fresh generator's 624 state words all come from the OS instead."""
    a, b = fresh_generator(), fresh_generator()
    assert (_words(a) != _words(b)).sum() > 600
    assert bool((_words(a) < 2**32).all()) and bool((_words(a) >= 2**31).any())  # 32-bit words
    # The words are what the generator draws from: the same words, the same stream;
    # the seed field alone (all manual_seed would set) does not give it.
    twin = torch.Generator()
    twin.set_state(a.get_state())
    assert torch.equal(torch.randn(100, generator=a), torch.randn(100, generator=twin))
    assert not torch.equal(torch.randn(100, generator=b), torch.randn(100, generator=torch.Generator().manual_seed(b.initial_seed())))


def test_fresh_generators_never_repeat():
    """Secure mode takes a fresh generator at every step: no two may share a stream."""
    firsts = {tuple(torch.randn(4, generator=fresh_generator()).tolist()) for _ in range(5000)}
    assert len(firsts) == 5000


def test_zero_noise_draws_nothing():
    g = fresh_generator()
    before = g.get_state().clone()
    sums = [torch.ones(3)]
    add_noise_(sums, 0.0, 1.0, g)
    assert torch.equal(sums[0], torch.ones(3))
    assert torch.equal(before, g.get_state())
