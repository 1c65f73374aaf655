"""Errors that mean bad input from the user (command line, data, checkpoint files), not a bug.

The command line reports them in one paragraph with exit code 2, without a traceback (unless `--traceback`).
Torch-free, so every part of blockzoo can raise them without making the CLI heavy.
"""


class UsageError(Exception):
    """Bad input: the message says what is wrong and where."""


class PluginError(RuntimeError):
    """Plugins could not be loaded as asked (strict mode, bad settings). Also `blockzoo.plugins.PluginError`."""
