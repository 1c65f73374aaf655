"""What `blockzoo config` checks beyond the fields: every refusal of `blockzoo train` that needs neither the data
read nor the ranks started, so a config that passes here fails at train time only for those (listed as not
checked).

Checked: the process layout for the number of processes the run will have; the checkpoint format to export to; the
model, built on the meta device (no memory) as one process builds it; the data section (a memmap dataset's path and
metadata, the embedded corpus and random tokens built and a first batch taken of each split the run uses).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from blockzoo.config import ConfigError
from blockzoo.errors import UsageError
from blockzoo.run_config import RunConfig


@attrs.frozen
class Preflight:
    """What `preflight` checked and could not check, in words; the model's parameter count."""

    checked: list[str]
    not_checked: list[str]
    parameters: int | None


def preflight(run_config: RunConfig, *, processes: int = 1) -> Preflight:
    """Run the checks; every problem found is raised at once as a `ConfigError` naming its field."""
    checked: list[str] = []
    not_checked = [
        "that the ranks agree and the backend and devices (when the ranks start)",
        "resuming from the checkpoints in training.output_dir",
        "the memory of the device that trains (`blockzoo train` refuses a model or batches larger than it)",
    ]
    problems: list[tuple[str, str]] = []
    distributed = run_config.distributed
    try:
        data_parallel = distributed.data_parallel(processes)
        checked.append(f"the layout of {processes} process(es): {_mesh_line(distributed, data_parallel)}")
    except ValueError:
        data_parallel = 1
        problems.append(
            (
                "distributed",
                f"this layout needs a multiple of tensor_parallel × sequence_data_parallel × pipeline_parallel = "
                f"{distributed.model_parallel} processes, and the run would have {processes}: launch it with "
                f"`torchrun --nproc-per-node {distributed.model_parallel} -m blockzoo train ...` (check that layout "
                f"with `blockzoo config --processes {distributed.model_parallel}`)",
            )
        )
    if run_config.training.export_format is not None:
        from blockzoo.conversion import get_format

        _run(
            problems,
            "training.export_format",
            lambda: get_format(run_config.training.export_format).check_model_config(run_config.model),
        )
        checked.append(f"the export to {run_config.training.export_format}")
    parameters = _check_model(run_config, problems, checked, not_checked)
    _check_data(run_config, data_parallel, problems, checked, not_checked)
    if problems:
        raise ConfigError(problems)
    return Preflight(checked=checked, not_checked=not_checked, parameters=parameters)


def _run(problems: list[tuple[str, str]], path: str, check) -> object:
    """`check()`, its usage error recorded at `path` (a ConfigError at its own paths)."""
    try:
        return check()
    except ConfigError as error:
        problems.extend(error.errors)
    except UsageError as error:
        problems.append((path, str(error)))
    return None


def model_on_meta_device(run_config: RunConfig):
    """The model as one process builds it (global shapes), on the meta device: no memory, no initialization. A layer
    refusing its config, or a tensor too large to index, is a `ConfigError` at `model`; the ranks' shards are checked
    by the layers' `check_tensor_parallel` when the config is structured."""
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.model.size import meta_model

    alone = attrs.evolve(
        run_config.distributed,
        tensor_parallel=1,
        sequence_data_parallel=1,
        pipeline_parallel=1,
        pipeline_schedule="1f1b",
        pipeline_stages_per_rank=1,
        pipeline_split=None,
        backend="gloo",
    )
    return meta_model(run_config.model, Distributed(alone, world_size=1, rank=0))


def _check_model(run_config: RunConfig, problems, checked: list[str], not_checked: list[str]) -> int | None:
    from blockzoo.model.factory import with_pretrained_config

    if run_config.model.pretrained is not None:
        run_config = _run(
            problems, "model.pretrained", lambda: with_pretrained_config(run_config, run_config.model.pretrained)
        )
        if run_config is None:
            return None
        checked.append("the pretrained checkpoint's config")
        not_checked.append("the pretrained checkpoint's weights (read when the run starts)")
    model = _run(problems, "model", lambda: model_on_meta_device(run_config))
    if model is None:
        return None
    count = sum(parameter.numel() for parameter in model.parameters())
    checked.append(f"the model, built on the meta device: {count:,} parameters ({count * 4 / 2**30:,.2f} GiB in fp32)")
    if run_config.distributed.model_parallel > 1:
        not_checked.append("each rank's part of the model (built when the ranks start)")
    return count


def _check_data(run_config: RunConfig, data_parallel: int, problems, checked: list[str], not_checked: list[str]):
    from blockzoo.plugins import get_registry

    data = run_config.data
    name = get_registry().name_of(type(data))
    if name == "memmap":
        if data.path is None:
            problems.append(
                (
                    "data.path",
                    "the memmap dataset needs a path: the prefix given to `blockzoo prepare "
                    "--output` (e.g. data/tokens)",
                )
            )
            return
        from blockzoo.data.storage import DatasetFiles, read_metadata

        metadata = _run(problems, "data.path", lambda: read_metadata(DatasetFiles(Path(data.path))))
        if metadata is None:
            return
        vocab_size = run_config.model.embeddings.vocab_size
        if metadata["vocab_size"] > vocab_size:
            problems.append(
                (
                    "model.embeddings.vocab_size",
                    f"the data at {data.path} uses {metadata['vocab_size']} token ids, more than the model's "
                    f"vocabulary ({vocab_size}); raise it to at least {metadata['vocab_size']}",
                )
            )
        checked.append(f"the memmap dataset's metadata ({data.path})")
        not_checked.append("the memmap dataset's token and index files (read when training starts)")
        return
    if name not in ("embedded", "random", "blended"):
        not_checked.append(f"the {name} dataset (built when training starts)")
        return
    import torch

    from blockzoo.data.dataset import build_dataset
    from blockzoo.model.size import device_memory

    tokens = data.micro_batch_size * data.sequence_length
    if tokens * 8 > device_memory(torch.device("cpu")) // 4:  # int64 tokens, within a quarter of this machine
        not_checked.append(f"the {name} data (a micro-batch of {tokens} tokens is too large to take one here)")
        return

    def build_and_take_batches() -> None:
        dataset = build_dataset(
            data, seed=run_config.distributed.seed, model_vocab_size=run_config.model.embeddings.vocab_size
        )
        next(dataset.training_batches(rank=0, ranks=data_parallel))
        evaluation = run_config.training.evaluation
        # Data that holds nothing out is not evaluated when validation sets are named (`evaluation_loss/<name>`).
        if evaluation.interval is not None and (dataset.num_evaluation_samples != 0 or not evaluation.datasets):
            next(dataset.evaluation_batches(rank=0, ranks=data_parallel))

    before = len(problems)
    _run(problems, "data", build_and_take_batches)
    if len(problems) == before:
        checked.append(f"the {name} data: built, a first micro-batch of each split the run reads")


def _mesh_line(distributed, data_parallel: int) -> str:
    """Every dimension of the device mesh, in the order ranks are laid out (tensor fastest), e.g.
    `2 tensor-parallel × 2 sequence-data-parallel × 1 data-parallel × 1 pipeline stage`."""
    tensor, sequence, stages = (
        distributed.tensor_parallel,
        distributed.sequence_data_parallel,
        distributed.pipeline_parallel,
    )
    return (
        f"{tensor} tensor-parallel × {sequence} sequence-data-parallel × {data_parallel} data-parallel × "
        f"{stages} pipeline stage{'' if stages == 1 else 's'}"
    )
