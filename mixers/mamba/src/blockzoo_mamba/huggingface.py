"""How the Mamba 1 mixer is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

- `mamba` (MambaForCausalLM, `backbone.layers.N.mixer`) and `jamba` (JambaForCausalLM, `model.layers.N.mamba`,
  with RMS norms on dt, B and C, keys prefixed `mamba_`): the standard layout. The same tensors as ours, but
  `conv1d.weight` [channels, 1, kernel] and our `dt_bias` in `dt_proj.bias`.
- `apriel_hybrid_ssm` "m2" layers (ServiceNow's remote code, `model.layers.N.mixer`): the grouped layout, its
  keys in the config's `ssm_cfg` dict, which the converter's layout gives the sections as `ssm_cfg.KEY`. Their
  modelling code adds `dt_proj.bias` twice (inside `dt_proj`, then as the scan's `delta_bias`, and likewise when
  decoding), so the bias they compute with, our `dt_bias`, is 2 × `dt_proj.bias`.

Torch-free: the weight mappings use torch only when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    ComputedWeights,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    Ignored,
    Nested,
    Part,
    Rename,
    Section,
    Weight,
    WeightMapping,
)
from blockzoo_mamba.config import DEFAULT_EXPAND, MambaConfig
from blockzoo_ssm import DtBiasInitializationConfig
from blockzoo_ssm.conversion import convolution_weights

_BIAS_FIELDS = (
    "add_linear_biases",
    *(f"{linear}.bias.enabled" for linear in ("x", "z", "b", "c", "x_proj", "dt_in_proj", "dt_proj", "out_proj")),
)
_NORMS = ("dt_norm", "b_norm", "c_norm")
_DT_BIAS_DEFAULT = DtBiasInitializationConfig()

# ---------------------------------------------------------------------------------------------------------------------
# Config mappings, each for the format's key names


def _inner_size(expand: str) -> ConfigMapping:
    """`expand` ↔ the key `expand` (inner size = expand × hidden size); an explicit inner_size has no key."""

    def export(config: MambaConfig) -> dict[str, Any]:
        if config.inner_size is not None:
            raise ConversionError(
                f"`inner_size` = {config.inner_size} cannot be written: the format stores `{expand}` (inner size = "
                f"{expand} × hidden size); give `expand` instead"
            )
        return {expand: DEFAULT_EXPAND if config.expand is None else config.expand}

    return Computed(
        ("inner_size", "expand"), (expand,), import_=lambda data: {"expand": data.get(expand, 2)}, export=export
    )


def _dt_rank(key: str) -> ConfigMapping:
    """`dt_rank` ↔ `key`, "auto" (ceil(hidden / 16)) for None."""
    return Computed(
        ("dt_rank",),
        (key,),
        import_=lambda data: {"dt_rank": None if data.get(key, "auto") == "auto" else data[key]},
        export=lambda config: {key: "auto" if config.dt_rank is None else config.dt_rank},
    )


def _convolution(kernel_size: str, bias: str) -> tuple[ConfigMapping, ...]:
    # A bias is blockzoo's default (`enabled` None): imported so.
    return (
        Rename("convolution.kernel_size", kernel_size, default=4),
        Computed(
            ("convolution.bias.enabled",),
            (bias,),
            import_=lambda data: {"convolution.bias.enabled": None if data.get(bias, True) else False},
            export=lambda config: {bias: config.convolution.has_bias},
        ),
    )


def _linear_biases(key: str) -> ConfigMapping:
    """One flag `key` for the biases of in_proj and out_proj (and the grouped layout's dt_in_proj); x_proj has none."""

    def export(config: MambaConfig) -> dict[str, Any]:
        found = {"in_proj": config.has_bias(config.z), "out_proj": config.has_bias(config.out_proj)}
        if config.grouped:
            found["dt_in_proj"] = config.has_bias(config.dt_in_proj)
        elif config.x_proj.bias.enabled:
            raise ConversionError("`x_proj.bias.enabled` cannot be written: the format's x_proj has no bias")
        if len(set(found.values())) > 1:
            raise ConversionError(f"mamba biases {found} cannot be written: `{key}` sets them alike")
        return {key: found["in_proj"]}

    return Computed(
        _BIAS_FIELDS,
        (key,),
        import_=lambda data: {"add_linear_biases": bool(data.get(key, False))},
        export=export,
    )


def _dt_bias_present(key: str | None) -> ConfigMapping:
    """The format always has `dt_proj.bias` (`key`, if any, must say so)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        if key is not None and data.get(key, True) is not True:
            raise ConversionError(
                f"`{key}` = {data[key]!r} is not supported: the format's modelling code needs the bias"
            )
        return {}

    def export(config: MambaConfig) -> dict[str, Any]:
        if not config.has_dt_bias:
            raise ConversionError("`dt_bias.enabled` = False cannot be written: the format always has dt_proj.bias")
        return {key: True} if key is not None else {}

    return Computed(("dt_bias.enabled",), (key,) if key is not None else (), import_=import_, export=export)


def _dt_initialization(scale: str, scheme: str, low: str, high: str, floor: str) -> tuple[ConfigMapping, ...]:
    """The time step's initialization: dt_proj's weight (`dt_init`, `dt_scale`) and `dt_bias` (the range of its
    softplus). The defaults import as blockzoo's default (None)."""
    keys = {"min": low, "max": high, "floor": floor}

    def import_bias(data: Mapping[str, Any]) -> dict[str, Any]:
        values = {name: data.get(key, getattr(_DT_BIAS_DEFAULT, name)) for name, key in keys.items()}
        if values == {name: getattr(_DT_BIAS_DEFAULT, name) for name in keys}:
            return {}
        return {"dt_bias.initialization": {"type": "dt_bias", **values}}

    def export_bias(config: MambaConfig) -> dict[str, Any]:
        initialization = config.dt_bias.initialization or _DT_BIAS_DEFAULT
        if not isinstance(initialization, DtBiasInitializationConfig):
            return {}  # another initialization: the format's keys describe none, transformers' defaults stand
        return {key: getattr(initialization, name) for name, key in keys.items()}

    return (
        Rename("dt_scale", scale, default=1.0),
        Rename("dt_init", scheme, default="random"),
        Computed(("dt_bias.initialization",), tuple(keys.values()), import_=import_bias, export=export_bias),
    )


STANDARD_LAYOUT = (Constant("xb_size", None), Constant("repeat_xb_before_convolution", True))
SCAN_PATH = Ignored(
    theirs=("use_mambapy", "use_associative_scan", "use_mamba_kernels"),
    reason="which implementation transformers runs, not what it computes",
)

# ---------------------------------------------------------------------------------------------------------------------
# Weight mappings


def _weights(dt_bias: WeightMapping) -> Callable[[MambaConfig], list[WeightMapping | Nested]]:
    """The mixer's tensors (Hugging Face names); `dt_bias`: how `dt_bias` is stored."""

    def weights(config: MambaConfig) -> list[WeightMapping | Nested]:
        mappings: list[WeightMapping | Nested] = [
            Weight("in_proj.weight", "in_proj.weight"),  # the same rows: [x; z], or grouped [z; x; B; C]
            *convolution_weights(config.convolution),
            Weight("dt_proj.weight", "dt_proj.weight"),
            dt_bias,
            Weight("a_log", "A_log"),
            Weight("d", "D"),
            Weight("out_proj.weight", "out_proj.weight"),
        ]
        if config.grouped:
            mappings.append(Weight("dt_in_proj.weight", "dt_in_proj.weight"))
            if config.has_bias(config.dt_in_proj):
                mappings.append(Weight("dt_in_proj.bias", "dt_in_proj.bias"))
        else:
            mappings.append(Weight("x_proj.weight", "x_proj.weight"))
        if config.has_bias(config.z):
            mappings.append(Weight("in_proj.bias", "in_proj.bias"))
        if config.has_bias(config.out_proj):
            mappings.append(Weight("out_proj.bias", "out_proj.bias"))
        for norm, name in zip(_NORMS, ("dt_layernorm", "b_layernorm", "c_layernorm")):
            if getattr(config, norm) is not None:
                mappings.append(Nested(norm, getattr(config, norm), name))
        return mappings

    return weights


# Apriel's bias is applied twice: ours is their tensor doubled (exact both ways in every float format).
DOUBLED_DT_BIAS = ComputedWeights(
    ("dt_bias",),
    ("dt_proj.bias",),
    import_=lambda tensors: [tensors[0] * 2],
    export=lambda tensors: [tensors[0] / 2],
)

# ---------------------------------------------------------------------------------------------------------------------
# The sections


def mamba_section() -> Section:
    """MambaForCausalLM's `MambaMixer` (`mixer`)."""
    return Section(
        config_class=MambaConfig,
        name="mixer",
        config=(
            Rename("state_size", "state_size", default=16),
            _inner_size("expand"),
            _dt_rank("time_step_rank"),
            *_convolution("conv_kernel", "use_conv_bias"),
            _linear_biases("use_bias"),
            _dt_bias_present(None),
            *_dt_initialization(
                "time_step_scale", "time_step_init_scheme", "time_step_min", "time_step_max", "time_step_floor"
            ),
            Fixed("hidden_act", "silu"),  # the convolution's activation (the gate's is silu whatever it says)
            *STANDARD_LAYOUT,
            *(Constant(norm, None) for norm in _NORMS),
            SCAN_PATH,
        ),
        weights=_weights(Weight("dt_bias", "dt_proj.bias")),
    )


def jamba_section() -> Section:
    """JambaForCausalLM's `JambaMambaMixer` (`mamba`): RMS norms on dt, B and C with the model's `rms_norm_eps`.
    `hidden_act` is also the MLPs' activation: both must be silu."""
    return Section(
        config_class=MambaConfig,
        name="mamba",
        config=(
            Rename("state_size", "mamba_d_state", default=16),
            _inner_size("mamba_expand"),
            _dt_rank("mamba_dt_rank"),
            *_convolution("mamba_d_conv", "mamba_conv_bias"),
            _linear_biases("mamba_proj_bias"),
            _dt_bias_present(None),
            Ignored(ours=("dt_init", "dt_scale"), reason="initialization of dt_proj only; the format has no key"),
            Fixed("hidden_act", "silu"),
            *STANDARD_LAYOUT,
            SCAN_PATH,
        ),
        parts=tuple(Part(norm, type="rms_norm") for norm in _NORMS),
        weights=_weights(Weight("dt_bias", "dt_proj.bias")),
    )


def _apriel_inner_size(data: Mapping[str, Any]) -> dict[str, Any]:
    # Explicit, as the m2d layers' d_inner (one key for both): d_inner, or expand × the hidden size when None.
    inner_size = data["ssm_cfg.d_inner"]
    return {"inner_size": data["ssm_cfg.expand"] * data["hidden_size"] if inner_size is None else inner_size}


def _apriel_export_inner_size(config: MambaConfig) -> dict[str, Any]:
    if config.inner_size is not None:
        return {"ssm_cfg.d_inner": config.inner_size}
    return {"ssm_cfg.d_inner": None, "ssm_cfg.expand": DEFAULT_EXPAND if config.expand is None else config.expand}


def _apriel_export_xb_size(config: MambaConfig) -> dict[str, Any]:
    if not config.grouped:
        raise ConversionError(
            "`xb_size` = None cannot be written: Apriel's m2 layers have the grouped layout (give xb_size)"
        )
    return {"ssm_cfg.d_xb": config.xb_size}


def apriel_section() -> Section:
    """The "m2" layers of ServiceNow's `apriel_hybrid_ssm` (`mixer`): the grouped layout, keys `ssm_cfg.*`."""
    return Section(
        config_class=MambaConfig,
        name="mixer",
        config=(
            Rename("state_size", "ssm_cfg.d_state"),
            Computed(
                ("inner_size", "expand"),
                ("ssm_cfg.d_inner", "ssm_cfg.expand"),
                import_=_apriel_inner_size,
                export=_apriel_export_inner_size,
            ),
            Computed(
                ("xb_size",),
                ("ssm_cfg.d_xb",),
                # None: the hidden size, as their modelling code does.
                import_=lambda data: {"xb_size": data["ssm_cfg.d_xb"] or data["hidden_size"]},
                export=_apriel_export_xb_size,
            ),
            Rename("repeat_xb_before_convolution", "ssm_cfg.repeat_kv_before_conv"),
            _dt_rank("ssm_cfg.dt_rank"),
            *_convolution("ssm_cfg.d_conv", "ssm_cfg.conv_bias"),
            _linear_biases("ssm_cfg.bias"),
            _dt_bias_present("ssm_cfg.dt_proj_bias"),
            *_dt_initialization(
                "ssm_cfg.dt_scale", "ssm_cfg.dt_init", "ssm_cfg.dt_min", "ssm_cfg.dt_max", "ssm_cfg.dt_init_floor"
            ),
            *(Constant(norm, None) for norm in _NORMS),
        ),
        weights=_weights(DOUBLED_DT_BIAS),
    )


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The Mamba 1 section of every Hugging Face format with Mamba 1 layers."""
    register("mamba", mamba_section())
    register("jamba", jamba_section())
    register("apriel_hybrid_ssm", apriel_section())
