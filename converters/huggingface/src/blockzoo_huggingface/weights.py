"""Weights of a Hugging Face format, streamed one tensor at a time.

Loading into a model (`load_weights`): each tensor is read once, from the memory-mapped shards, straight into its
parameter or this rank's shard of it (`blockzoo.loading`): a parameter held whole here in the file's dtype becomes
the mapped tensor itself (no copy), a concatenated one is either a view of its parts (when the file holds them end
to end) or assembled by copying each part into its rows; only computed weights (`ComputedWeights`) are made apart
and copied in.

Converting (`import_checkpoint`): the directory's tensors are read in file order with plain reads, one shard open
at a time; each mapping converts as soon as all its inputs are in and what it makes goes straight to the native
file being written, so memory holds the tensors of the mappings in progress, not the checkpoint. Before anything is
read (either way), the plan is checked against the headers: every tensor claimed (or known to hold nothing), every
claimed tensor present, every parameter made with its shape (the mappings run on meta tensors).

Exporting: the mappings run in order, each reading its parameters (from the model, gathered over the parallel
ranks, or from a native checkpoint file) and writing its tensors into the shard planned for them, shards of at
most `max_shard_size` bytes with transformers' names and index.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

import blockzoo
from blockzoo.api import Distributed, DistributedConfig
from blockzoo.checkpoint import MODEL_FILE, read_checkpoint_config, read_origin
from blockzoo.config import structure
from blockzoo.conversion import Concatenated, ConversionError, Origin, Weight, WeightMapping, read_json
from blockzoo.loading import fill_concatenated, fill_parameter
from blockzoo.model.config import ModelConfig
from blockzoo.run_config import RunConfig
from blockzoo.safetensors_io import SafetensorsReader, SafetensorsWriter
from blockzoo_huggingface import files
from blockzoo_huggingface.files import CONFIG_JSON

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30  # bytes, as transformers 4.x
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HuggingfaceFormat(Protocol):
    """What these functions use of a format (`blockzoo_huggingface.format.HuggingfaceFormat`, whose weight methods
    call them): this module does not import it, so the two make no import cycle."""

    name: str

    def weight_mappings(self, model: ModelConfig) -> list[WeightMapping]: ...

    def ignored_tensor(self, model: ModelConfig) -> re.Pattern: ...

    def read_model_config(self, directory: Path) -> dict[str, Any]: ...

    def origin(self, directory: Path) -> Origin | None: ...

    def export_config(
        self, model: ModelConfig, *, transformers_version: str | None = None, origin: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------------------------------
# Importing


def _import_plan(
    fmt: HuggingfaceFormat, directory: Path, model: ModelConfig, expected: Mapping[str, tuple[int, ...]]
) -> tuple[list[WeightMapping], dict[str, files.TensorInfo]]:
    """The mappings of `model` and the directory's tensors, checked against the headers before anything is read:
    every tensor claimed (or known to hold nothing), every claimed tensor present, every parameter (global shapes
    `expected`) made with its shape."""
    mappings = fmt.weight_mappings(model)
    tensors = files.huggingface_tensors(directory)
    claimed = {name for mapping in mappings for name in mapping.theirs}
    ignored = fmt.ignored_tensor(model)
    if unclaimed := sorted(name for name in tensors if name not in claimed and not ignored.fullmatch(name)):
        raise ConversionError(
            f"{directory}: {_some(unclaimed)} claimed by no section of the {fmt.name} conversion (weights the "
            "blockzoo model would not have)"
        )
    if missing := [name for name in claimed if name not in tensors]:
        raise ConversionError(f"{directory}: {_some(missing)} missing from the checkpoint")
    _check_import_shapes(mappings, tensors, expected, str(directory))
    return mappings, tensors


def stream_import(
    fmt: HuggingfaceFormat, directory: Path, model: ModelConfig, expected: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, global tensor) of every parameter of `model` (whose global shapes are `expected`), read
    with plain file reads in file order (a conversion holds the mappings in progress, not the checkpoint)."""
    mappings, tensors = _import_plan(fmt, directory, model, expected)
    by_tensor = {name: mapping for mapping in mappings for name in mapping.theirs}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in files.read_in_file_order(tensors, set(by_tensor)):
        mapping = by_tensor[name]
        inputs = pending.setdefault(id(mapping), {})
        inputs[name] = tensor
        if len(inputs) == len(mapping.theirs):
            del pending[id(mapping)]
            yield from zip(mapping.ours, mapping.import_tensors([inputs[n] for n in mapping.theirs]))


def load_weights(fmt: HuggingfaceFormat, directory: Path, model: Any, distributed: Any) -> None:
    """Fill the model's parameters (this rank's shards of them) from the directory, each tensor read once from the
    mapped shards (see the module)."""
    parameters = dict(model.named_parameters())
    expected = {name: tuple(parameter.meta.global_shape) for name, parameter in parameters.items()}
    if distributed.config.pipeline_parallel > 1:  # a pipeline stage holds some of the model's parameters
        expected = parameter_shapes(model.config)
    mappings, tensors = _import_plan(fmt, directory, model.config, expected)
    with files.MappedTensors(tensors) as mapped, torch.no_grad():
        for mapping in mappings:
            if not any(name in parameters for name in mapping.ours):
                continue  # another pipeline stage's
            if isinstance(mapping, Weight):
                fill_parameter(parameters[mapping.ours[0]], mapped.get(mapping.theirs[0]), distributed, adopt=True)
            elif isinstance(mapping, Concatenated):
                run = None if mapping.transposed else mapped.run(mapping.theirs)
                parts = [mapped.get(name) for name in mapping.theirs]
                fill_concatenated(
                    parameters[mapping.ours[0]], parts, distributed, transposed=mapping.transposed, run=run
                )
            else:  # computed: made apart, then copied in (its outputs may share memory with each other)
                outputs = mapping.import_tensors([mapped.get(name) for name in mapping.theirs])
                for name, tensor in zip(mapping.ours, outputs):
                    if name in parameters:
                        fill_parameter(parameters[name], tensor, distributed, adopt=False)


def import_checkpoint(fmt: HuggingfaceFormat, source: Path, destination: Path) -> Path:
    """The directory as a native checkpoint, written without building the model."""
    model = structure(fmt.read_model_config(source), ModelConfig, source=str(source / CONFIG_JSON))
    run_config = RunConfig(model=model)
    expected = parameter_shapes(model)
    layout = {name: (torch.float32, shape) for name, shape in expected.items()}
    with (
        files.new_native_checkpoint(
            destination, run_config, source=f"{fmt.name} {source}", origin=fmt.origin(source)
        ) as weights_path,
        SafetensorsWriter(weights_path, layout) as writer,
    ):
        for name, tensor in stream_import(fmt, source, model, expected):
            writer.write(name, tensor)
    return destination


def parameter_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and global shape, from the model built on the meta device (no memory, no init)."""
    distributed = Distributed(DistributedConfig(), world_size=1, rank=0)
    distributed.device = torch.device("meta")
    built = blockzoo.build(RunConfig(model=model), distributed=distributed)
    return {name: tuple(parameter.meta.global_shape) for name, parameter in built.named_parameters()}


def _check_import_shapes(
    mappings: Sequence[WeightMapping],
    tensors: Mapping[str, files.TensorInfo],
    expected: Mapping[str, tuple[int, ...]],
    where: str,
) -> None:
    made = {name for mapping in mappings for name in mapping.ours}
    if missing := sorted(set(expected) - made):
        raise ConversionError(f"{where}: parameter {_some(missing)} made by no mapping (a section misses it)")
    if extra := sorted(made - set(expected)):
        raise ConversionError(f"{where}: mappings make {_some(extra)}, which the model does not have (a section bug)")
    for mapping in mappings:
        shapes = {name: list(tensors[name].shape) for name in mapping.theirs}
        inputs = [torch.empty(tensors[name].shape, dtype=tensors[name].dtype, device="meta") for name in mapping.theirs]
        try:
            outputs = mapping.import_tensors(inputs)
        except (RuntimeError, ValueError, ConversionError) as error:
            raise ConversionError(f"{where}: tensors {shapes} do not make {list(mapping.ours)}: {error}") from None
        for name, output in zip(mapping.ours, outputs):
            if tuple(output.shape) != expected[name]:
                raise ConversionError(
                    f"{where}: tensors {shapes} make parameter {name!r} of shape {list(output.shape)}, the model "
                    f"has {list(expected[name])}"
                )


# ---------------------------------------------------------------------------------------------------------------------
# Exporting


def save(
    fmt: HuggingfaceFormat,
    model: Any,
    directory: Path,
    *,
    dtype: str | None = None,
    transformers_version: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    durable: bool = True,
) -> Path:
    """Write `model`; every rank calls it (split parameters are gathered), rank 0 writes."""
    distributed = model.distributed
    parameters = dict(model.named_parameters())

    def read(name: str) -> torch.Tensor:
        parameter = parameters[name]
        return parameter.meta.local_to_global(parameter.detach(), distributed.tensor_group, distributed.data_group)

    shapes = {name: tuple(parameter.meta.global_shape) for name, parameter in parameters.items()}
    options = _export_options(dtype, transformers_version, max_shard_size, durable)
    options["tokenizer"] = _tokenizer_files(getattr(model, "run_config", None), model.origin)
    write(fmt, directory, model.config, shapes, read, writes=distributed.rank == 0, origin=model.origin, **options)
    return directory


def export_checkpoint(
    fmt: HuggingfaceFormat,
    source: Path,
    destination: Path,
    *,
    dtype: str | None = None,
    transformers_version: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    durable: bool = True,
) -> Path:
    """Write the native checkpoint in `source`, reading its weights one tensor at a time."""
    data = read_checkpoint_config(source)
    model = structure(data.get("model", {}), ModelConfig, source=str(source / "config.yaml"), root="model")
    expected = parameter_shapes(model)
    with SafetensorsReader(source / MODEL_FILE) as reader:
        found = {name: reader.shape(name) for name in reader.names}
        if found != expected:
            raise ConversionError(f"{source / MODEL_FILE}: {_difference(found, expected)}")
        options = _export_options(dtype, transformers_version, max_shard_size, durable)
        origin = read_origin(source)
        options["tokenizer"] = _tokenizer_files(structure(data, RunConfig, source=str(source / "config.yaml")), origin)
        write(fmt, destination, model, expected, reader.read, writes=True, origin=origin, **options)
    return destination


def _tokenizer_files(run_config: RunConfig | None, origin: Origin | None) -> dict[str, str]:
    """The tokenizer files to write beside the weights of a model that came with no tokenizer of its own: its
    training data's tokenizer, as Hugging Face files (none when the data has no tokenizer or cannot be read here)."""
    if run_config is None or (origin is not None and "tokenizer.json" in origin.files):
        return {}
    from blockzoo.data.tokenizer import training_data_tokenizer

    tokenizer = training_data_tokenizer(run_config)
    return {} if tokenizer is None else tokenizer.hugging_face_files()


def _export_options(
    dtype: str | None, transformers_version: str | None, max_shard_size: int, durable: bool
) -> dict[str, Any]:
    """`write`'s options from those of `save` and `export_checkpoint`."""
    return {
        "dtype_name": dtype,
        "transformers_version": transformers_version,
        "max_shard_size": max_shard_size,
        "durable": durable,
    }


def write(
    fmt: HuggingfaceFormat,
    destination: Path,
    model: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    *,
    dtype_name: str | None,
    transformers_version: str | None,
    max_shard_size: int,
    durable: bool,
    writes: bool,
    origin: Origin | None,
    tokenizer: Mapping[str, str] | None = None,
) -> None:
    """config.json, then the shards in mapping order, each mapping's tensors in one shard. `read(name)`: a
    parameter's global tensor; `writes`: this process writes (the others only take part in `read`); `origin`: the
    files of the checkpoint the model was imported from, written back (config.json's keys that no field holds);
    `tokenizer`: files (name -> text) of the tokenizer to write when the origin has none;
    `durable`: each shard is fsynced before the directory is renamed into place (else left in the page cache, as
    transformers' `save_pretrained` leaves its files)."""
    # Everything that can refuse is checked first, on every rank, before any rank gathers a tensor.
    files.check_new_directory(destination)
    dtype = _dtype(dtype_name)
    companions = [] if origin is None else [path for path in origin.paths() if path.name != CONFIG_JSON]
    if missing := [path for path in companions if not path.is_file()]:
        raise ConversionError(f"{missing[0]}: gone, but the model's origin files are written with it")
    origin_config = read_json(origin.directory / CONFIG_JSON) if origin and CONFIG_JSON in origin.files else None
    config = fmt.export_config(model, transformers_version=transformers_version, origin=origin_config)
    config["dtype" if "dtype" in config else "torch_dtype"] = next(n for n, d in DTYPES.items() if d == dtype)
    mappings = fmt.weight_mappings(model)
    if missing := sorted(set(shapes) - {name for mapping in mappings for name in mapping.ours}):
        raise ConversionError(f"{_some(missing)} written by no section of the {fmt.name} conversion (a section bug)")
    outputs = [_export_shapes(mapping, shapes) for mapping in mappings]
    sizes = [sum(math.prod(shape) for shape in output.values()) * dtype.itemsize for output in outputs]
    shards = files.plan_shards(list(enumerate(sizes)), max_shard_size)
    names = files.shard_names(len(shards))
    with files.new_directory(destination, write=writes) as directory:
        weight_map: dict[str, str] = {}
        for shard, file_name in zip(shards, names):
            layout = {name: (dtype, shape) for index in shard for name, shape in outputs[index].items()}
            with (
                files.open_writer(directory / file_name, layout, durable=durable)
                if directory
                else contextlib.nullcontext() as writer
            ):
                for index in shard:
                    mapping = mappings[index]
                    tensors = mapping.export_tensors([read(name) for name in mapping.ours])
                    for name, tensor in zip(mapping.theirs, tensors):
                        if writer is not None:
                            writer.write(name, tensor)
                        weight_map[name] = file_name
        if directory is not None:
            if len(shards) > 1:
                files.write_index(directory, weight_map, sum(sizes))
            files.write_json(directory / CONFIG_JSON, config)
            for path in companions:
                shutil.copyfile(path, directory / path.name)
            for name, text in (tokenizer or {}).items():
                (directory / name).write_text(text, encoding="utf-8")


def _export_shapes(mapping: WeightMapping, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    outputs = mapping.export_tensors([torch.empty(shapes[name], device="meta") for name in mapping.ours])
    return {name: tuple(output.shape) for name, output in zip(mapping.theirs, outputs)}


def _dtype(name: str | None) -> torch.dtype:
    if name is None:
        return torch.float32  # blockzoo's parameters
    if name not in DTYPES:
        raise ConversionError(f"unknown dtype {name!r}; choose {', '.join(DTYPES)}")
    return DTYPES[name]


def _some(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(map(repr, names[:limit]))
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{'tensor' if len(names) == 1 else 'tensors'} {shown}{more}"


def _difference(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> str:
    if missing := sorted(set(expected) - set(found)):
        return f"{_some(missing)} missing"
    if extra := sorted(set(found) - set(expected)):
        return f"{_some(extra)} not parameters of the model"
    name = next(name for name in expected if found[name] != expected[name])
    return f"tensor {name!r} has shape {list(found[name])}, the model has {list(expected[name])}"
