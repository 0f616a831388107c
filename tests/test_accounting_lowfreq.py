"""Low-frequency transforms of narrow distributions (``dpoptim.accounting.lowfreq``).

Every value is judged against the full transform computed independently: an rfft of the
masses placed on the whole circle, in extended precision where the platform has it.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dpoptim.accounting import lowfreq
from dpoptim.accounting import pld as pld_module
from dpoptim.accounting.pld import pld_epsilon

DEAD = 800.0


def full_transform(first: int, masses: np.ndarray, n: int) -> np.ndarray:
    """The whole half-spectrum of ``masses`` placed at ``first`` modulo ``n``, in long double."""
    import scipy.fft  # (numpy's transforms round to float64)

    placed = np.zeros(n, dtype=np.longdouble)
    np.add.at(placed, (first + np.arange(masses.size)) % n, masses.astype(np.longdouble))
    return scipy.fft.rfft(placed)


def random_rows(draw, n: int, count: int) -> list:
    rows = []
    for _ in range(count):
        size = draw(st.integers(1, min(n - 1, 3000)))
        shape = draw(st.sampled_from(["bump", "spiky", "flat"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        j = np.arange(size)
        if shape == "bump":
            centre, width = rng.uniform(0, size), rng.uniform(0.5, size / 4 + 1)
            masses = np.exp(-0.5 * ((j - centre) / width) ** 2) + 1e-12 * rng.random(size)
        elif shape == "spiky":
            masses = rng.random(size) ** 8
        else:
            masses = np.ones(size)
        rows.append((draw(st.integers(-3 * n, 3 * n)), masses / masses.sum()))
    return rows


def step_rows(n: int, spacing: float, pairs, direction: str) -> list:
    """Tilted one-step distributions of subsampled Gaussians, as the accountant builds them."""
    rows = []
    for sigma, q in pairs:
        first, masses, p_inf, _ = pld_module._tilted(
            *pld_module._step_distribution(sigma, q, direction, spacing, -n // 4, n // 2), spacing, 0.5)
        rows.append((first, masses))
    return rows


@settings(max_examples=40, deadline=None)
@given(data=st.data(), log_n=st.integers(12, 17), size=st.integers(1, 700))
def test_the_direct_transform_is_within_its_error_bound(data, log_n, size):
    n = 2**log_n
    size = min(size, n // 2 + 1)
    rows = random_rows(data.draw, n, data.draw(st.integers(1, 5)))
    spectra, error = lowfreq.low_transform(rows, n, size)
    assert spectra.shape == (len(rows), size)
    for row, (first, masses) in enumerate(rows):
        exact = full_transform(first, masses, n)[:size]
        worst = float(np.max(np.abs(spectra[row].astype(np.clongdouble) - exact)))
        assert worst <= error, (worst, error)
    assert error < 1e-12


def test_rows_in_chunks_give_the_same_transforms(monkeypatch):
    n = 2**15
    rows = step_rows(n, 2.0**-9, [(0.8, 0.02), (1.5, 0.002), (3.0, 0.3), (1.0, 0.1), (2.0, 0.05)], "add")
    whole = lowfreq.low_transform(rows, n, 200)
    monkeypatch.setattr(lowfreq, "_CHUNK_POINTS", 1)  # one row at a time
    parts = lowfreq.low_transform(rows, n, 200)
    assert np.array_equal(whole[0], parts[0]) and whole[1] == parts[1]


def test_the_error_bound_is_not_vacuous():
    # It is a few hundred unit round-offs, and the measured error well inside it: a bound
    # a thousand times smaller fails somewhere on these rows.
    n = 2**16
    rows = step_rows(n, 2.0**-10, [(0.8, 0.02), (1.5, 0.002), (3.0, 0.3)], "remove")
    spectra, error = lowfreq.low_transform(rows, n, 300)
    worst = max(float(np.max(np.abs(spectra[r].astype(np.clongdouble) - full_transform(*row, n)[:300])))
                for r, row in enumerate(rows))
    assert worst <= error < 1e-12
    assert worst > error / 1e4


@settings(max_examples=30, deadline=None)
@given(data=st.data(), log_n=st.integers(14, 17), counts=st.lists(st.integers(2, 10**6), min_size=1, max_size=4))
def test_sampled_bounds_hold_at_every_frequency(data, log_n, counts):
    n = 2**log_n
    rows = random_rows(data.draw, n, len(counts) + 1)
    groups = [(index, index + 1) for index in range(len(counts))]
    bounds = lowfreq.sampled_bounds(rows, groups, counts, n, DEAD)
    if bounds is None:
        return
    moduli = np.array([np.abs(full_transform(*row, n)).astype(float) for row in rows])
    for group, count, bound in zip(groups, counts, bounds):
        worst = moduli[list(group)].max(axis=0)
        # Dead from ``end`` on, and ``at(k)`` bounds everything from k on.
        assert np.all(count * np.log(np.maximum(worst[bound.end:], 1e-300)) <= -DEAD + 1e-9)
        suffix = np.maximum.accumulate(worst[::-1])[::-1]
        for k in np.unique(np.linspace(0, n // 2, 97).astype(int)):
            assert suffix[k] <= bound.at(int(k)) + 1e-15, (k, suffix[k], bound.at(int(k)))


def test_sampled_bounds_need_their_slack(monkeypatch):
    # Two atoms far apart: the modulus oscillates faster than the samples, so samples
    # alone miss its peaks. With the slack between samples dropped the check above fails.
    n = 2**16
    masses = np.zeros(1500)
    masses[0] = masses[-1] = 0.5
    rows = [(0, masses)]
    exact = np.abs(full_transform(0, masses, n)).astype(float)
    bound = lowfreq.sampled_bounds(rows, [(0,)], [10**5], n, DEAD)[0]
    assert all(exact[k:].max() <= bound.at(k) + 1e-15 for k in range(0, n // 2, 997))
    monkeypatch.setattr(lowfreq, "_first_moment", lambda masses: 0.0)
    careless = lowfreq.sampled_bounds(rows, [(0,)], [10**5], n, DEAD)[0]
    assert any(exact[k:].max() > careless.at(k) + 1e-6 for k in range(0, n // 2, 997))


def test_refined_bounds_hold_and_end_at_the_last_live_frequency():
    n = 2**17
    rows = step_rows(n, 2.0**-11, [(0.8, 0.002), (0.8, 0.02), (2.0, 0.002), (2.0, 0.02)], "add")
    count = 70_000
    bound = lowfreq.sampled_bounds(rows, [(0, 1, 2, 3)], [count], n, DEAD)[0]
    spectra, error = lowfreq.low_transform(rows, n, bound.end)
    sharp = lowfreq.refined(bound, spectra, count, DEAD, error)
    worst = np.array([np.abs(full_transform(*row, n)).astype(float) for row in rows]).max(axis=0)
    live = np.flatnonzero(count * np.log(worst) > -DEAD)
    assert sharp.end <= bound.end and sharp.end >= live[-1] + 1
    assert sharp.end <= live[-1] + 2  # within rounding of the exact cut
    suffix = np.maximum.accumulate(worst[::-1])[::-1]
    for k in range(0, n // 2, 251):
        assert suffix[k] <= sharp.at(k) + 1e-15


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([0, 1, 7, 511, 512, 513, 1024, 1500, 4096]), seed=st.integers(0, 2**32 - 1),
       last=st.floats(0.0, 2.0))
def test_the_suffix_maximum_is_the_one_a_full_suffix_array_holds(size, seed, last):
    # Read at every index, block edges and the one past the values (``last`` alone) included.
    values = np.random.default_rng(seed).random(size) * np.exp(-np.arange(size) / 300.0)
    full = np.maximum.accumulate(np.append(values, last)[::-1])[::-1]
    suffix = lowfreq.SuffixMax(values, last)
    assert suffix.size == full.size
    assert [suffix[i] for i in range(full.size)] == full.tolist()
    with pytest.raises(IndexError):
        suffix[full.size]


def test_refined_bounds_of_whole_spectra_stay_sharp_where_the_group_alone_is_not_dead():
    # The route by full FFTs starts from the bound that holds everywhere (1 + 1e-9) and
    # passes the whole half-spectrum. A group of few steps never dies alone; its bounds
    # used to stay that 1 + 1e-9 (the everywhere bound was appended past the last
    # frequency, and the suffix maxima took it), so groups could never be cut together.
    n = 2**14
    rows = step_rows(n, 2.0**-11, [(0.8, 0.01), (1.5, 0.01)], "remove")
    spectra = np.array([full_transform(*row, n) for row in rows]).astype(np.complex128)
    everywhere = lowfreq.DeadBound(n // 2 + 1, np.full(1, 1.0 + 1e-9), n // 2 + 1)
    sharp = lowfreq.refined(everywhere, spectra, 60, DEAD, 0.0)
    assert sharp.end == n // 2 + 1  # 60 steps alone: not dead anywhere
    worst = np.abs(spectra).max(axis=0)
    suffix = np.maximum.accumulate(worst[::-1])[::-1]
    for k in range(0, n // 2, 97):
        assert suffix[k] <= sharp.at(k) <= suffix[k] + 1e-12
    assert sharp.at(n // 8) < 0.999


def test_groups_dead_only_together_are_cut_where_their_product_underflows(monkeypatch):
    # A schedule that changes at every step: about 30 steps per group, none dead alone.
    # Together they are past about a tenth of the frequencies, where the product of all
    # the steps' transforms is exactly zero in float64; mixing every row only up to
    # there gives the same epsilon (it took 2.5 s at 10^4 steps instead of 0.2 to 0.3 s).
    runs = [(1.5 - 0.7 * t / 2000, 0.01, 1) for t in range(2000)]
    cuts, products = [], []
    combined, mixture_product = pld_module._combined_end, pld_module._mixture_product

    def spy_end(deads, counts, n):
        cuts.append((combined(deads, counts, n), min(dead.end for dead in deads)))
        return cuts[-1][0]

    def spy_product(*args):
        products.append(mixture_product(*args)[0])
        return products[-1], mixture_product(*args)[1]

    monkeypatch.setattr(pld_module, "_combined_end", spy_end)
    monkeypatch.setattr(pld_module, "_mixture_product", spy_product)
    together = pld_epsilon(runs, 1e-5)
    assert cuts and all(cut < alone for cut, alone in cuts[-2:])
    cut_products = products[-2:]
    pld_module._noted_pld_epsilon.cache_clear()
    pld_module._prefix_cache.clear()
    monkeypatch.setattr(pld_module, "_combined_end", lambda deads, counts, n: min(dead.end for dead in deads))
    alone = pld_epsilon(runs, 1e-5)
    assert together == pytest.approx(alone, rel=1e-9)
    for cut_product in cut_products:  # (the two directions, in either order)
        cut = np.flatnonzero(cut_product.spectrum)[-1] + 1
        full = [p for p in products[-2:] if np.array_equal(p.spectrum[:cut], cut_product.spectrum[:cut])]
        assert len(full) == 1 and np.all(full[0].spectrum[cut:] == 0.0)


def test_mixture_groups_agree_by_either_route(monkeypatch):
    # The long schedule's groups by block moments (the default here) and by full FFTs:
    # the same epsilon to within the rounding allowances, the moments' a little larger
    # (the brackets of such schedules against rigorous lower bounds are in
    # test_accounting_bounds.py).
    runs = [(0.8 + 1.2 * i / 199, 0.002 * 10 ** (i / 199), 3000) for i in range(200)]
    sizes = []
    transform = lowfreq.low_transform
    monkeypatch.setattr(lowfreq, "low_transform", lambda rows, n, size: sizes.append(size) or transform(rows, n, size))
    direct = pld_epsilon(runs, 1e-5)
    assert sizes, "the direct route was not taken"
    monkeypatch.setattr(lowfreq, "sampled_bounds", lambda *args: None)
    pld_module._noted_pld_epsilon.cache_clear()
    pld_module._prefix_cache.clear()
    full = pld_epsilon(runs, 1e-5)
    assert direct == pytest.approx(full, rel=1e-7)


def test_no_matrix_products_in_the_transforms():
    # OpenBLAS's idle threads spin after a threaded call, taking a core from the other
    # direction's composition: the transforms use FFTs and elementwise sums only.
    import inspect

    source = inspect.getsource(lowfreq)
    assert not any(word in source for word in (" @ ", "np.dot", "matmul", "tensordot"))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.integers(80, 150), steps=st.sampled_from([3000, 4000]), sigma=st.floats(0.7, 1.5),
       rise=st.floats(1.2, 3.0), q=st.floats(1e-3, 1e-2), spread=st.floats(2.0, 20.0),
       delta=st.sampled_from([1e-5, 1e-9]))
@example(runs=92, steps=4000, sigma=0.796875, rise=1.625, q=0.01, spread=20.0, delta=1e-9)
def test_random_schedules_agree_by_either_route(monkeypatch, runs, steps, sigma, rise, q, spread, delta):
    # Schedules raising sigma and q over many runs: whichever route computes the groups'
    # transforms, the same epsilon, up to the moments' larger rounding allowance (about
    # ten times an FFT's per entry: 7e-6 relative at epsilon 650 with delta 1e-9). Every
    # answer that rounding decides is refined: the gate that skips a refinement worth
    # less than 2^-10 of epsilon can fall on either side for the two routes (the example:
    # 1472.247 by the moments, unrefined, against 1471.947 by the FFT).
    monkeypatch.setattr(pld_module, "_REFINE_SHARE", 0.0)
    ledger = [(sigma * rise ** (i / (runs - 1)), q * spread ** (i / (runs - 1)), steps) for i in range(runs)]
    sizes = []
    transform = lowfreq.low_transform
    pld_module._noted_pld_epsilon.cache_clear()
    pld_module._prefix_cache.clear()
    with monkeypatch.context() as patch:
        patch.setattr(lowfreq, "low_transform", lambda rows, n, size: sizes.append(size) or transform(rows, n, size))
        direct = pld_epsilon(ledger, delta)
    with monkeypatch.context() as patch:
        patch.setattr(lowfreq, "sampled_bounds", lambda *args: None)
        pld_module._noted_pld_epsilon.cache_clear()
        pld_module._prefix_cache.clear()
        full = pld_epsilon(ledger, delta)
    assert direct == pytest.approx(full, rel=1e-4)
    if not sizes:  # the moments were not cheaper here: both are the FFT route
        assert direct == full
