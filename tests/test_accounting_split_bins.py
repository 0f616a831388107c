"""The split's bins (accounting/rare.py): coarser than the spread asks where they settle it.

The spread test sizes the bulk's bins for how far connect-the-dots spreads it, not for
what that moves epsilon. Where a rare tail step decides epsilon, bins much coarser give
the same answer; :func:`rare._settled_coarser` composes the split on the coarsest bins the
scale allows and on twice them, and keeps their answer only where the two agree. These
tests hold that answer to the one on the asked bins, and check that it is refused where
the spread does move epsilon, where rounding decides, and where the bulks are small.
Where the split is sized anew for its answer, :func:`rare._settled_across` first tries
bins half as wide as the scale above composed, against that scale's answer: held to
the asked bins' answer too, and not tried where the asked bins may not fit.
"""

import math
import threading

import pytest

from dpoptim.accounting import pld, rare


@pytest.fixture(autouse=True)
def one_after_the_other(monkeypatch):
    """The order in which the bins are tried, as these tests follow it: on an idle core the
    pair above is found ahead beside the first pair (see the tests at the end)."""
    monkeypatch.setattr(pld, "_core_idle", lambda: False)


def schedule(sigmas, rates, runs, steps):
    """``runs`` runs of ``steps`` steps, sigma linear and q geometric between the ends."""
    return tuple((sigmas[0] + (sigmas[1] - sigmas[0]) * t / (runs - 1),
                  math.exp(math.log(rates[0]) + (math.log(rates[1]) - math.log(rates[0])) * t / (runs - 1)), steps)
                 for t in range(runs))


def split(steps, delta, guess, coarser: bool):
    """Removal's split, with or without the coarser bins, and what they answered."""
    answers = []
    settled = rare._settled_coarser

    def spy(*args):
        answers.append(settled(*args))
        return answers[-1]
    original = rare._settled_coarser, rare._COARSER_RATIO
    rare._settled_coarser, rare._COARSER_RATIO = spy, (rare._COARSER_RATIO if coarser else math.inf)
    rare._split_epsilon.cache_clear()
    try:
        return rare.split_epsilon(steps, "remove", delta, guess), answers
    finally:
        rare._settled_coarser, rare._COARSER_RATIO = original
        rare._split_epsilon.cache_clear()


@pytest.mark.parametrize("runs, steps, delta, settles", [
    (10, 100, 3.6e-7, True),  # a tail step decides: within 2.3e-4 of each other, 7e-5 of the asked
    (20, 1000, 3.6e-7, False),  # the spread moves epsilon: the two coarser answers differ by 1.2%
])
def test_coarser_bins_answer_only_where_they_settle_the_split(monkeypatch, runs, steps, delta, settles):
    # (small ledgers, so that the asked bins are quick too: the size gate is lifted)
    monkeypatch.setattr(rare, "_COARSER_BINS", 0)
    ledger = schedule((0.734, 4.91), (4.1e-6, 1e-6), runs, steps)
    asked, _ = split(ledger, delta, 1e-3, coarser=False)
    found, answers = split(ledger, delta, 1e-3, coarser=True)
    assert asked is not None and not asked[1] and not found[1]
    assert any(answer is not None for answer in answers) == settles
    if settles:
        assert found[0] != asked[0] and abs(found[0] - asked[0]) <= 2.0**-10 * asked[0]
    else:
        assert found == asked


def fake_split_on(answers: dict, calls: list):
    def split_on(steps, direction, delta, h, *args, **kwargs):
        calls.append(h)
        return answers[h]
    return split_on


def test_coarser_bins_take_the_smaller_answer_and_leave_them_for_the_finer_spacings(monkeypatch):
    calls, tried = [], {}
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: rare._COARSER_BINS)
    monkeypatch.setattr(rare, "_split_on", fake_split_on({2.0: (1.0 + 2.0**-13, False, None),
                                                          1.0: (1.0, False, None)}, calls))
    found = rare._settled_coarser((), "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                  (2**19, None, False), tried)
    assert found == (1.0, False, None) and calls == [2.0, 1.0] and set(tried) == {2.0, 1.0}


@pytest.mark.parametrize("answers, why", [
    ({2.0: (1.0 + 2.0**-11, False, None), 1.0: (1.0, False, None)}, "doubling the bins raised it by 2^-11"),
    ({2.0: (1.0, False, None), 1.0: (1.0, True, None)}, "rounding decides on the finer bins"),
    ({2.0: (1.0, True, None), 1.0: (1.0, False, None)}, "rounding decides on the coarser bins"),
    ({2.0: rare._TOO_WIDE, 1.0: (1.0, False, None)}, "a window too wide"),
    ({2.0: None, 1.0: (1.0, False, None)}, "no bulk left"),
])
def test_coarser_bins_that_do_not_settle_it_answer_nothing(monkeypatch, answers, why):
    calls = []
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: rare._COARSER_BINS)
    monkeypatch.setattr(rare, "_split_on", fake_split_on(answers, calls))
    assert rare._settled_coarser((), "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                 (2**19, None, False), {}) is None, why


@pytest.mark.parametrize("widest, asked, points, none", [
    (2**18 - 1, 0.25, 2**19, False),  # bulks too small for the coarser bins to be quicker
    (2**18, 0.5, 2**19, False),  # only twice coarser than asked
    (2**20, 0.25, 2**19, False),  # the caller would compose at 0.5 (the asked bins do not fit)
])
def test_coarser_bins_are_not_tried_where_they_save_little(monkeypatch, widest, asked, points, none):
    calls = []
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: widest)
    monkeypatch.setattr(rare, "_split_on", fake_split_on({}, calls))
    assert rare._settled_coarser((), "remove", 1e-6, (asked, 1.0), (None, 0.5), 64.0, None,
                                 (points, None, none), {}) is None
    assert calls == []


def test_where_the_caller_answers_none_for_bins_too_wide_coarser_ones_are_still_tried(monkeypatch):
    # The asked bins (2^20 wide) do not fit 2^19 points, and this caller answers None
    # then: the coarser bins, four times coarser than asked, may still settle it.
    calls = []
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: 2**20)
    monkeypatch.setattr(rare, "_split_on", fake_split_on({2.0: (1.0, False, None), 1.0: (1.0, False, None)}, calls))
    assert rare._settled_coarser((), "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                 (2**19, None, True), {}) == (1.0, False, None)


def test_unsettled_coarser_answers_are_kept_aside_not_answered(monkeypatch):
    # The coarser bins disagree (2^-9 apart: not settled) and the asked ones do not fit:
    # the strict split answers None, as before, and hands the smaller of the two sound
    # answers to a caller that asks for it (``coarser``); one that rounding decides is not
    # taken.
    calls = []
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: 2**20)
    monkeypatch.setattr(rare, "split_ends", lambda *args: (None, 0.5, -1e-3, 4.0))
    monkeypatch.setattr(rare, "_bulk_spacing", lambda *args: 2.0**-30)
    answers = {2.0**-16: (1e-4 * (1.0 + 2.0**-9), False, None), 2.0**-17: (1e-4, False, None)}  # scale 2^-7

    def split_on(steps, direction, delta, h, *args, **kwargs):
        calls.append(h)
        return answers.get(h, rare._TOO_WIDE)
    monkeypatch.setattr(rare, "_split_on", split_on)
    steps = ((0.35, 2.7e-6, 12431),)
    rare._split_epsilon.cache_clear()
    try:
        coarser = {}
        assert rare.split_epsilon(steps, "remove", 3.2e-3, 0.5 * 2.0**-6, False, 2**19, strict=True,
                                  coarser=coarser) is None
        assert coarser == {"remove": 1e-4} and calls[:2] == [2.0**-16, 2.0**-17]
        rare._split_epsilon.cache_clear()
        answers[2.0**-17] = (0.9e-4, True, None)
        coarser = {}
        assert rare.split_epsilon(steps, "remove", 3.2e-3, 0.5 * 2.0**-6, False, 2**19, strict=True,
                                  coarser=coarser) is None
        assert coarser == {"remove": 1e-4 * (1.0 + 2.0**-9)}
    finally:
        rare._split_epsilon.cache_clear()


@pytest.mark.parametrize("coarsest, settles", [
    ((1.0 + 2.0**-13, False, None), True),  # within 2^-12 of the pair's finer answer: settled
    ((1.0 + 2.0**-10, False, None), False),  # doubling the bins raised it by 2^-10
    ((1.0, True, None), False),  # rounding decides on the coarsest bins
])
def test_where_the_finer_coarse_bins_do_not_fit_the_next_coarser_pair_is_compared(monkeypatch, coarsest, settles):
    # One run whose bins 1.0 need too many points: 4.0 against 2.0 settles it, or nothing
    # does (the asked bins then answer, or the caller's grids); nothing coarser is tried.
    # Over several runs the pair is not tried: the grids answer (there the split's answer
    # lay 0.46% above theirs on 50 one-step pairs).
    answers = {2.0: (1.0 + 2.0**-14, False, None), 1.0: rare._TOO_WIDE, 4.0: coarsest}
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: rare._COARSER_BINS)
    for steps in (((0.31, 5.8e-6, 263),), ((0.31, 5.8e-6, 263), (0.32, 5.8e-6, 263))):
        calls, tried = [], {}
        monkeypatch.setattr(rare, "_split_on", fake_split_on(answers, calls))
        found = rare._settled_coarser(steps, "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                      (2**19, None, False), tried)
        one = len(steps) == 1
        assert found == ((1.0 + 2.0**-14, False, None) if settles and one else None)
        assert calls == ([2.0, 1.0, 4.0] if one else [2.0, 1.0]) and set(tried) == set(calls)


@pytest.mark.parametrize("answers", [
    {2.0: (1.0 + 2.0**-13, False, None), 1.0: (1.0, False, None)},  # settled
    {2.0: (1.0 + 2.0**-11, False, None), 1.0: (1.0, False, None)},  # not settled
    {2.0: (1.0, True, None), 1.0: (1.0, False, None)},  # rounding decides on the coarser bins
    {2.0: rare._TOO_WIDE, 1.0: rare._TOO_WIDE},  # no coarser answer at all
    {2.0: None, 1.0: (1.0, False, None)},  # no bulk left
    {2.0: (1.0 + 2.0**-14, False, None), 1.0: rare._TOO_WIDE, 4.0: (1.0 + 2.0**-13, False, None)},  # the pair above
    {2.0: (1.0 + 2.0**-14, False, None), 1.0: rare._TOO_WIDE, 4.0: (1.0, True, None)},
])
@pytest.mark.parametrize("runs", [1, 2])
def test_bins_found_ahead_on_an_idle_core_give_what_one_after_the_other_gives(monkeypatch, answers, runs):
    # For one run, the bins above the pair (asked for where the finer of the pair does not
    # fit) are split on the accounting thread while this one splits the pair. What is
    # answered, and what the caller is handed as tried, are those of the bins tried one
    # after the other: found ahead and not asked for, they are left out of both.
    steps = ((0.31, 5.8e-6, 263), (0.32, 5.8e-6, 263))[:runs]
    answers = {4.0: (1.0 + 2.0**-12, False, None), **answers}
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: rare._COARSER_BINS)
    results = []
    for idle in (False, True):
        monkeypatch.setattr(pld, "_core_idle", lambda idle=idle: idle)
        calls, threads, tried = [], set(), {}
        split_on = fake_split_on(answers, calls)
        monkeypatch.setattr(rare, "_split_on", lambda *args, **kwargs: threads.add(
            threading.current_thread().name) or split_on(*args, **kwargs))
        found = rare._settled_coarser(steps, "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                      (2**19, None, False), tried)
        results.append((found, tried))
        assert any(name.startswith("dpoptim-accounting") for name in threads) == (idle and runs == 1)
        assert pld._sides_running[0] == 0
    assert results[1] == results[0]


def test_no_bins_are_found_ahead_where_the_first_surely_does_not_fit(monkeypatch):
    # Its bulk spans more bins than the window holds: the first answers at once that it
    # does not fit, and nothing else is asked for.
    monkeypatch.setattr(pld, "_core_idle", lambda: True)
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: 2**20)
    calls = []
    monkeypatch.setattr(rare, "_split_on", fake_split_on({2.0: rare._TOO_WIDE}, calls))
    assert rare._settled_coarser(((0.31, 5.8e-6, 263),), "remove", 1e-6, (0.25, 1.0), (None, 0.5), 64.0, None,
                                 (2**19, None, True), {}) is None
    assert calls == [2.0]


@pytest.mark.parametrize("answer, guess, again", [
    (0.3, 0.9, True),  # below 0.5, the power of two 0.9 was sized by
    (0.5, 0.9, False),
    (0.0, 0.9, False),  # a sound 0 needs no other grid
    (math.inf, math.inf, False),  # no split answers an infinite guess (beside the grid: its answer)
    (0.3, math.inf, False),
])
def test_a_split_is_sized_anew_only_below_the_power_of_two_of_its_guess(answer, guess, again):
    assert rare.sized_again(answer, guess) is again


# --- across scales: bins half as wide as the scale above's (rare._settled_across) ---


def tiny_q_pairs(pairs: int) -> tuple:
    """One step per pair, sigma 1.2 down to 0.6 while q falls from 1e-4 to 1e-5."""
    return tuple((1.2 - 0.6 * t / (pairs - 1), 1e-4 * 0.1 ** (t / (pairs - 1)), 1) for t in range(pairs))


@pytest.mark.parametrize("pairs, delta", [(12, 1e-5), (20, 3e-6), (40, 1e-5)])
def test_the_scale_aboves_bins_halved_answer_where_they_settle_it(monkeypatch, pairs, delta):
    # A rare tail step decides: removal is sized anew for its answer, and the spread asks
    # for bins 4 to 16 times finer than the scale above composed. Bins half as wide as the
    # scale above's settle it, within 2^-11 of the asked bins' answer; those are never
    # composed.
    ledger, composed = tiny_q_pairs(pairs), []
    split_on = rare._split_on
    monkeypatch.setattr(rare, "_split_on",
                        lambda *args, **kwargs: composed.append(args[3]) or split_on(*args, **kwargs))

    def removal():
        composed.clear()
        rare._split_epsilon.cache_clear()
        return rare.split_epsilon(ledger, "remove", delta, 1.0, strict=True, points=2**17), min(composed)

    across, finest_across = removal()
    monkeypatch.setattr(rare, "_ACROSS_RISE", -math.inf)  # never settled: the asked bins answer
    asked, finest_asked = removal()
    rare._split_epsilon.cache_clear()
    assert across[0] != asked[0] and abs(across[0] - asked[0]) <= 2.0**-11 * asked[0]
    assert not across[1] and not asked[1]
    assert 2.0 * finest_asked <= finest_across <= 8.0 * finest_asked


def across(answers: dict, calls: list, monkeypatch, window=((None, 0.5), 2**16 * 0.25, 2.0), prior=1.0 + 2.0**-12,
           widest=2**16, asked=0.25):
    """:func:`rare._settled_across` with the asked bins ``asked``, the scale above's
    ``window`` (its bins 2) and answer ``prior``, on 2^17 points, each bulk ``widest``
    asked bins wide; ``answers``: the split's, by bins."""
    monkeypatch.setattr(rare, "_widest_bulk", lambda *args: widest)
    monkeypatch.setattr(rare, "_split_on", fake_split_on(answers, calls))
    return rare._settled_across((), "remove", 1e-6, (asked, 64.0), (None, 0.5), 64.0, None,
                                (2**17, window, prior), {})


def test_the_scale_aboves_bins_halved_settle_it_within_the_rise(monkeypatch):
    calls = []
    assert across({1.0: (1.0, False, None)}, calls, monkeypatch) == (1.0, False, None)
    assert calls == [1.0]
    assert across({1.0: (1.0, False, None)}, calls, monkeypatch, prior=0.9) == (1.0, False, None)  # (fell: kept)


@pytest.mark.parametrize("answer, why", [
    ((1.0 - 2.0**-10, False, None), "the scale above lay 2^-10 above them"),
    ((1.0, True, None), "rounding decides"),
    (rare._TOO_WIDE, "a window too wide"),
    (None, "no bulk left"),
])
def test_the_scale_aboves_bins_halved_that_do_not_settle_it_answer_nothing(monkeypatch, answer, why):
    calls = []
    assert across({1.0: answer}, calls, monkeypatch) is None, why
    assert calls == [1.0]


@pytest.mark.parametrize("change, why", [
    ({"prior": None}, "no scale above"),
    ({"window": None}, "no scale above"),
    ({"asked": 1.0}, "the halved bins are the asked ones"),
    ({"asked": 0.0625}, "16 times the asked ones: they would not settle it"),
    ({"window": ((None, 0.6), 2**16 * 0.25, 2.0)}, "another bulk"),
    ({"window": ((None, 0.5), 0.0, 2.0)}, "on two scales: no window to size the asked bins by"),
    ({"window": ((None, 0.5), 2**17 * 0.25 / 1.2, 2.0)}, "the asked bins may not fit the window"),
    ({"widest": 2**17 + 1}, "a bulk wider than the window at the asked bins"),
])
def test_the_scale_aboves_bins_halved_are_not_tried_where_the_asked_may_not_fit(monkeypatch, change, why):
    # Where the asked bins do not fit, the caller answers None and the grids answer,
    # which can be tighter than any split on coarser bins.
    calls = []
    assert across({1.0: (1.0, False, None)}, calls, monkeypatch, **change) is None, why
    assert calls == [], why
