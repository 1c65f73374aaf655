"""Native checkpoints (DESIGN.md "Checkpoints and formats").

A checkpoint is a directory:

- `config.yaml`: the full resolved run config;
- `metadata.yaml`: the format version, the blockzoo version, every plugin whose types the config uses
  (name, distribution, version, types), the step, the data position (`data`), any other trainer state
  (`extra`, plain YAML data) and the files written;
- `model.safetensors`: every parameter as its global tensor, whatever the parallel layout, under its
  name in `model.named_parameters()` (tied parameters once);
- `optimizer.safetensors` (when an optimizer is given): each parameter's optimizer state as
  `<parameter name>/<state key>` (AdamW: `step`, `exp_avg`, `exp_avg_sq`); a state tensor shaped like
  its parameter is stored global like it, a scalar as it is;
- `origin/` (when the model was imported from another format): copies of that checkpoint's files other than its
  weights (`blockzoo.conversion.Origin`: its config, tokenizer, generation settings), for exports to give back.

A PEFT fine-tuning's checkpoint may hold its adapters only (`save_checkpoint(base=...)`): `model.safetensors` then
has the adapter parameters alone (their optimizer state is all there is anyway) and `metadata.yaml` a `base` entry
naming the checkpoint the frozen weights come from (`blockzoo.model.factory.base_reference`: its path, format, model
config and weight files' checksums). Loading such a checkpoint fills the adapters only; the caller loads the base
first and says so (`base_loaded`), after checking it is the one recorded (`blockzoo.model.factory.load_base`).

No pickle: tensors go to safetensors, everything else to YAML. Saving streams the tensors: the ranks gather one
global tensor at a time (FSDP shards over the data ranks, tensor-parallel shards over the tensor ranks, experts of
expert parallelism over the data ranks), its writer puts it at its place in the file, and it is freed, so no rank
holds a whole model. Rank 0 makes the files, sized with their headers, in a temporary directory beside the target;
each tensor is written by the first rank (tensor, data rank 0) of the first pipeline stage holding it, so that the
stages of a pipeline write their own tensors into the one file (the checkpoint directory must then be on a file
system all writing ranks see, as for any checkpoint of a run over several machines). Rank 0 then writes the YAML
files and renames the directory, so a crash mid-save leaves the previous checkpoint as it was. Loading, each rank
takes its own shard of every global tensor, so any parallel layout loads a checkpoint of any other.

Reliability (docs/architecture.md "Checkpoints"): `metadata.yaml` records a checksum of every other file
(`checksums`, verified on load; older checkpoints without it still load); a tensor is refused when its dtype is not
the one the model (or optimizer) holds; a non-finite tensor is never saved; the space a checkpoint needs is checked
before writing; pruning renames a directory to `.<name>.deleting` before removing it, so no half-deleted directory
looks complete; `latest_checkpoint` skips (and reports) checkpoints that fail verification.

The code, by concern: `format` (the names, errors and YAML files), `writing` (a durable save: temporary directory,
fsync, atomic rename) with `gather` (the tensors streamed across ranks), `space` (free-space checks) and
`checksums`, `reading` (verifying and loading), `metadata`, `retention` (the latest checkpoint, pruning),
`plugin_versions` (the plugins a checkpoint needs) and `origin` (an imported model's files).
"""

from blockzoo.checkpoint.checksums import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, file_checksum, usable_cpus
from blockzoo.checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    METADATA_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    ORIGIN_DIRECTORY,
    CheckpointError,
    NonFiniteError,
)
from blockzoo.checkpoint.metadata import read_checkpoint_config, read_checkpoint_metadata
from blockzoo.checkpoint.origin import read_origin
from blockzoo.checkpoint.reading import load_checkpoint, verify_checkpoint, weights_checksums
from blockzoo.checkpoint.retention import keep_last, latest_checkpoint
from blockzoo.checkpoint.writing import record_checksum, save_checkpoint

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_ALGORITHMS",
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "ORIGIN_DIRECTORY",
    "CheckpointError",
    "NonFiniteError",
    "file_checksum",
    "keep_last",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint_config",
    "read_checkpoint_metadata",
    "read_origin",
    "record_checksum",
    "save_checkpoint",
    "usable_cpus",
    "verify_checkpoint",
    "weights_checksums",
]
