"""Former home of the Python API, kept so that existing imports keep working: the API is `blockzoo.python_api`,
the pretrained start `blockzoo.model.pretrained`, a PEFT checkpoint's base `blockzoo.model.peft_base`."""

from blockzoo.model.peft_base import base_reference, check_base, load_base
from blockzoo.model.pretrained import (
    load_pretrained_weights,
    pretrained_model_config,
    pretrained_origin,
    with_pretrained_config,
)
from blockzoo.python_api import as_run_config, build, convert, export_adapters, load, save

__all__ = [
    "as_run_config",
    "base_reference",
    "build",
    "check_base",
    "convert",
    "export_adapters",
    "load",
    "load_base",
    "load_pretrained_weights",
    "pretrained_model_config",
    "pretrained_origin",
    "save",
    "with_pretrained_config",
]
