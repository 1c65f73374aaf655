"""LoRA adapters as Hugging Face PEFT checkpoints: `adapter_config.json` + `adapter_model.safetensors`, the files
`peft.PeftModel.from_pretrained` loads onto the base model this format exports.

Which Hugging Face module a blockzoo linear's component is comes from the format's own weight mappings: a linear
whose weight is one tensor (`Weight`) is that tensor's module, each component of a linear whose weight is tensors
laid end to end (`Concatenated`: key‖value → k_proj, v_proj; gate‖up → gate_proj, up_proj) is its tensor's module.
A module that holds several components of ours (Mamba 2's in_proj = [z, x, B, C, dt]) gets one adapter of rank
`rank × enabled components`: A is theirs stacked, B holds each component's B in its rows and rank columns, which
is exactly the sum of our updates (exported with `rank_pattern`/`alpha_pattern` so the scale stays alpha / rank);
imported, every component takes A and its rows of B, so all of them must have `apply_peft`. Any other mapping
(transposed, computed, the embeddings...) has no adapter here: a PEFT module mapped so is refused by name.

The model is built with `model.peft` first (its rank, alpha and `apply_peft` choose which adapters exist); the
PEFT checkpoint must then match it: the same rank and scale, a tensor for each adapter and an adapter for each
tensor. Single-process models (tensor-parallel shards are gathered on export through each parameter's dims).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

from blockzoo.conversion import Concatenated, ConversionError, Weight, get_format, read_json
from blockzoo.peft.apply import adapters
from blockzoo_lora.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's names: its wrapper's, then the transformers model's module path


@attrs.frozen
class Target:
    """A Hugging Face module and the blockzoo linear (and the components of it) its weight holds."""

    module: str
    linear: str
    components: tuple[int, ...]
    rows: tuple[slice, ...]  # each component's rows in the module's output


def targets(model: Any, format_name: str) -> dict[str, list[Target]]:
    """Our linear name -> the Hugging Face modules of its weight, from the format's weight mappings."""
    linears = {linear.name: linear for linear, _ in adapters(model)}
    found: dict[str, list[Target]] = {}
    for mapping in get_format(format_name).weight_mappings(model.config):
        if len(mapping.ours) != 1 or not mapping.ours[0].endswith(".weight"):
            continue
        name = mapping.ours[0].removesuffix(".weight")
        linear = linears.get(name)
        if linear is None:
            continue
        modules = [tensor.removesuffix(".weight") for tensor in mapping.theirs]
        count = len(linear.peft_components)
        if type(mapping) is Weight:
            slices = linear.output_dim.component_slices() if count > 1 else [slice(0, linear.output_dim.global_size)]
            rows = tuple(slice(s.start, s.stop) for s in slices)
            found[name] = [Target(modules[0], name, tuple(range(count)), rows)]
        elif type(mapping) is Concatenated and not mapping.transposed and len(modules) == count > 1:
            sizes = [dim.global_size for dim in linear.output_dim.dims]
            found[name] = [Target(module, name, (i,), (slice(0, sizes[i]),)) for i, module in enumerate(modules)]
    return found


def save_adapters(model: Any, directory: str | Path, format_name: str, *, base_model: str | None = None) -> Path:
    """Write the LoRA adapters of `model` as a PEFT checkpoint for the `format_name` export of its base model."""
    config = _lora_config(model)
    by_linear = targets(model, format_name)
    tensors: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for linear, adapter in adapters(model):
        if linear.name not in by_linear:
            raise ConversionError(f"linear {linear.name!r} has no module in the {format_name} format to adapt")
        # By component index (`adapter.keys[i]` names component i).
        a = {adapter.keys.index(key): _global(parameter, model) for key, parameter in adapter.lora_a.items()}
        b = {adapter.keys.index(key): _global(parameter, model) for key, parameter in adapter.lora_b.items()}
        for target in by_linear[linear.name]:
            enabled = [(c, rows) for c, rows in zip(target.components, target.rows) if c in a]
            if not enabled:
                continue
            stacked_a = torch.cat([a[c] for c, _ in enabled])
            stacked_b = torch.zeros(target.rows[-1].stop, config.rank * len(enabled))
            for index, (c, rows) in enumerate(enabled):
                stacked_b[rows, index * config.rank : (index + 1) * config.rank] = b[c]
            if len(enabled) > 1:
                rank_pattern[target.module] = config.rank * len(enabled)
                alpha_pattern[target.module] = config.alpha * len(enabled)
            tensors[f"{PREFIX}{target.module}.lora_A.weight"] = stacked_a.contiguous()
            tensors[f"{PREFIX}{target.module}.lora_B.weight"] = stacked_b.contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    modules = sorted({name.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for name in tensors})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return directory


def load_adapters(model: Any, directory: str | Path, format_name: str) -> None:
    """Fill `model`'s LoRA adapters (single process) from a PEFT checkpoint of its `format_name` base model."""
    directory = Path(directory)
    config = _lora_config(model)
    adapter_config = read_json(directory / ADAPTER_CONFIG)
    _check_adapter_config(adapter_config, config, directory)
    tensors = load_file(directory / ADAPTER_WEIGHTS)
    modules = {}
    for name in tensors:
        module, _, kind = name.removeprefix(PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or not name.startswith(PREFIX):
            raise ConversionError(f"{directory / ADAPTER_WEIGHTS}: tensor {name!r} is no LoRA A or B of a module")
        modules[module] = None
    by_module = {target.module: target for found in targets(model, format_name).values() for target in found}
    linears = {linear.name: (linear, adapter) for linear, adapter in adapters(model)}
    if unmapped := sorted(module for module in modules if module not in by_module):
        raise ConversionError(
            f"{directory}: target module(s) {', '.join(unmapped)} cannot be mapped to an adapted linear of the "
            f"blockzoo {format_name} model (give them apply_peft, or they are no linear a LoRA adapter maps onto)"
        )
    filled: set[tuple[str, int]] = set()
    with torch.no_grad():
        for module in modules:
            target = by_module[module]
            _, adapter = linears[target.linear]
            a, b = tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"]
            for component, rows in zip(target.components, target.rows):
                key = adapter.keys[component]
                if key not in adapter.lora_a:
                    raise ConversionError(
                        f"{directory}: module {module!r} adapts component {key} of {target.linear!r}, which "
                        "has no apply_peft in this model"
                    )
                adapter.lora_a[key].copy_(a)
                adapter.lora_b[key].copy_(b[rows])
                filled.add((target.linear, component))
    missing = [
        f"{name}.{key}"
        for name, (_, adapter) in linears.items()
        for key in adapter.lora_a
        if (name, adapter.keys.index(key)) not in filled
    ]
    if missing:
        raise ConversionError(f"{directory}: no adapter tensors for {', '.join(missing)} of the blockzoo model")


def _check_adapter_config(data: dict, config: LoraConfig, directory: Path) -> None:
    where = directory / ADAPTER_CONFIG
    if data.get("peft_type") != "LORA":
        raise ConversionError(f"{where}: peft_type {data.get('peft_type')!r}; only LORA adapters are read")
    for key, allowed in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if data.get(key, allowed) != allowed:
            raise ConversionError(f"{where}: {key} {data[key]!r} is not supported (only {allowed!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if data.get(key):
            raise ConversionError(f"{where}: {key} {data[key]!r} is not supported")
    if data.get("r") != config.rank or float(data.get("lora_alpha", 8)) / data["r"] != config.scale:
        raise ConversionError(
            f"{where}: r {data.get('r')} and lora_alpha {data.get('lora_alpha')} differ from the model's "
            f"model.peft (rank {config.rank}, alpha {config.alpha}): build the model with the adapters' values"
        )


def _lora_config(model: Any) -> LoraConfig:
    config = model.config.peft
    if not isinstance(config, LoraConfig):
        raise ConversionError(f"the model's model.peft is {config!r}: Hugging Face PEFT adapters need LoRA")
    return config


def _global(parameter: torch.Tensor, model: Any) -> torch.Tensor:
    return parameter.meta.local_to_global(parameter.detach(), model.distributed.tensor_group).float().cpu()
