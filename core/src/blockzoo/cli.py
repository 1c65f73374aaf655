"""The `blockzoo` command. A bad input ends with a one-paragraph message and exit code 2, never a traceback
(unless `--traceback` or BLOCKZOO_TRACEBACK=1); an error raised in a plugin's layer names the plugin and the
layer's path.. Imports stay light: `blockzoo plugins` must answer without loading torch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
import typing
from collections.abc import Sequence

from blockzoo.config import ConfigError, structure
from blockzoo.errors import UsageError
from blockzoo.plugins import PLUGIN_API, PluginError, PluginRecord, Registry, get_registry, strict_mode, undeclared_core

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
    parser = _Parser(prog="blockzoo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traceback", "--debug", action="store_true", help="show the traceback of an error (or BLOCKZOO_TRACEBACK=1)"
    )
    parser.add_argument(
        "--version", action="store_true", help="print the versions of blockzoo and of every installed plugin"
    )
    parser.set_defaults(run=lambda arguments: _version() if arguments.version else parser.print_help() or USAGE_ERROR)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list the installed plugins and the types they provide")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("--check", action="store_true", help="also build every type and check the environment")
    plugins.add_argument("--verbose", action="store_true", help="the traceback of each plugin that failed to load")
    plugins.set_defaults(run=_plugins)

    models = commands.add_parser("models", help="list the named architectures (presets) the installed plugins ship")
    shown = models.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="machine-readable output")
    shown.add_argument("--markdown", action="store_true", help="the catalogue as docs/models.md holds it")
    models.set_defaults(run=_models)

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

    generate = commands.add_parser("generate", help="continue a prompt with a trained model")
    generate.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint, or a run's output_dir (its latest)")
    generate.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for several)")
    generate.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    generate.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K likeliest tokens")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    generate.set_defaults(run=_generate)

    evaluate = commands.add_parser(
        "evaluate",
        help="score a checkpoint on benchmark tasks (lm-evaluation-harness: blockzoo-lm-eval), in one process or "
        "every rank under torchrun",
    )
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN", help="a checkpoint, or a run's output_dir")
    evaluate.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the layout under torchrun, as `blockzoo train` takes it: distributed.tensor_parallel=2, "
        "distributed.compute_dtype=bf16, ...",
    )
    evaluate.add_argument("--tasks", required=True, help="task names, comma-separated")
    evaluate.add_argument("--limit", type=float, metavar="N", help="documents per task (below 1: a fraction)")
    evaluate.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples (default: each task's)")
    evaluate.add_argument("--batch-size", type=int, metavar="B", help="requests per forward pass (default: 16)")
    evaluate.add_argument(
        "--include-path", action="append", default=[], metavar="DIR", help="a directory of task YAML files (repeat)"
    )
    evaluate.add_argument("--output", default="evaluation.json", help="the results JSON (default: evaluation.json)")
    evaluate.add_argument("--benchmark", default="lm_eval", help="the benchmark type (default: lm_eval)")
    evaluate.set_defaults(run=_evaluate, overrides_anywhere=True)

    convert = commands.add_parser(
        "convert", help="convert a checkpoint between blockzoo and another format (e.g. Hugging Face), streaming"
    )
    convert.add_argument("source", metavar="SRC", help="a checkpoint: blockzoo (or a run's output_dir), Hugging Face")
    convert.add_argument("destination", metavar="DST", help="a new (or empty) directory")
    convert.add_argument(
        "--format", help="the format to write: llama, mistral, ... (see `blockzoo plugins`); default: blockzoo"
    )
    convert.add_argument("--dtype", help="the tensors' dtype in an exported checkpoint: float32, bfloat16, float16")
    convert.add_argument(
        "--no-fsync",
        action="store_true",
        help="an export to another format returns with its files in the page cache, unsynced (as transformers' "
        "save_pretrained leaves them): about twice as fast on a slow disk, lost if the machine crashes first",
    )
    convert.add_argument(
        "--merged",
        action="store_true",
        help="a PEFT fine-tuning (LoRA) written natively as the model without PEFT, its adapters merged into the "
        "weights (exports to another format always merge)",
    )
    convert.add_argument(
        "--adapters",
        action="store_true",
        help="a PEFT fine-tuning's adapters alone, in the --format's adapter files (Hugging Face PEFT: "
        "adapter_config.json + adapter_model.safetensors), for the base model exported to that format",
    )
    convert.set_defaults(run=_convert)

    plot = commands.add_parser("plot", help="draw the loss curves (or another metric) of runs to a PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="a run's output_dir (its metrics.jsonl)")
    plot.add_argument("-o", "--output", default="loss.png", help="the PNG to write (default: loss.png)")
    plot.add_argument(
        "--metric", default="loss", help="a key of metrics.jsonl (default: loss, with the evaluation loss dashed)"
    )
    plot.set_defaults(run=_plot)

    from blockzoo.data.cli import register_data_command

    register_data_command(commands)

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
    return parser


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo init


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


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo train, blockzoo generate


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


def _generate(arguments: argparse.Namespace) -> int:
    import torch

    from blockzoo.model.factory import load
    from blockzoo.model.tokenizer import model_tokenizer

    if arguments.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {arguments.max_new_tokens}")
    if arguments.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {arguments.temperature}")
    model = load(arguments.checkpoint)
    tokenizer, stop_tokens = model_tokenizer(model, checkpoint=arguments.checkpoint, purpose="encode the prompt")
    prompts = [tokenizer.encode(prompt) for prompt in arguments.prompt]
    generator = torch.Generator().manual_seed(arguments.seed)
    outputs = model.generate(
        prompts,
        arguments.max_new_tokens,
        temperature=arguments.temperature,
        top_k=arguments.top_k,
        generator=generator,
        stop_token=stop_tokens,
    )
    for prompt, output in zip(arguments.prompt, outputs):
        print(prompt + tokenizer.decode(output))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo evaluate


def _evaluate(arguments: argparse.Namespace) -> int:
    from blockzoo.benchmarks.base import BenchmarkConfig
    from blockzoo.config import parse_overrides
    from blockzoo.distributed.config import DistributedConfig

    options = {"type": arguments.benchmark, "tasks": [task.strip() for task in arguments.tasks.split(",")]}
    given = {
        "limit": arguments.limit,
        "num_fewshot": arguments.num_fewshot,
        "batch_size": arguments.batch_size,
        "task_paths": arguments.include_path or None,
    }
    options |= {key: value for key, value in given.items() if value is not None}
    config = structure(options, BenchmarkConfig, source="blockzoo evaluate's options")
    overrides = parse_overrides(arguments.overrides)
    if other := sorted(set(overrides) - {"distributed"}):
        raise UsageError(f"blockzoo evaluate takes distributed.* overrides only, got {', '.join(other)}")
    layout = structure(overrides.get("distributed", {}), DistributedConfig, source="command line", root="distributed")
    from blockzoo.benchmarks.run import build_benchmark, check_layout, evaluate_model, results_table, write_report
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.model.factory import load
    from blockzoo.model.tokenizer import model_tokenizer

    check_layout(layout, "blockzoo evaluate")
    with Distributed(layout) as distributed:
        benchmark = build_benchmark(config)  # unknown tasks are refused before the model is read
        model = load(arguments.checkpoint, distributed=distributed)
        tokenizer, stop = model_tokenizer(model, checkpoint=arguments.checkpoint, purpose="run benchmarks")
        result = evaluate_model(benchmark, model, tokenizer, distributed, stop_tokens=stop)
        if distributed.rank == 0:
            print(results_table(result.metrics))
            print(f"wrote {write_report(arguments.output, result)}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo convert


def _convert(arguments: argparse.Namespace) -> int:
    from blockzoo.model.factory import convert

    options = {} if arguments.dtype is None else {"dtype": arguments.dtype}
    if arguments.no_fsync:
        if arguments.format in (None, "blockzoo"):
            raise UsageError(
                "--no-fsync applies to exports to another format (--format): blockzoo checkpoints are "
                "always synced before they are renamed into place"
            )
        options["durable"] = False
    if arguments.adapters:
        from blockzoo.model.factory import export_adapters

        if arguments.merged or options:
            raise UsageError("--adapters writes the adapters alone: --merged, --dtype and --no-fsync do not apply")
        destination = export_adapters(arguments.source, arguments.destination, format=arguments.format)
        print(f"wrote {destination} ({arguments.format} adapters)")
        return 0
    destination = convert(
        arguments.source, arguments.destination, format=arguments.format, merged=arguments.merged, **options
    )
    print(f"wrote {destination} ({arguments.format or 'blockzoo'})")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo plot


def _plot(arguments: argparse.Namespace) -> int:
    from blockzoo.plot import plot_runs

    print(f"wrote {plot_runs(arguments.runs, arguments.output, arguments.metric)}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo config


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


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo plugins, blockzoo --version


def _version() -> int:
    """`blockzoo 0.1.0`, then each plugin's distribution and version (the ones that did not load say so)."""
    from blockzoo import __version__

    print(f"blockzoo {__version__}")
    for record in get_registry(strict=False).plugins.values():
        if record.distribution and record.name != "blockzoo":
            status = "" if record.status == "loaded" else f" ({record.status})"
            print(f"{record.distribution} {record.version} (plugin {record.name!r}){status}")
    return 0


def _models(arguments: argparse.Namespace) -> int:
    from blockzoo import preset_catalogue

    found = preset_catalogue.rows()
    if arguments.json:
        print(json.dumps(found, indent=2))
    elif arguments.markdown:
        print(preset_catalogue.markdown(found), end="")
    else:
        print(preset_catalogue.table(found))
    return 0


def _plugins(arguments: argparse.Namespace) -> int:
    from blockzoo import __version__

    registry = get_registry(strict=False)
    checks = {}
    if arguments.check:
        checks = {name: _check_plugin(registry, r) for name, r in registry.plugins.items() if r.status == "loaded"}
    problems = registry.problems()
    if arguments.json:
        report = {
            "blockzoo": __version__,
            "plugin_api": f"{PLUGIN_API[0]}.{PLUGIN_API[1]}",
            "plugins": [
                record.to_dict() | _conversions(registry, record) | ({"check": checks[name]} if name in checks else {})
                for name, record in registry.plugins.items()
            ],
            "problems": problems,
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"blockzoo {__version__}, plugin API {PLUGIN_API[0]}.{PLUGIN_API[1]}")
        for name, record in registry.plugins.items():
            _print_record(registry, record, checks.get(name), verbose=arguments.verbose)
    failed_checks = any(checks.values())
    if problems and strict_mode():
        print("blockzoo: error: plugins did not load and BLOCKZOO_STRICT_PLUGINS is set", file=sys.stderr)
        return 1
    return 1 if failed_checks else 0


def _conversions(registry: Registry, record: PluginRecord) -> dict[str, list[str]]:
    """The checkpoint formats the plugin provides, and those it contributes sections to (for its own types)."""
    from blockzoo.conversion import CheckpointFormat

    entries = [entry for entry in registry.converters if entry.plugin is record]
    kinds = {
        "formats": [entry.format for entry in entries if isinstance(entry.section, CheckpointFormat)],
        "sections_for": sorted({entry.format for entry in entries if not isinstance(entry.section, CheckpointFormat)}),
    }
    return {kind: names for kind, names in kinds.items() if names}


def _print_record(registry: Registry, record: PluginRecord, check: list[str] | None, *, verbose: bool) -> None:
    version = f"{record.distribution} {record.version}" if record.distribution else "(not installed)"
    print(f"\n{record.name}  [{record.status}]  {version}")
    if record.location:
        print(f"  location: {record.location}")
    if record.error:
        print(f"  error: {record.error}")
        if record.traceback and verbose:
            print("    " + record.traceback.rstrip().replace("\n", "\n    "))
    if record.info is not None:
        print(f"  plugin API: {record.info.api_version[0]}.{record.info.api_version[1]}")
        if record.info.capabilities:
            print(f"  capabilities: {', '.join(record.info.capabilities)}")
    for kind, names in record.types.items():
        print(f"  {kind}: {', '.join(names)}")
    for kind, names in _conversions(registry, record).items():
        print(f"  {kind.replace('_', ' ')}: {', '.join(names)}")
    for conflict in registry.conflict_lines(record):
        print(f"  conflict: {conflict}")
    if check is not None:
        print("  check: ok" if not check else "\n".join(f"  check: {problem}" for problem in check))


# Containers whose defaults are made of other plugins' types: their default config is not required to build.
_CONTAINER_KINDS = ("block", "block_sequence")


def _check_plugin(registry: Registry, record: PluginRecord) -> list[str]:
    """Build every type of a loaded plugin (default config + implementation) and run `check_environment`."""
    problems = []
    for entry in registry.entries():
        if entry.plugin is not record:
            continue
        label = f"{entry.kind} {entry.name!r}"
        try:
            if entry.kind not in _CONTAINER_KINDS and not _has_required_fields(entry.config_class):
                structure({}, entry.config_class)
        except ConfigError as error:
            problems.append(f"{label}: its default config does not build: {error}")
        try:
            entry.load_implementation()
        except Exception as error:  # noqa: BLE001 - reported, not raised
            problems.append(
                f"{label}: implementation {entry.implementation} does not import: {type(error).__name__}: {error}"
            )
    try:
        problems.extend(registry.check_environment(record))
    except Exception as error:  # noqa: BLE001
        problems.append(f"check_environment raised {type(error).__name__}: {error}")
    if problem := undeclared_core(record):
        problems.append(problem)
    modules = {record.module.__name__} | {e.config_class.__module__ for e in registry.entries() if e.plugin is record}
    problems += [
        f"importing {module} imports torch: a plugin's config and hook modules must not (blockzoo config and "
        "blockzoo plugins load them without torch); import torch in the layer's module"
        for module in sorted(modules)
        if _imports_torch(module)
    ]
    return problems


def _has_required_fields(config_class: type) -> bool:
    """Whether a config has fields without a default (a benchmark's tasks): it has no default config to build."""
    import attrs

    return any(field.default is attrs.NOTHING for field in attrs.fields(config_class))


def _imports_torch(module: str) -> bool:
    """Whether importing `module` in a fresh interpreter imports torch (this process may have imported it already)."""
    probe = f"import importlib, sys; importlib.import_module({module!r}); sys.exit(10 if 'torch' in sys.modules else 0)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode == 10


if __name__ == "__main__":
    raise SystemExit(main())
