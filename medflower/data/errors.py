"""The data layer's error: what a site reads that is missing or malformed."""


class DataError(ValueError):
    """Data that is missing or malformed; the message names the file and the problem."""
