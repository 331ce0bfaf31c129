"""The one exception type of the data layer."""

from bov_jax.cli import UserError


class DataError(UserError, ValueError):
    """A data input is unusable. The message names the file or config key and the problem."""
