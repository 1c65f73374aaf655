"""Applying a fine-tuning method to a model: adapters on the linears whose `apply_peft` resolves true, the rest frozen.

Every `Linear` resolves, per component, its `apply_peft` (its config's, else the default its parent layer passes:
attention's query and value on, everything else off). `apply_peft` freezes every parameter of the model (lr_scale 0:
no gradient, no optimizer state) and gives each linear with an enabled component the adapter the method's
implementation makes; a plugin's linears take part through their `LinearConfig.apply_peft` without code of theirs.

A method's adapter module (`implementation(config, linear, distributed)`, registered with the method's config by a
plugin: LoRA is blockzoo-lora's) adds its update to the linear's local output (`forward`), folds it into the weight
(`merge_into(weight, sign)`, `merged`), and may rename its parameters between versions (`former_parameter_names()`:
checkpoints written before load under the new names). A fine-tuning's checkpoints hold the adapters' parameters
only (`is_adapter_parameter`), naming their base (`blockzoo.model.peft_base`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
from torch import nn

from blockzoo.config import ConfigError
from blockzoo.layers.linear import Linear
from blockzoo.layers.parameter import initialized
from blockzoo.peft.config import PeftConfig
from blockzoo.plugins import get_registry


def peft_linears(model: nn.Module) -> list[Linear]:
    """The linears of `model` with at least one component whose `apply_peft` resolved true."""
    return [module for module in model.modules() if isinstance(module, Linear) and any(module.peft_components)]


def apply_peft(model: nn.Module, config: PeftConfig, distributed, *, what: str = "the model") -> None:
    """Freeze `model` and add `config`'s adapters to its linears (initialized, even inside `uninitialized()`: a base
    checkpoint does not hold them). Raises `ConfigError` at `model.peft` if no linear applies PEFT."""
    linears = peft_linears(model)
    if not linears:
        raise ConfigError(
            [
                (
                    "model.peft",
                    f"no linear of {what} has apply_peft enabled, so {config.__class__.__name__} would train "
                    "nothing; attention's query and value have it by default, any other linear takes "
                    "`apply_peft: true` (e.g. model.decoder.block.mlp.up.apply_peft=true)",
                )
            ]
        )
    freeze(model)
    implementation = get_registry().implementation_of(config)
    with initialized():
        for linear in linears:
            linear.adapter = implementation(config, linear, distributed)


def freeze(model: nn.Module) -> None:
    """Give every parameter of `model` lr_scale 0: no gradient and no optimizer state."""
    for parameter in {id(p): p for p in model.parameters()}.values():
        meta = parameter.meta
        settings = tuple(attrs.evolve(s, lr_scale=0.0) for s in meta.settings)
        parameter.meta = attrs.evolve(meta, settings=settings)
        parameter.requires_grad_(False)


def adapters(model: nn.Module) -> Iterator[tuple[Linear, nn.Module]]:
    """(linear, adapter) of every adapted linear of `model`."""
    for module in model.modules():
        if isinstance(module, Linear) and module.adapter is not None:
            yield module, module.adapter


def former_adapter_names(model: nn.Module) -> dict[str, str]:
    """{name before, name now} of the adapter parameters of `model` whose name changed, for loading checkpoints
    written before: what each adapter's optional `former_parameter_names()` says (names under the adapter)."""
    renamed = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Linear) and hasattr(module.adapter, "former_parameter_names"):
            for before, now in module.adapter.former_parameter_names().items():
                renamed[f"{prefix}.adapter.{before}"] = f"{prefix}.adapter.{now}"
    return renamed


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (from `named_parameters`) is an adapter's."""
    return ".adapter." in f".{name}"


@contextlib.contextmanager
def without_adapters(model: nn.Module) -> Iterator[None]:
    """Detach the adapters while inside (to load base weights from a checkpoint that has none), then put them back."""
    detached = list(adapters(model))
    for linear, _ in detached:
        linear.adapter = None
    try:
        yield
    finally:
        for linear, adapter in detached:
            linear.adapter = adapter


def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter's update into its linear's weight (this rank's shard); the adapters then add nothing."""
    for linear, adapter in adapters(model):
        if not adapter.merged:
            adapter.merge_into(linear.weight.data, 1.0)
            adapter.merged = True


def unmerge_adapters(model: nn.Module) -> None:
    """Take merged updates back out of the weights; the adapters add them again."""
    for linear, adapter in adapters(model):
        if adapter.merged:
            adapter.merge_into(linear.weight.data, -1.0)
            adapter.merged = False


@contextlib.contextmanager
def merged_weights(model: nn.Module) -> Iterator[None]:
    """Inside: the adapters' updates folded into the weights and the adapters detached, as a model without PEFT (to
    export the fine-tuned model); after: the weights exactly as before (restored, not unmerged) and the adapters
    back."""
    originals = [(linear, linear.weight.data.clone()) for linear, adapter in adapters(model) if not adapter.merged]
    merge_adapters(model)
    try:
        with without_adapters(model):
            yield
    finally:
        for linear, weight in originals:
            linear.weight.data.copy_(weight)
            linear.adapter.merged = False
