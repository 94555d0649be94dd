"""The one error type for bad user input: the CLI prints it on one line and exits 2."""


class UsageError(Exception):
    """Bad input from the user (matrix, TOML, variant, parameter, results folder)."""
