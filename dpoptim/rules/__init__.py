"""Built-in rules, one file per layer family. Importing this package registers them."""

from . import linear  # noqa: F401
