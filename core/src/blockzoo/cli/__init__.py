"""The `blockzoo` command. A bad input ends with a one-paragraph message and exit code 2, never a traceback
(unless `--traceback` or BLOCKZOO_TRACEBACK=1); an error raised in a plugin's layer names the plugin and the
layer's path. Imports stay light: `blockzoo plugins` must answer without loading torch.

This module is the entry point, its errors, and the parser each group of commands adds to (one module per group:
`plugins`, `runs`, `checkpoints`, and `blockzoo.data.cli`)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import typing
from collections.abc import Sequence

from blockzoo.config import ConfigError
from blockzoo.errors import UsageError
from blockzoo.plugins import PluginError

__all__ = ["USAGE_ERROR", "UsageError", "main"]

USAGE_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    arguments, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may also follow the options (`blockzoo evaluate RUN --tasks T distributed.x=1`): argparse
    # takes positionals only before them.
    if extra and getattr(arguments, "overrides_anywhere", False) and all(_is_override(item) for item in extra):
        arguments.overrides = [*arguments.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    show_traceback = arguments.traceback or os.environ.get("BLOCKZOO_TRACEBACK", "") not in ("", "0")
    try:
        return arguments.run(arguments)
    except (ConfigError, PluginError, UsageError) as error:
        if show_traceback:
            traceback.print_exc()
        print(f"blockzoo: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        from blockzoo.layer_errors import locate_layer_failure

        failure = locate_layer_failure(error)
        if failure is None:  # the engine's own error: its traceback is the report
            raise
        if show_traceback:
            traceback.print_exc()
        hint = "" if show_traceback else " (--traceback or BLOCKZOO_TRACEBACK=1 shows the traceback)"
        print(f"blockzoo: error: {failure.message()}{hint}", file=sys.stderr)
        return USAGE_ERROR


def _is_override(argument: str) -> bool:
    return "=" in argument and not argument.startswith("-")


class _Parser(argparse.ArgumentParser):
    """argparse, its errors in the CLI's one-line form (`blockzoo: error: ...`, exit 2) instead of the usage text."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(USAGE_ERROR, f"blockzoo: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    from blockzoo.cli import checkpoints, plugins, runs
    from blockzoo.data.cli import register_data_command

    parser = _Parser(prog="blockzoo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traceback", "--debug", action="store_true", help="show the traceback of an error (or BLOCKZOO_TRACEBACK=1)"
    )
    parser.add_argument(
        "--version", action="store_true", help="print the versions of blockzoo and of every installed plugin"
    )
    parser.set_defaults(
        run=lambda arguments: plugins.version() if arguments.version else parser.print_help() or USAGE_ERROR
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    plugins.register(commands)  # plugins, models
    runs.register(commands)  # init, train, config, plot
    checkpoints.register(commands)  # generate, evaluate, convert
    register_data_command(commands)  # prepare, data
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
