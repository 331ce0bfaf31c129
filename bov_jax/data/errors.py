"""The one exception type of the data layer."""


class DataError(ValueError):
    """A data input is unusable. The message names the file or config key and the problem."""
