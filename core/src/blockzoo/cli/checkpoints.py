"""`blockzoo generate`, `blockzoo evaluate` and `blockzoo convert`: what is done with a trained checkpoint."""

from __future__ import annotations

import argparse

from blockzoo.config import structure
from blockzoo.errors import UsageError


def register(commands: argparse._SubParsersAction) -> None:
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
    from blockzoo.benchmarks.run import build_benchmark, evaluate_model, results_table, write_report
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.model.factory import load
    from blockzoo.model.tokenizer import model_tokenizer

    with Distributed(layout) as distributed:
        benchmark = build_benchmark(config)  # unknown tasks are refused before the model is read
        model = load(arguments.checkpoint, distributed=distributed)
        if layout.pipeline_parallel > 1:  # this rank's stages, run through the pipeline
            from blockzoo.distributed.pipeline import Pipeline

            Pipeline(model, distributed)
        tokenizer, stop = model_tokenizer(model, checkpoint=arguments.checkpoint, purpose="run benchmarks")
        result = evaluate_model(benchmark, model, tokenizer, distributed, stop_tokens=stop)
        if distributed.rank == 0:
            print(results_table(result.metrics))
            print(f"wrote {write_report(arguments.output, result)}")
    return 0


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
