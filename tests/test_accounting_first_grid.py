"""The mixture groups' first grid (accounting/pld.py): not refined where a finer one follows.

Refining a grid's answers (other tilts, extended precision) only lowers them, and for
mixture groups a lower answer asks for a finer grid still: where the float64 answers of
a large first grid already ask for one, :func:`pld._first_grid` leaves them unrefined
(the finer grid's answers are taken beside them). Elsewhere the first grid is refined as
before, without composing its float64 answers twice.
"""

import math
from types import SimpleNamespace

import pytest

from dpoptim.accounting import pld as pld_module


def first_grid(monkeypatch, fine: bool, mixture=("groups",), n=2**19, ceiling=math.inf, answers=(0.06, 0.05)):
    """:func:`pld._first_grid` on a fake grid and composition: the calls made and the answer."""
    calls = []

    def compose_on(steps, deltas, grid, **kwargs):
        calls.append(kwargs)
        first = {"remove": (answers[0], True), "add": (answers[1], True)}
        if kwargs.get("refine", True) is False:
            return first
        return {"remove": answers[0] * 0.99, "add": answers[1] * 0.99}  # refined: a little lower

    monkeypatch.setattr(pld_module, "_fine_for", lambda *args, **kwargs: fine)
    grid = SimpleNamespace(n=n, spacing=1e-5, tilt=4.0)
    found = pld_module._first_grid((), {"remove": 1e-9, "add": 1e-9}, grid, compose_on,
                                   (mixture, False, ceiling, 1.0, 2**20, 0.0))
    return calls, found


def test_a_first_grid_that_needs_a_finer_one_is_not_refined(monkeypatch):
    calls, found = first_grid(monkeypatch, fine=False)
    assert calls == [{"refine": False}] and found == {"remove": 0.06, "add": 0.05}


def test_a_first_grid_fine_for_its_answers_is_refined_without_composing_them_again(monkeypatch):
    calls, found = first_grid(monkeypatch, fine=True)
    assert calls == [{"refine": False}, {"known": {"remove": (0.06, True), "add": (0.05, True)}}]
    assert found == {"remove": 0.06 * 0.99, "add": 0.05 * 0.99}


@pytest.mark.parametrize("case", [
    dict(mixture=None),  # plain steps: the split of rare.py may settle a direction there
    dict(n=2**18),  # extended precision is quick on small grids, and its answer can make the grid fine
    dict(n=2**20),  # the last grid: nothing finer follows
    dict(ceiling=0.055),  # another bound is reported below the answers: no finer grid follows
])
def test_first_grids_are_refined_as_before_where_no_finer_grid_is_sure_to_follow(monkeypatch, case):
    calls, found = first_grid(monkeypatch, fine=False, **case)
    assert "refine" not in calls[-1] and found == {"remove": 0.06 * 0.99, "add": 0.05 * 0.99}
