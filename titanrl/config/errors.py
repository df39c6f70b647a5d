"""The one exception the config system raises for user mistakes."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing config problem: unknown key, wrong type, failed validation, unreadable file.

    ``str(err)`` is the complete message, starting with ``config error:``; entry points print it
    as is (no traceback) and exit with status 2. Bugs in the schema itself raise ``TypeError``
    instead, so they are never mistaken for a user error.
    """

    def __init__(self, message: str):
        if not message.startswith("config error:"):
            message = f"config error: {message}"
        super().__init__(message)
