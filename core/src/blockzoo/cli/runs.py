"""`blockzoo init`, `blockzoo train`, `blockzoo config` and `blockzoo plot`: writing a run config, checking it,
training it, drawing its curves. Heavy modules (torch) are imported only when a command runs."""

from __future__ import annotations

import argparse
import os
import sys

from blockzoo.errors import UsageError


def register(commands: argparse._SubParsersAction) -> None:
    init = commands.add_parser(
        "init", help="write a run config to start from (an installed example, or a preset of `blockzoo models`)"
    )
    init.add_argument("name", metavar="EXAMPLE|PRESET", nargs="?", help="which one (default: demo; --list names them)")
    init.add_argument("-o", "--output", help="the YAML file to write (default: NAME.yaml here)")
    init.add_argument("--force", action="store_true", help="replace --output if it exists")
    init.add_argument("--list", action="store_true", help="list what can be written, and write nothing")
    init.set_defaults(run=_init)

    train = commands.add_parser("train", help="train a model (one process, or every rank under torchrun)")
    # Optional for argparse, required by _train: argparse would name the optional overrides as required too.
    train.add_argument("path", metavar="CONFIG", nargs="?", help="a YAML run config")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. training.train_iters=100")
    train.set_defaults(run=_train)

    config = commands.add_parser(
        "config", help="validate a config and print it resolved; `config schema`: the reference of every config"
    )
    config.add_argument(
        "path", metavar="CONFIG", help="a YAML run config; `schema` prints the config reference (markdown) instead"
    )
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model.hidden_size=512")
    config.add_argument("--explicit", action="store_true", help="print only what the file and overrides set")
    config.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="check the layout for N processes (default: WORLD_SIZE, else 1, as `blockzoo train` alone runs)",
    )
    config.set_defaults(run=_config)

    plot = commands.add_parser("plot", help="draw the loss curves (or another metric) of runs to a PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="a run's output_dir (its metrics.jsonl)")
    plot.add_argument("-o", "--output", default="loss.png", help="the PNG to write (default: loss.png)")
    plot.add_argument(
        "--metric", default="loss", help="a key of metrics.jsonl (default: loss, with the evaluation loss dashed)"
    )
    plot.set_defaults(run=_plot)


def _init(arguments: argparse.Namespace) -> int:
    from pathlib import Path

    from blockzoo.starters import DEFAULT, starters, write

    if arguments.list:
        for starter in starters().values():
            print(f"{starter.name:<16} {starter.description}")
        return 0
    name = arguments.name or DEFAULT
    output = Path(arguments.output or f"{name}.yaml")
    written = write(name, output, force=arguments.force)
    print(
        f"blockzoo: wrote {output} (the {name} {written.origin}); check it: blockzoo config {output}; train it: "
        f"blockzoo train {output}",
        file=sys.stderr,
    )
    return 0


def _train(arguments: argparse.Namespace) -> int:
    from blockzoo.config import load
    from blockzoo.run_config import RunConfig

    if arguments.path is None:
        raise UsageError(
            "blockzoo train needs a run config: blockzoo train CONFIG [KEY=VALUE ...]. To start from an example: "
            "`blockzoo init` writes demo.yaml (`blockzoo init --list`: the others), then `blockzoo train demo.yaml`"
        )
    run_config = load(RunConfig, arguments.path, arguments.overrides)  # before importing torch: bad configs fail fast
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.model.size import check_fits
    from blockzoo.training.trainer import Trainer, TrainingError

    with Distributed(run_config.distributed) as distributed:
        check_fits(run_config, distributed)  # a model or batches too large for this device: refused before allocating
        try:
            Trainer(run_config, distributed=distributed).run()
        except TrainingError as error:  # a non-finite loss, a second stop signal: the last checkpoint is intact
            print(f"blockzoo: error: {error}", file=sys.stderr)
            return error.exit_code
    return 0


def _config(arguments: argparse.Namespace) -> int:
    from blockzoo.config import load, to_yaml
    from blockzoo.run_config import RunConfig

    if arguments.path == "schema":  # (a file named `schema` is ./schema)
        if arguments.overrides or arguments.explicit:
            raise UsageError("`blockzoo config schema` takes no overrides and no --explicit")
        from blockzoo.schema import config_reference

        print(config_reference(), end="")
        return 0

    run_config = load(RunConfig, arguments.path, arguments.overrides)
    processes = arguments.processes if arguments.processes is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if processes < 1:
        raise UsageError(f"--processes must be at least 1, got {processes}")
    from blockzoo.preflight import preflight

    # Beyond the fields: what `blockzoo train` would refuse short of reading the data or starting the ranks.
    report = preflight(run_config, processes=processes)
    print(to_yaml(run_config, explicit_only=arguments.explicit), end="")
    print("blockzoo: checked: " + "; ".join(report.checked), file=sys.stderr)
    if report.parameters is not None:
        from blockzoo.memory import for_layout

        state = for_layout(report.parameters, run_config.distributed, processes)
        print(f"blockzoo: memory (estimate): {state.describe()}", file=sys.stderr)
    print(
        "blockzoo: not checked (needs the data read or the ranks started): " + "; ".join(report.not_checked),
        file=sys.stderr,
    )
    return 0


def _plot(arguments: argparse.Namespace) -> int:
    from blockzoo.plot import plot_runs

    print(f"wrote {plot_runs(arguments.runs, arguments.output, arguments.metric)}")
    return 0
