"""dpoptim: differentially private PyTorch optimizers.

Swap ``torch.optim.SGD`` for :class:`dpoptim.DPSGD` (or :class:`DPAdam`,
:class:`DPRMSProp`, or ``make_private(AnyOptimizer)``), set ``noise_multiplier`` and
``max_grad_norm``, train as before, and ask ``optimizer.privacy_spent()``.
"""

from . import data, rules  # noqa: F401  (rules registers the built-in layer rules)
from .batchnorm import replace_batchnorm
from .check import CheckResult, check
from .errors import PrivacyBudgetExceeded, PrivacyWarning, UnsupportedLayerError
from .optimizer import DPAdam, DPOptimizerMixin, DPRMSProp, DPSGD, PrivacySpent, make_private
from .registry import Rule, Use, register_rule, registered_rules, rule_for

__version__ = "0.1.0"

__all__ = [
    "DPSGD",
    "DPAdam",
    "DPRMSProp",
    "DPOptimizerMixin",
    "make_private",
    "PrivacySpent",
    "PrivacyBudgetExceeded",
    "PrivacyWarning",
    "UnsupportedLayerError",
    "Rule",
    "Use",
    "register_rule",
    "registered_rules",
    "rule_for",
    "replace_batchnorm",
    "check",
    "CheckResult",
]
