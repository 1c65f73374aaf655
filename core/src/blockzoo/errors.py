"""Errors that mean bad input from the user (command line, data, checkpoint files), not a bug.

The command line reports them in one paragraph with exit code 2, without a traceback (unless `--debug`).
Torch-free, so every part of blockzoo can raise them without making the CLI heavy.
"""


class UsageError(Exception):
    """Bad input: the message says what is wrong and where."""
