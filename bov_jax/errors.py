"""The error types every layer raises for mistakes a user can fix.

This module imports nothing of the project, so the lowest layers (data readers, the config
schema, the checkpoint format) can raise these and the command-line boundary
(`bov_jax.cli`) can catch them without either reaching the other.
"""


class UserError(Exception):
    """A mistake the user can fix; its message names the file, key or value and the fix.

    The command-line boundary prints it as one `error: ...` line and exits with
    `exit_status`.
    """

    exit_status = 2


class ConfigError(UserError, ValueError):
    """A config key that is unknown, missing or out of range; the message names the key."""


class DataError(UserError, ValueError):
    """A data input is unusable. The message names the file or config key and the problem."""
