"""The privacy a DP optimizer has spent: its ledger of steps, ``privacy_spent()``, the
budget stop (``max_epsilon``) and checkpoints that carry the ledger and never lower it."""

from __future__ import annotations

import warnings
from typing import NamedTuple

from .errors import PrivacyBudgetExceeded, PrivacyWarning

__all__ = ["PrivacySpent", "SpendingMixin"]


class PrivacySpent(NamedTuple):
    epsilon: float
    delta: float


#: The budget stop asks how many more steps fit up to this many (and asks again once they
#: are taken): a search far beyond the steps a run takes can last minutes
#: (:func:`~dpoptim.accounting.max_steps`), where whether these fit takes one evaluation.
BUDGET_HORIZON = 2**20


#: Where ``(sigma, q)`` changes at every step, the budget stop asks whether a span of steps
#: fits at a setting this share worse than the current one (sigma this much lower, q this
#: much higher), against a budget this share lower, and takes the steps that setting
#: dominates without asking again (:meth:`SpendingMixin._budget_answer`).
SCHEDULE_MARGIN = 2.0**-6

#: How many steps at the worse setting of :data:`SCHEDULE_MARGIN` the budget stop first
#: asks about (one evaluation); then twice as many as the last worse setting served, up to
#: :data:`BUDGET_HORIZON`.
SCHEDULE_SPAN = 64

#: Where a step leaves the worse setting of :data:`SCHEDULE_MARGIN` after fewer steps than
#: this (a schedule that moves faster than the margin), the budget stop evaluates each
#: step instead: a question at a worse setting would serve too few steps to pay for itself.
SCHEDULE_SERVED = 8


class _BudgetAnswer(NamedTuple):
    """What the budget stop last computed: steps up to ``limit`` fit at ``settings``."""

    settings: tuple  # (sigma, q, delta, max_epsilon, accountant)
    limit: int
    computed_at: int  # steps taken when it was computed
    ask_again: bool  # only checked up to ``limit`` (the next step, or the horizon): ask again there
    dominating: bool = False  # settings a worse step than the ones it covers (see covers)
    near: bool = False  # no span at a worse setting fits: each step is evaluated from here on
    fast: bool = False  # a worse setting served too few steps: each changed step is evaluated

    def covers(self, key: tuple) -> bool:
        """Whether a step at ``key`` (as ``settings``) is one this answer counts: the same
        settings, or, for a ``dominating`` answer, sigma at least and q at most its own."""
        if key == self.settings:
            return True
        sigma, q, *rest = key
        return self.dominating and tuple(rest) == self.settings[2:] and sigma >= self.settings[0] \
            and q <= self.settings[1]


class SpendingMixin:
    """Ledger, accounting and checkpoints of a DP optimizer. The optimizer sets
    ``self._composed`` (a :class:`dpoptim.accounting.Ledger`), ``self._latest``,
    ``self._budget_cache``, ``self._reported`` and its privacy settings."""

    def _record(self, sigma: float, q: float) -> None:
        """One more step at ``(sigma, q)``. ``Ledger.compose`` validates its arguments and
        copies the runs, more than a step's book-keeping should cost: steps of the same
        setting are counted here and composed once, when the ledger is read."""
        latest_sigma, latest_q, count = self._latest
        if count and (latest_sigma, latest_q) != (sigma, q):
            self._composed = self._ledger
            count = 0
        self._latest = (sigma, q, count + 1)

    @property
    def _ledger(self):
        """The privacy ledger (a :class:`dpoptim.accounting.Ledger`) of every step taken."""
        sigma, q, count = self._latest
        if count:
            self._composed, self._latest = self._composed.compose(sigma, q, count), (None, None, 0)
        return self._composed

    @_ledger.setter
    def _ledger(self, ledger) -> None:
        """A Ledger, or runs ``(sigma, q, count)`` to build one from (validated)."""
        kind = type(self._composed)
        self._composed = ledger if isinstance(ledger, kind) else kind(ledger)
        self._latest = (None, None, 0)

    @property
    def ledger(self) -> tuple[tuple[float, float, int], ...]:
        """The steps taken, as runs ``(noise_multiplier, sample_rate, count)`` (plain tuples:
        they load with ``torch.load(weights_only=True)``), consecutive identical steps merged."""
        return tuple(tuple(run) for run in self._ledger.runs)

    @property
    def steps_taken(self) -> int:
        return self._ledger.steps

    def privacy_spent(self, delta: float | None = None, accountant: str | None = None) -> PrivacySpent:
        """``(epsilon, delta)`` spent so far: the Poisson-subsampled Gaussian mechanism
        composed over the ledger. ``delta`` defaults to the constructor's.

        Never below what an earlier call reported at the same ``delta`` and accountant
        for steps this ledger begins with: the accountant chooses its grid and groups per
        ledger, and one more step can lower its bound slightly (a few parts in 10^4 at
        most as measured, ``docs/accounting.md``). Composing more steps never lowers the
        exact epsilon, so the earlier bound holds for this ledger too, and the larger of
        the two is reported."""
        delta = self.delta if delta is None else float(delta)
        if self.dataset_size is not None and delta >= 1 / self.dataset_size:
            warnings.warn(
                f"delta={delta} is not below 1/dataset_size={1 / self.dataset_size:.3g}",
                PrivacyWarning,
                stacklevel=2,
            )
        from . import accounting

        name = accountant or self.accountant
        ledger = self._ledger
        eps = float(accounting.epsilon_of_ledger(ledger, delta, accountant=name))
        earlier = self._reported.get((delta, name))
        if earlier is not None and _starts_with(ledger, earlier[0]):
            eps = max(eps, earlier[1])
        self._reported[delta, name] = (ledger, eps)
        return PrivacySpent(eps, delta)

    def _check_budget(self, sigma: float, q: float) -> None:
        """Raise before a step that would exceed ``max_epsilon``.

        The number of steps the budget allows at (sigma, q) is computed once per change of
        settings (:func:`~dpoptim.accounting.max_steps`, a search, up to
        :data:`BUDGET_HORIZON` steps at a time), not per step; where the settings change
        at every step, once per many steps (:meth:`_budget_answer`). A step is refused
        only by an answer computed at its own settings.
        """
        if self.max_epsilon is None:
            return
        key = (sigma, q, self.delta, self.max_epsilon, self.accountant)
        cache = self._budget_cache
        taken = self.steps_taken
        if cache is None or not cache.covers(key) or (cache.ask_again and taken >= cache.limit):
            cache = self._budget_cache = self._budget_answer(key, cache, taken)
        if taken >= cache.limit:
            raise PrivacyBudgetExceeded(
                f"one more step at noise_multiplier={sigma}, sample_rate={q} would spend more than "
                f"max_epsilon={self.max_epsilon} at delta={self.delta} "
                f"(spent so far over {self.steps_taken} steps: {self.privacy_spent().epsilon:.4g})"
            )

    def _budget_answer(self, key: tuple, cache: _BudgetAnswer | None, taken: int) -> _BudgetAnswer:
        """The budget stop's answer for a step at ``key`` after ``taken`` steps (``cache``:
        the previous answer).

        Where the settings changed within the last :data:`SCHEDULE_SERVED` steps too (a
        schedule that changes at every step, or every few), a search at the step's own
        settings would serve those few steps. The accountant is asked instead whether a
        span of steps fits at a *worse* setting, sigma :data:`SCHEDULE_MARGIN` lower and q
        that much higher, against a budget that much lower (:data:`SCHEDULE_SPAN` steps,
        then twice what the last worse setting served; where they do not fit, a quarter as
        many, one evaluation each). Every later
        step at least as noisy and at most as likely to sample an example is a
        post-processing of such a step (the argument of
        :func:`~dpoptim.accounting.coarsen_runs`), so the ledger with it is dominated by
        one the accountant puts within the budget, and it is taken without asking. A step
        that leaves that setting asks again. Once fewer than :data:`SCHEDULE_SERVED` steps
        fit so (the budget's last share), each step from then on, and where a worse setting
        served fewer, each step that changes the setting, is decided by one evaluation of
        the ledger with it, as a search would decide it: no step is refused that fits (a
        new budget, delta or accountant starts afresh)."""
        from . import accounting

        sigma, q, delta, budget, name = key
        if cache is not None and cache.settings[2:] != key[2:]:
            cache = None
        changed = cache is not None and cache.settings != key and (
            cache.dominating or taken - cache.computed_at < SCHEDULE_SERVED)
        if not (changed or (cache is not None and cache.near)):
            allowed = accounting.max_steps(sigma, q, delta, budget, ledger=self.ledger, accountant=name,
                                           limit=BUDGET_HORIZON)
            return _BudgetAnswer(key, taken + allowed, taken, allowed >= BUDGET_HORIZON)
        fast = cache.fast or (cache.dominating and taken - cache.computed_at < SCHEDULE_SERVED)
        if not (cache.near or fast):
            worse = (sigma * (1.0 - SCHEDULE_MARGIN), min(q * (1.0 + SCHEDULE_MARGIN), 1.0))
            lower, ledger = budget * (1.0 - SCHEDULE_MARGIN), self.ledger
            span = min(max(SCHEDULE_SPAN, 2 * (taken - cache.computed_at) if cache.dominating else 0),
                       BUDGET_HORIZON)
            while span >= SCHEDULE_SERVED:
                if accounting.epsilon_of_ledger([*ledger, (*worse, span)], delta, accountant=name) <= lower:
                    return _BudgetAnswer((*worse, delta, budget, name), taken + span, taken, True, dominating=True)
                span //= 4
        fits = accounting.epsilon_of_ledger([*self.ledger, (sigma, q, 1)], delta, accountant=name) <= budget
        return _BudgetAnswer(key, taken + int(fits), taken, True, near=not fast, fast=fast)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["dpoptim"] = {
            "ledger": [list(run) for run in self._ledger.runs],
            "steps_taken": self.steps_taken,
            "expected_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "max_epsilon": self.max_epsilon,
            "delta": self.delta,
            # Only a generator the user chose is saved: restoring a default one would let
            # anyone holding the checkpoint predict the noise of later steps.
            "generator": None if self._user_generator is None else self._user_generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict, *, ledger: str | None = None) -> None:
        """Resume from :meth:`state_dict`, never lowering the privacy charged.

        The torch state (moments, step counts, the parameter groups with their
        ``noise_multiplier`` and ``max_grad_norm``) and a saved user generator come from the
        checkpoint. ``sample_rate``, ``expected_batch_size``, ``delta`` and ``max_epsilon``
        stay the constructor's, which describe how this run samples and what it may spend;
        a :class:`PrivacyWarning` names any the checkpoint had otherwise.

        The ledger: the checkpoint's when it continues this optimizer's (a fresh optimizer
        resuming), this optimizer's when it already contains the checkpoint's (rolling back
        to an earlier checkpoint of this run: the steps since were taken and stay charged).
        Ledgers that neither contains are refused unless ``ledger`` says what to do:
        ``'both'`` charges both (a sound upper bound), ``'checkpoint'`` replaces this
        optimizer's steps by the checkpoint's (only if nothing computed in those steps is
        ever released).
        """
        if ledger not in (None, "both", "checkpoint"):
            raise ValueError(f"ledger must be None, 'both' or 'checkpoint', got {ledger!r}")
        state_dict = dict(state_dict)
        dp = state_dict.pop("dpoptim", None)
        if dp is None:
            raise ValueError(
                "this state_dict has no 'dpoptim' entry (privacy ledger): it was not saved by a "
                "dpoptim optimizer, and resuming from it would under-report epsilon"
            )
        try:
            saved = type(self._ledger)(dp["ledger"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"this state_dict's privacy ledger is corrupted: {exc}") from None
        if "steps_taken" in dp and dp["steps_taken"] != saved.steps:
            raise ValueError("this state_dict's privacy ledger does not add up to its step count: it is corrupted")
        merged = _merge_ledgers(self._ledger, saved, ledger)
        super().load_state_dict(state_dict)
        self._ledger = merged
        self._budget_cache = None
        differ = [
            f"{name}={dp[name]} in the checkpoint, {getattr(self, name)} now"
            for name in ("sample_rate", "expected_batch_size", "delta", "max_epsilon")
            if name in dp and dp[name] != getattr(self, name)
        ]
        if differ:
            warnings.warn(
                "resuming with the constructor's privacy settings, not the checkpoint's ("
                + "; ".join(differ) + "): steps already taken stay charged at the rate they were taken "
                "with. Pass the checkpoint's values to the constructor to keep them.",
                PrivacyWarning,
                stacklevel=2,
            )
        if dp.get("generator") is not None and self._user_generator is not None:
            self._user_generator.set_state(dp["generator"])


def _merge_ledgers(current, saved, how: str | None):
    """The ledger after loading ``saved`` into an optimizer holding ``current`` (both
    :class:`dpoptim.accounting.Ledger`; see :meth:`DPOptimizerMixin.load_state_dict`)."""
    if how == "checkpoint" or _starts_with(saved, current):
        return saved
    if _starts_with(current, saved):
        return current
    if how == "both":
        return type(current)(current.runs + saved.runs)
    raise ValueError(
        f"this optimizer has taken {current.steps} steps that the checkpoint's ledger "
        f"({saved.steps} steps) does not contain, and loading it would lower the privacy "
        "charged. Load checkpoints into a freshly built optimizer, or pass ledger='both' to "
        "charge both histories (ledger='checkpoint' replaces this optimizer's steps: only if "
        "nothing computed in them is ever released)."
    )


def _starts_with(ledger, prefix) -> bool:
    """Whether the steps of ``ledger`` begin with the steps of ``prefix`` (both ledgers:
    adjacent identical runs merged, empty runs dropped)."""
    a, b = ledger.runs, prefix.runs
    if not b:
        return True
    if len(b) > len(a) or a[: len(b) - 1] != b[:-1]:
        return False
    last, there = b[-1], a[len(b) - 1]
    return last[:2] == there[:2] and last.count <= there.count
