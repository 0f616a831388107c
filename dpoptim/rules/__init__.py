"""Built-in rules, one file per layer family. Importing this package registers them."""

from . import attention  # noqa: F401
from . import conv  # noqa: F401
from . import embedding  # noqa: F401
from . import linear  # noqa: F401
from . import norm  # noqa: F401
from . import rnn  # noqa: F401
from . import lookalike  # noqa: F401  (automatic rules: tried in this order)
from . import bare  # noqa: F401
