"""Built-in rules, one file per layer family. Importing this package registers them."""

from . import attention  # noqa: F401
from . import conv  # noqa: F401
from . import embedding  # noqa: F401
from . import linear  # noqa: F401
from . import norm  # noqa: F401
from . import rnn  # noqa: F401
