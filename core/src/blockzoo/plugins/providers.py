"""Which distribution provides what: the one table the core consults to tell a user what to install (a type a
config names, a checkpoint no installed format reads), and which distributions are first-party (plain type names)."""

from __future__ import annotations

from pathlib import Path

from packaging.utils import canonicalize_name

# First-party distributions register plain type names; everyone else uses `<plugin>.<name>`.
FIRST_PARTY_DISTRIBUTIONS = frozenset(
    {
        "blockzoo",
        "blockzoo-attention",
        "blockzoo-mamba",
        "blockzoo-mamba-2",
        "blockzoo-discrete-mamba-2",
        "blockzoo-gated-delta-net",
        "blockzoo-mla",
        "blockzoo-mlp",
        "blockzoo-moe",
        "blockzoo-huggingface",
        "blockzoo-tensorboard",
        "blockzoo-wandb",
        "blockzoo-mlflow",
        "blockzoo-lm-eval",
        "blockzoo-ssm",
        "blockzoo-lora",
        "blockzoo-corpora",
    }
)
# Where a first-party type comes from, by (kind, name).
FIRST_PARTY_TYPES = {
    ("mixer", "attention"): "blockzoo-attention",
    ("mixer", "mamba"): "blockzoo-mamba",
    ("mixer", "mamba_2"): "blockzoo-mamba-2",
    ("mixer", "discrete_mamba_2"): "blockzoo-discrete-mamba-2",
    ("mixer", "gated_delta_net"): "blockzoo-gated-delta-net",
    ("mixer", "mla"): "blockzoo-mla",
    ("mlp", "mlp"): "blockzoo-mlp",
    ("mlp", "moe"): "blockzoo-moe",
    ("tracker", "tensorboard"): "blockzoo-tensorboard",
    ("tracker", "wandb"): "blockzoo-wandb",
    ("tracker", "mlflow"): "blockzoo-mlflow",
    ("benchmark", "lm_eval"): "blockzoo-lm-eval",
    ("initialization", "dt_bias"): "blockzoo-ssm",
    ("initialization", "a_log_range"): "blockzoo-ssm",
    ("initialization", "a_log_state"): "blockzoo-ssm",
    ("peft", "lora"): "blockzoo-lora",
    ("input_format", "parquet"): "blockzoo-corpora",
    ("input_format", "arrow"): "blockzoo-corpora",
    ("input_format", "datasets"): "blockzoo-corpora",
    ("input_compression", "zst"): "blockzoo-corpora",
}
# Checkpoint formats of first-party converters: the file that marks a checkpoint of the family, the family's name,
# and the distribution that reads it.
FIRST_PARTY_FORMATS = {"config.json": ("Hugging Face", "blockzoo-huggingface")}


def type_provider(kind: str, name: str) -> str | None:
    """The first-party distribution providing type `name` of `kind`, or None."""
    return FIRST_PARTY_TYPES.get((kind, name))


def install_hint(kind: str, name: str) -> str | None:
    """ "provided by <distribution>: pip install <distribution>" for a first-party type, else None."""
    distribution = type_provider(kind, name)
    return f"provided by {distribution}: pip install {distribution}" if distribution else None


def is_first_party(distribution: str | None) -> bool:
    return distribution is not None and canonicalize_name(distribution) in FIRST_PARTY_DISTRIBUTIONS


def format_provider(directory: Path) -> tuple[str, str] | None:
    """For a directory that looks like a checkpoint of another format (it holds that format's marker file): what it
    is, in words, and the first-party distribution that reads it; None when it looks like no known format."""
    for marker, (family, distribution) in FIRST_PARTY_FORMATS.items():
        if (directory / marker).is_file():
            return f"a {family} checkpoint", distribution
    return None


def formats_hint() -> str:
    """Where the first-party formats come from, for a list of formats with none installed."""
    return "; ".join(f"the {family} formats come with {dist}" for family, dist in FIRST_PARTY_FORMATS.values())
