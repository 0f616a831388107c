"""Exceptions and warnings dpoptim raises. Each message names what is wrong and the fix."""

__all__ = ["PrivacyBudgetExceeded", "UnsupportedLayerError", "PrivacyWarning"]


class PrivacyBudgetExceeded(RuntimeError):
    """The next step would push epsilon past the optimizer's ``max_epsilon``."""


class UnsupportedLayerError(RuntimeError):
    """A parameter received a gradient that dpoptim cannot clip per example."""


class PrivacyWarning(UserWarning):
    """Something that weakens or misstates the privacy guarantee."""
