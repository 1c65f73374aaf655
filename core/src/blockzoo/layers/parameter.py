"""The one parameter factory every layer uses.

`create_parameter` makes an `nn.Parameter` holding this tensor-parallel rank's shard and attaches a
`ParameterMeta` (`parameter.meta`): its dims, settings and what the optimizer and the runtime need.

Initialization does not depend on the parallel layout: the global tensor is initialized on the CPU
from a generator seeded by the run's seed and the parameter's full name, then this rank's shard is
taken, so a tensor-parallel run starts from exactly the weights of the single-process run.

Most parameters are replicated across the data group. A parameter made with `data_parallel_dims` (the experts
of expert parallelism) is instead split over the data group too: `data_parallel_dims` describes the global tensor
(its `parallel` dims split between data ranks), `dims` this data rank's part (itself maybe tensor-parallel). The
global tensor is initialized, then this data rank's part taken, then this tensor rank's shard of it.

A model whose every weight comes from a checkpoint is built `uninitialized()`: initializing would be thrown away, and
drawing random numbers for every weight costs more than reading them (on every tensor-parallel rank, since each
makes the global tensors).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn

from blockzoo.layers.config import InitializationConfig, ResolvedParameter
from blockzoo.layers.dims import ConcatenatedTensorDim, TensorDim
from blockzoo.plugins import get_registry

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from blockzoo.distributed.runtime import Distributed


_initializing = contextvars.ContextVar("blockzoo_initializing_parameters", default=True)


@contextlib.contextmanager
def uninitialized(enabled: bool = True) -> Iterator[None]:
    """Parameters made inside (when `enabled`) are allocated but not initialized: for a model a checkpoint fills
    whole right after (the loaders check that every parameter is there)."""
    token = _initializing.set(not enabled and _initializing.get())
    try:
        yield
    finally:
        _initializing.reset(token)


@contextlib.contextmanager
def initialized() -> Iterator[None]:
    """Parameters made inside are initialized even within `uninitialized()`: the adapters added to a model whose base
    weights a checkpoint fills (it does not hold them)."""
    token = _initializing.set(True)
    try:
        yield
    finally:
        _initializing.reset(token)


_on_meta_device = contextvars.ContextVar("blockzoo_parameters_on_meta_device", default=False)


@contextlib.contextmanager
def on_meta_device(enabled: bool = True) -> Iterator[None]:
    """Parameters made inside (when `enabled`) are on the meta device, taking no memory: build a whole model, keep
    the parts this process runs (a pipeline stage) and `materialize` them."""
    token = _on_meta_device.set(enabled or _on_meta_device.get())
    try:
        yield
    finally:
        _on_meta_device.reset(token)


class ParameterShapeError(ValueError):
    """A parameter's shape that the config's sizes make impossible (a dimension the tensor-parallel ranks cannot
    split, more bytes than a tensor can hold): the config's problem, whichever layer asked for the parameter."""


@attrs.frozen(kw_only=True)
class ParameterMeta:
    """What a parameter is, beyond its values.

    `settings` holds one `ResolvedParameter`, or one per component of the first dim (a concatenated
    dim such as key‖value), which then applies to the rows `component_rows` of the local tensor.
    `reduce_gradient_over_tensor_group` marks a replicated parameter whose gradient on each rank is a
    partial sum (it only sees this rank's tokens under sequence-tensor-parallel, or this rank's share of
    the work inside the tensor-parallel region): its gradient must be summed over the tensor group.
    `data_parallel_dims`, for a parameter split over the data group (`data_parallel_sharded`), are its dims over
    every data rank, `dims` being this data rank's part: its gradient is not summed over the data group (each rank
    holds the whole gradient of its part), its norm and checkpoint tensor are assembled over the data group.
    """

    name: str
    dims: tuple[TensorDim, ...]
    local_shape: tuple[int, ...]
    settings: tuple[ResolvedParameter, ...]
    component_rows: tuple[slice, ...]
    tensor_parallel: bool
    reduce_gradient_over_tensor_group: bool
    data_parallel_dims: tuple[TensorDim, ...] | None = None

    @property
    def data_parallel_sharded(self) -> bool:
        return self.data_parallel_dims is not None

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(dim.global_size for dim in self.data_parallel_dims or self.dims)

    @property
    def requires_grad(self) -> bool:
        return any(not settings.frozen for settings in self.settings)

    @property
    def uniform(self) -> bool:
        """All rows share one learning-rate scale and weight-decay flag (then use `settings[0]`)."""
        return len({(settings.lr_scale, settings.weight_decay) for settings in self.settings}) == 1

    def lr_scale_rows(self) -> torch.Tensor:
        """The learning-rate scale of each local row, shaped to broadcast against the parameter."""
        return self._per_row([settings.lr_scale for settings in self.settings])

    def weight_decay_rows(self) -> torch.Tensor:
        """1.0 where weight decay applies, 0.0 where not, shaped to broadcast against the parameter."""
        return self._per_row([float(settings.weight_decay) for settings in self.settings])

    def _per_row(self, values: list[float]) -> torch.Tensor:
        if len(values) == 1:
            return torch.tensor(values[0])
        rows = torch.empty(self.local_shape[0], *[1] * (len(self.local_shape) - 1))
        for component, value in zip(self.component_rows, values):
            rows[component] = value
        return rows

    def global_to_local(
        self, tensor: torch.Tensor, tp_rank: int, tp_size: int, data_rank: int = 0, data_size: int = 1
    ) -> torch.Tensor:
        """This rank's shard of a global tensor of this parameter's shape (loading a checkpoint)."""
        for index, dim in enumerate(self.data_parallel_dims or ()):
            tensor = dim.global_to_local(tensor, index, data_rank, data_size)
        for index, dim in enumerate(self.dims):
            tensor = dim.global_to_local(tensor, index, tp_rank, tp_size)
        return tensor

    def local_to_global(
        self, tensor: torch.Tensor, group: ProcessGroup | None, data_group: ProcessGroup | None = None
    ) -> torch.Tensor:
        """The global tensor from every rank's shard of the parameter (or of its gradient): an FSDP (ZeRO) shard
        gathered over its data ranks first, then over the tensor `group`, then, if data-parallel sharded, over
        `data_group`."""
        if hasattr(tensor, "full_tensor"):  # a DTensor: FSDP's shard of this rank's tensor-parallel tensor
            tensor = tensor.full_tensor()
        for index, dim in enumerate(self.dims):
            tensor = dim.local_to_global(tensor, index, group)
        for index, dim in enumerate(self.data_parallel_dims or ()):
            tensor = dim.local_to_global(tensor, index, data_group)
        return tensor


def create_parameter(
    name: str,
    dims: Sequence[TensorDim],
    settings: ResolvedParameter | Sequence[ResolvedParameter],
    distributed: Distributed,
    *,
    token_sharded_input: bool = False,
    partial_gradient: bool = False,
    data_parallel_dims: Sequence[TensorDim] | None = None,
    device: torch.device | str | None = None,
) -> nn.Parameter:
    """Make and initialize this rank's shard of parameter `name` (its full name, e.g. `decoder.0.mlp.up.weight`).

    `settings`: one for the whole parameter, or one per component of `dims[0]` (a `ConcatenatedTensorDim`).
    `token_sharded_input`: the parameter acts on activations split along tokens under sequence-tensor-
    parallel; if replicated, its gradient is then flagged for a sum over the tensor group.
    `partial_gradient`: a replicated parameter used inside the tensor-parallel region by this rank's share
    of the work only (e.g. MQA's key/value when the query heads are split, per-head norm weights): its
    gradient is flagged for a sum over the tensor group whenever tensor-parallel.
    `data_parallel_dims`: the parameter is split over the data group (expert parallelism): these are its dims over
    all data ranks (the `parallel` ones split between data ranks), `dims` this data rank's part.
    `device`: defaults to the run's device; "meta" makes an uninitialized parameter (see `materialize`).
    A parameter whose settings are all frozen (lr_scale 0) does not require gradients.
    """
    dims = tuple(dims)
    settings = (settings,) if isinstance(settings, ResolvedParameter) else tuple(settings)
    tensor_parallel = any(dim.parallel for dim in dims)
    if token_sharded_input and tensor_parallel:
        raise ValueError(f"parameter {name!r} is split between tensor-parallel ranks, so it cannot see token shards")
    if partial_gradient and (tensor_parallel or token_sharded_input):
        raise ValueError(
            f"parameter {name!r}: a partial gradient is for replicated parameters inside the tensor region"
        )
    try:
        local_shape = tuple(dim.local_size(distributed.tensor_size) for dim in dims)
    except ValueError as error:
        raise ParameterShapeError(f"parameter {name!r}: {error}") from None
    # torch cannot index storage beyond 2**63 - 1 bytes (a config's huge sizes): say which parameter, not "overflowed".
    if math.prod(dim.global_size for dim in dims) * torch.get_default_dtype().itemsize > 2**63 - 1:
        raise ParameterShapeError(
            f"parameter {name!r} of shape {[dim.global_size for dim in dims]} takes more than 2**63 - 1 bytes, "
            "more than a tensor can hold"
        )
    if data_parallel_dims is not None:
        data_parallel_dims = tuple(data_parallel_dims)
        data_local = tuple(dim.local_size(distributed.data_size) for dim in data_parallel_dims)
        if data_local != tuple(dim.global_size for dim in dims):
            raise ValueError(
                f"parameter {name!r}: its data-parallel part {list(data_local)} does not match its dims "
                f"{[dim.global_size for dim in dims]}"
            )
    meta = ParameterMeta(
        name=name,
        dims=dims,
        local_shape=local_shape,
        settings=settings,
        component_rows=tuple(_component_rows(name, dims, len(settings), distributed.tensor_size)),
        tensor_parallel=tensor_parallel,
        reduce_gradient_over_tensor_group=(token_sharded_input and distributed.config.uses_sequence_tensor_parallel)
        or (partial_gradient and distributed.tensor_size > 1),
        data_parallel_dims=data_parallel_dims,
    )
    parameter = nn.Parameter(
        torch.empty(local_shape, device=device or ("meta" if _on_meta_device.get() else distributed.device)),
        requires_grad=meta.requires_grad,
    )
    parameter.meta = meta
    if not parameter.is_meta and _initializing.get():
        initialize_parameter(parameter, distributed)
    return parameter


def initialize_parameter(parameter: nn.Parameter, distributed: Distributed) -> None:
    """(Re)initialize a factory-made parameter in place: its shard of the reproducibly initialized global tensor."""
    meta: ParameterMeta = parameter.meta
    generator = torch.Generator().manual_seed(_seed(distributed.config.seed, meta.name))
    full = torch.empty(meta.global_shape)
    global_dims = meta.data_parallel_dims or meta.dims
    for rows, settings in zip(_component_rows(meta.name, global_dims, len(meta.settings), 1), meta.settings):
        _initializer(settings.initialization)(full[rows], settings.initialization, generator)
    local = meta.global_to_local(
        full, distributed.tensor_rank, distributed.tensor_size, distributed.data_rank, distributed.data_size
    )
    with torch.no_grad():
        parameter.copy_(local)


def materialize(module: nn.Module, distributed: Distributed) -> None:
    """Allocate on the run's device and initialize (unless `uninitialized()`) every parameter of `module` still on
    the meta device.

    Replaces the parameter objects (`nn.Module.to_empty` would drop their `meta`); tied parameters stay tied.
    """
    replacements: dict[int, nn.Parameter] = {}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        for key, parameter in list(submodule.named_parameters(recurse=False, remove_duplicate=False)):
            if not parameter.is_meta:
                continue
            if not hasattr(parameter, "meta"):
                raise ValueError(f"parameter {module_name}.{key} was not made by create_parameter; cannot initialize")
            if id(parameter) not in replacements:
                replacements[id(parameter)] = _allocate(parameter, distributed)
            setattr(submodule, key, replacements[id(parameter)])


def _allocate(parameter: nn.Parameter, distributed: Distributed) -> nn.Parameter:
    allocated = nn.Parameter(torch.empty_like(parameter, device=distributed.device), parameter.requires_grad)
    allocated.meta = parameter.meta
    if _initializing.get():
        initialize_parameter(allocated, distributed)
    return allocated


def _component_rows(name: str, dims: tuple[TensorDim, ...], count: int, tp_size: int) -> list[slice]:
    if count == 1:
        return [slice(None)]
    if not (dims and isinstance(dims[0], ConcatenatedTensorDim) and len(dims[0].dims) == count):
        first = dims[0] if dims else None
        raise ValueError(
            f"parameter {name!r}: {count} settings need a first dim concatenated from {count} components, got {first}"
        )
    return dims[0].component_slices(tp_size)


def _seed(seed: int, name: str) -> int:
    # Stable across processes and Python runs (unlike `hash`); 32 bits, all the CPU generator (mt19937) uses.
    return zlib.crc32(name.encode(), seed % 2**32)


def _initializer(config: InitializationConfig):
    registry = get_registry()
    return registry.resolve("initialization", registry.name_of(type(config))).load_implementation()
