"""User-facing errors: one line that names the problem and says what to do.

Anything raised as an `OutriderError` is printed by the CLI as `error: <message>` with a
non-zero exit and no traceback. Library users catch it like any other exception.
"""


class OutriderError(Exception):
    """A problem the user can fix; the message is one line and says how."""


class ConfigError(OutriderError, ValueError):
    """An invalid parameter or an incompatible combination, refused before any work starts."""


class ModelError(OutriderError):
    """A model that is unknown, missing, corrupt or of an unsupported architecture."""
