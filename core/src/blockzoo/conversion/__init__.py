"""Declarative conversions between blockzoo and other checkpoint formats (DESIGN.md "Checkpoints and formats"):
the mappings and sections (`mappings`), the formats and what the plugins registered (`formats`), converting configs
through sections (`configs`).

A converter plugin provides *formats*: a `CheckpointFormat` (e.g. Hugging Face's `llama`) reads and writes whole
checkpoints. What a format cannot know, how each mixer, MLP or normalization is written there, comes from
*sections*: a `Section` says, for one config class in one format, which config fields map to which keys of the
format's config, and which parameters to which tensors. The plugin that owns a config class contributes its
sections from its `register_converters(register)` hook, `register(format_name, section)`; the converter plugin
registers each format the same way, `register(format_name, checkpoint_format)`, and composes the sections.

A section is data:
- `config`: config mappings, each claiming blockzoo fields (`ours`, dotted paths relative to the section's config)
  and format keys (`theirs`): `Rename`, `Constant` (a blockzoo value the format implies), `Fixed` (a format value
  blockzoo implies), `Ignored` (claimed, not converted, with the reason) and `Computed` (anything else).
- `parts`: fields holding other polymorphic configs (a block's mixer, a query norm), converted by the section
  registered for their own class in the same format.
- `weights(config)`: weight mappings for a config, parameter names (relative to the section's module) to tensor
  names (relative to the format's module `name`): `Weight` (one to one), `Concatenated` (key‖value, gate‖up, the
  experts of a MoE one tensor each, optionally transposed), `ComputedWeights`, and `Nested` (a sub-module
  converted by its own section).

Coverage is checked, never assumed: exporting a config, every field that describes the architecture (all but
`lr_scale`, `initialization`, `weight_decay`, `apply_peft`, `peft` and a linear's `fp8`: how it trains) must be
claimed, and every value the format cannot express is an error naming the field; importing, every key of the
format's config must be claimed by some section of the format (`claimed_keys`), and the converter checks that every
tensor is claimed and every parameter made.

Torch-free: weight mappings use torch only when they run (on the tensors they are given).
"""

from __future__ import annotations

from blockzoo.conversion.configs import (
    expand_weights,
    export_config,
    import_config,
    merge_keys,
    unclaimed_fields,
)
from blockzoo.conversion.formats import (
    CheckpointFormat,
    Origin,
    checkpoint_formats,
    claimed_keys,
    detect_format,
    get_format,
    ignored_keys,
    read_json,
    section_for,
    sections,
)
from blockzoo.conversion.mappings import (
    TRAINING_FIELDS,
    Computed,
    ComputedWeights,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    FormatNames,
    Ignored,
    Nested,
    Part,
    Rename,
    Section,
    Weight,
    WeightMapping,
    format_activation,
    get_path,
    join,
    transformers_activation,
)

__all__ = [
    "TRAINING_FIELDS",
    "CheckpointFormat",
    "Computed",
    "ComputedWeights",
    "Concatenated",
    "ConfigMapping",
    "Constant",
    "ConversionError",
    "Fixed",
    "FormatNames",
    "Ignored",
    "Nested",
    "Origin",
    "Part",
    "Rename",
    "Section",
    "Weight",
    "WeightMapping",
    "checkpoint_formats",
    "claimed_keys",
    "detect_format",
    "expand_weights",
    "export_config",
    "format_activation",
    "get_format",
    "get_path",
    "ignored_keys",
    "import_config",
    "join",
    "merge_keys",
    "read_json",
    "section_for",
    "sections",
    "transformers_activation",
    "unclaimed_fields",
]
