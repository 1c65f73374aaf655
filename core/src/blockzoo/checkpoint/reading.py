"""Reading a checkpoint: verifying it whole, and loading its tensors into a model (and optimizer) of any parallel
layout, each rank taking its own shards of every global tensor."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockzoo.checkpoint.checksums import CHECKSUM_ALGORITHM, file_checksum, verify_checksum
from blockzoo.checkpoint.format import (
    CONFIG_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointError,
    global_shape,
    read_yaml,
    saved_parameters,
)
from blockzoo.checkpoint.metadata import read_metadata
from blockzoo.conversion import ConversionError
from blockzoo.distributed.data_parallel import shard_like
from blockzoo.distributed.runtime import Distributed
from blockzoo.loading import fill_parameter
from blockzoo.peft.apply import former_adapter_names
from blockzoo.safetensors_io import SafetensorsReader


def verify_checkpoint(directory: str | Path) -> None:
    """Raise a `CheckpointError` naming the file at fault unless `directory` is a complete checkpoint: its metadata
    valid, every file it lists there and matching its checksum (when recorded), its tensor files readable."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    read_yaml(directory / CONFIG_FILE)
    for file in metadata["files"]:
        verify_checksum(directory / file, metadata)
        if file.endswith(".safetensors"):
            with TensorFile(directory / file, metadata):
                pass


def weights_checksums(directory: str | Path, algorithm: str = CHECKSUM_ALGORITHM) -> dict[str, str]:
    """{weights file: checksum by `algorithm`} of a native checkpoint: the one its metadata records where it records
    one by that algorithm, else computed. A checkpoint holding adapters only is no base for another (it has no base
    weights)."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    if metadata.get("base"):
        raise CheckpointError(
            directory,
            f"holds PEFT adapters only (its base is {metadata['base'].get('path')!r}), so it cannot be the base of "
            "another checkpoint; write the fine-tuned model whole first: blockzoo convert "
            f"{directory} DESTINATION --merged",
        )
    checksums = metadata.get("checksums") or {}
    recorded = checksums.get("files", {}).get(MODEL_FILE) if checksums.get("algorithm") == algorithm else None
    return {MODEL_FILE: recorded or file_checksum(directory / MODEL_FILE, algorithm=algorithm)}


def load_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    distributed: Distributed,
    model_source: str | None = None,
    base_loaded: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a checkpoint: (config data, metadata), and fill `model`'s parameters and `optimizer`'s state in place.

    Every file read is checked against its checksum in the metadata (when recorded) and every tensor's dtype against
    the parameter's. `model_source` names the model for the message of a tensor whose shape it does not expect (e.g.
    "the model of <checkpoint>/config.yaml", "the model of the run config"; default "the model").

    Every rank calls it and takes its own shards (of the tensor-parallel split, the experts' split over the data
    ranks, and the rows of its FSDP shards), reading one global tensor at a time. Nothing is changed unless every
    tensor is there with its shape. Under pipeline parallelism a stage reads the tensors of its own parameters (the
    others belong to other stages).

    A checkpoint holding adapters only (its metadata has `base`) fills the adapters; the caller must have loaded
    the base weights (`blockzoo.model.factory.load_base`) and pass `base_loaded`.
    """
    directory = Path(directory)
    metadata = read_metadata(directory)
    config = read_yaml(directory / CONFIG_FILE)
    if optimizer is not None and model is None:
        raise ValueError("load_checkpoint: loading optimizer state needs the model (its parameter names)")
    if optimizer is not None and OPTIMIZER_FILE not in metadata["files"]:
        raise CheckpointError(directory / OPTIMIZER_FILE, "this checkpoint was saved without optimizer state")
    source = model_source or "the model"
    adapters_only = bool(metadata.get("base"))
    if model is not None and adapters_only and not base_loaded:
        raise CheckpointError(
            directory,
            f"holds PEFT adapters only (its base is {metadata['base'].get('path')!r}): load it with blockzoo.load, "
            "which loads the base first",
        )
    if model is not None:
        parameters = saved_parameters(model, adapters_only)
        renamed = former_adapter_names(model)  # parameters an adapter renamed since (LoRA's: once named by index)
        with TensorFile(directory / MODEL_FILE, metadata, renamed) as weights:
            _check_weights(weights, parameters, source, whole_model=distributed.config.pipeline_parallel == 1)
            if optimizer is not None:  # Read (and checked) before any parameter changes.
                with TensorFile(directory / OPTIMIZER_FILE, metadata, renamed) as states:
                    optimizer_state = _read_optimizer_state(states, model, optimizer, distributed)
            # Resuming (with the optimizer) copies: a run prunes its old checkpoints, and a file mapped by the model
            # would keep its disk space until the process ends.
            _copy_weights(weights, parameters, distributed, adopt=optimizer is None)
        if optimizer is not None:
            # Through `load_state_dict`: torch places each state tensor (device, dtype) as the optimizer expects.
            state_dict = optimizer.state_dict()
            state_dict["state"] = optimizer_state
            optimizer.load_state_dict(state_dict)
    return config, metadata


class TensorFile:
    """A safetensors file read tensor by tensor as views of its memory map (`SafetensorsReader.mapped`), with errors
    that name it, checked against the checksum `metadata` records for it (hashed over the same map: the pages it
    reads are those the tensors then use). Use as a context manager."""

    def __init__(self, path: Path, metadata: Mapping[str, Any], renamed: Mapping[str, str] | None = None):
        self.path = path
        if not path.is_file():
            raise CheckpointError(path, "missing: not a complete checkpoint")
        try:
            self._reader = SafetensorsReader(path)
        except ConversionError as error:
            problem = str(error).removeprefix(f"{path}: ")
            raise CheckpointError(
                path,
                f"not a readable safetensors file ({problem}): corrupted or rewritten since the checkpoint was saved",
            ) from None
        try:
            verify_checksum(path, metadata, self._reader.mapped_file())
        except BaseException:
            self._reader.close()
            raise
        # `renamed`: {parameter name before, now}: a tensor saved under a parameter's former name (or its optimizer
        # state, `<name>/<key>`) is read as the parameter's present one.
        parameters_saved = {name.partition("/")[0] for name in self._reader.names}
        self._file_names = {}
        for name in self._reader.names:
            head, slash, rest = name.partition("/")
            new = (renamed or {}).get(head)
            self._file_names[new + slash + rest if new and new not in parameters_saved else name] = name
        self.shapes = {name: self._reader.shape(saved) for name, saved in self._file_names.items()}
        self.dtypes = {name: self._reader.dtype(saved) for name, saved in self._file_names.items()}

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._reader.close()

    def get(self, name: str) -> torch.Tensor:
        """The tensor, a view of the mapped file (private: writing to it never changes the file)."""
        return self._reader.mapped(self._file_names.get(name, name))

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, problem)


def _to_local(tensor: torch.Tensor, parameter: nn.Parameter, distributed: Distributed) -> torch.Tensor:
    """This rank's part of a global tensor shaped like `parameter`: its tensor-parallel (and expert-parallel) shard,
    laid out as the parameter (an FSDP DTensor holding this rank's rows of it). A copy: a view would keep the whole
    global tensor alive."""
    meta = getattr(parameter, "meta", None)
    if meta is not None:
        tensor = meta.global_to_local(
            tensor, distributed.tensor_rank, distributed.tensor_size, distributed.data_rank, distributed.data_size
        )
    return shard_like(parameter, tensor).clone()


def _check_weights(
    file: TensorFile, parameters: Mapping[str, nn.Parameter], source: str, *, whole_model: bool = True
) -> None:
    """Every parameter (of the model built from `source`) is in the file with its global shape and dtype, and (for a
    `whole_model`, not a pipeline stage) nothing else is."""
    if missing := [name for name in parameters if name not in file.shapes]:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise file.error(f"tensor {missing[0]!r} is missing{more}")
    if whole_model and (unexpected := sorted(set(file.shapes) - set(parameters))):
        raise file.error(f"the model has no parameter {', '.join(map(repr, unexpected))} that the file holds")
    for name, parameter in parameters.items():
        if (shape := file.shapes[name]) != (expected := global_shape(parameter)):
            raise file.error(
                f"tensor {name!r} has shape {list(shape)}, but {source} expects {list(expected)}: the two disagree (an "
                "architecture field changed?)"
            )
        if file.dtypes[name] != parameter.dtype:
            raise file.error(
                f"tensor {name!r} is {file.dtypes[name]}, but {parameter.dtype} was saved (and is expected)"
            )


def _copy_weights(
    file: TensorFile, parameters: Mapping[str, nn.Parameter], distributed: Distributed, *, adopt: bool
) -> None:
    """Fill the parameters; with `adopt`, one held whole here becomes the mapped tensor (`blockzoo.loading`)."""
    with torch.no_grad():
        for name, parameter in parameters.items():
            fill_parameter(parameter, file.get(name), distributed, adopt=adopt)


def _read_optimizer_state(
    file: TensorFile, model: nn.Module, optimizer: torch.optim.Optimizer, distributed: Distributed
) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer's `state_dict()["state"]`: this rank's shards, by the parameters' indices in the optimizer."""
    parameters = dict(model.named_parameters())
    optimized = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    index_of = {id(parameter): index for index, parameter in enumerate(optimized)}
    keys: dict[str, set[str]] = {}
    for tensor_name, shape in file.shapes.items():
        name, _, key = tensor_name.partition("/")
        if name not in parameters and distributed.config.pipeline_parallel > 1:
            continue  # another stage's
        if name not in parameters:
            raise file.error(f"optimizer state {tensor_name!r} is for {name!r}, which is not a parameter of the model")
        if id(parameters[name]) not in index_of:
            raise file.error(f"optimizer state {tensor_name!r} is for {name!r}, which this optimizer does not train")
        if shape not in ((), global_shape(parameters[name])):
            raise file.error(
                f"tensor {tensor_name!r} has shape {list(shape)}, expected [] or the parameter's "
                f"{list(global_shape(parameters[name]))}"
            )
        keys.setdefault(name, set()).add(key)
    if len({frozenset(found) for found in keys.values()}) > 1:
        expected = set.union(*keys.values())
        name, found = next((name, found) for name, found in keys.items() if found != expected)
        missing = ", ".join(f"{name}/{key}" for key in sorted(expected - found))
        raise file.error(f"tensor {missing} is missing (the other parameters have {', '.join(sorted(expected))})")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, state_keys in keys.items():
        parameter = parameters[name]
        own = state.setdefault(index_of[id(parameter)], {})
        for key in sorted(state_keys):
            tensor = file.get(f"{name}/{key}")
            own[key] = _to_local(tensor, parameter, distributed) if tensor.ndim else tensor.clone()
    return state
