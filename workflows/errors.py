"""Errors a user can fix: the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    """Bad input (config, URI, model name, data): the message says what and where."""
