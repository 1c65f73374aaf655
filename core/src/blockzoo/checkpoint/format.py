"""The native checkpoint format's names and plain-data files: the file names, the format version, the errors, and
reading / writing the YAML files (`blockzoo.checkpoint` describes the format)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from blockzoo.errors import UsageError
from blockzoo.peft.apply import is_adapter_parameter

FORMAT_VERSION = 1


CONFIG_FILE = "config.yaml"


METADATA_FILE = "metadata.yaml"


MODEL_FILE = "model.safetensors"


OPTIMIZER_FILE = "optimizer.safetensors"


ORIGIN_DIRECTORY = "origin"


STEP_DIRECTORY = re.compile(r"step_(\d+)")


class CheckpointError(UsageError):
    """A checkpoint cannot be written or read as asked; names the file and what is wrong."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class NonFiniteError(CheckpointError):
    """A tensor to save holds nan or inf: the checkpoint is not written."""


# libyaml's safe loader where PyYAML has it (ten times faster: a checkpoint's YAML files are read a few times a load).
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(path, "missing: not a complete checkpoint")
    try:
        data = yaml.load(path.read_text(), Loader=YAML_LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CheckpointError(path, f"cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, f"expected a mapping, found {type(data).__name__}")
    return data


def yaml_text(data: Mapping[str, Any], what: str) -> str:
    try:
        return yaml.safe_dump(dict(data), sort_keys=False)
    except yaml.YAMLError as error:
        raise ValueError(f"{what} must be plain data (numbers, strings, lists, mappings, bytes): {error}") from None


def global_shape(parameter: nn.Parameter) -> tuple[int, ...]:
    meta = getattr(parameter, "meta", None)
    return tuple(parameter.shape) if meta is None else meta.global_shape


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def saved_parameters(model: nn.Module, adapters_only: bool) -> dict[str, nn.Parameter]:
    """The parameters a checkpoint's weights file holds: all, or (a PEFT checkpoint with a base) the adapters."""
    parameters = dict(model.named_parameters())
    if adapters_only:
        return {name: parameter for name, parameter in parameters.items() if is_adapter_parameter(name)}
    return parameters
