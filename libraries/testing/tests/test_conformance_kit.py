"""The conformance kit catches deliberately broken plugins, with messages that say what to fix.

A small working mixer (`kittest.previous_token`: each token adds a weighted copy of the token before it in its
document; tensor-parallel, sequence-tensor-parallel, sequence-data-parallel, generation) passes every check the kit
runs in-process; one broken variant per failure (wrong output shape, state leaking across documents, a false
tensor-parallel claim, a field that changes nothing, a parameter without gradient or made without the factory, FLOPs
that do not scale, decoding that forgets its state, slices that forget the slice before) fails exactly its check,
with the message checked. Likewise a converter section
in made-up formats: right, or with a field, a weight or a key unclaimed, or an import that does not invert its export.
Three of the failures (a wrong output shape, state leaking across documents, a false tensor-parallel claim) and a
false sequence-data-parallel claim also go through pytest itself (`pytester`), as a plugin author sees them; and the
pytest plugin is checked to load without torch. These plugins are registered in-process (`register_plugin`); the kit
on installed plugins is each first-party plugin's test_<name>_conformance.py.
"""

import re
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    Computed,
    Linear,
    LinearConfig,
    Mixer,
    MixerConfig,
    NormalInitializationConfig,
    ParameterConfig,
    PluginInfo,
    Rename,
    Section,
    TensorDim,
    Weight,
    at_least,
    check,
    configclass,
    create_parameter,
    field,
    gather_slices,
    hookimpl,
    previous_slice,
)
from blockzoo.plugins import register_plugin
from blockzoo_testing import (
    ConformanceError,
    ConverterSectionConformance,
    MixerConformance,
    build_layer,
    check_decoding,
    check_forward_slices,
    check_matches_layer,
    check_packed_documents,
    check_sequence_data_parallel,
    check_tensor_parallel,
    layer_signature,
    single_process,
)

pytest_plugins = ["pytester"]

# ---------------------------------------------------------------------------------------------------------------------
# A working mixer


@configclass
class PreviousTokenConfig(MixerConfig):
    """y_t = output(v_t + mix ⊙ v_{t-1}), v = input(x), v_{-1} = 0 at each document start."""

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    channels: int = field(8, doc="Width of v.", validator=at_least(1))
    mix: ParameterConfig = field(factory=ParameterConfig, doc="Weight of the previous token, per channel.")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check(self.channels % tensor_parallel == 0, "channels", f"tensor_parallel={tensor_parallel} must divide it")


class PreviousTokenMixer(Mixer):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        channels = TensorDim("channels", config.channels, parallel=True)
        options = {"default_initialization": NormalInitializationConfig(std=0.3), "lr_scale": lr_scale}
        self.input = Linear(f"{name}.input", LinearConfig(), hidden_dim, channels, distributed, **options)
        self.output = Linear(f"{name}.output", LinearConfig(), channels, hidden_dim, distributed, **options)
        settings = config.mix.resolve(initialization=NormalInitializationConfig(mean=0.5, std=0.2), lr_scale=lr_scale)
        self.mix = create_parameter(f"{name}.mix", (channels,), settings, distributed)

    def forward(self, hidden, batch, state=None):
        return self.output(self.mixed(self.input(hidden), batch, state))

    def mixed(self, values, batch, state):
        return values + self.mix.to(values.dtype) * self.previous(values, batch, state)

    def forward_slice(self, hidden, batch, previous):
        """The carry is the last v before the next slice: over a group, the last rank's (the same on every rank)."""
        values = self.input(hidden)
        group = batch.sequence_data.group
        last = values[-1:]
        before = previous_slice(last, group)  # the rank before's last v; zeros on the first rank
        if previous is not None:
            # The first rank reads the carry; the others keep it in their graph with a zero gradient, so that every
            # rank takes part in the backward of the exchange that made it.
            first = torch.tensor(batch.sequence_data.rank == 0, device=values.device)
            before = before + torch.where(first, previous, 0.0)
        carry = gather_slices(last, group)[-1:]
        return self.output(self.mixed_slice(values, batch, before)), carry

    def mixed_slice(self, values, batch, before):
        shifted = torch.cat([before, values[:-1]])
        starts = batch.cu_seqlens[1:-1].long()  # the pieces after the first start their documents
        shifted = shifted.index_put((starts,), torch.zeros_like(values[starts]))
        if not batch.continued:
            shifted = torch.cat([torch.zeros_like(before), shifted[1:]])
        return values + self.mix.to(values.dtype) * shifted

    def previous(self, values, batch, state):
        """v_{t-1} within each document: zeros (or the state's last value) before each document's first token."""
        shifted = F.pad(values, (0, 0, 1, 0))[:-1]
        first = batch.cu_seqlens[:-1].long()
        before = torch.zeros_like(values[first]) if state is None else state.to(values.dtype, copy=True)
        if state is not None:
            state.copy_(values[batch.cu_seqlens[1:].long() - 1].detach())
        return shifted.index_put((first,), before)

    def new_state(self, num_sequences, max_length, device, dtype):
        return torch.zeros(num_sequences, len(self.mix), device=device, dtype=dtype)

    def flops(self, batch):
        tokens = batch.num_tokens
        mixing = 2 * tokens * self.config.channels
        forward = self.input.forward_flops(tokens) + self.output.forward_flops(tokens) + mixing
        backward = self.input.backward_flops(tokens) + self.output.backward_flops(tokens) + 2 * mixing
        return forward, backward


# ---------------------------------------------------------------------------------------------------------------------
# Broken variants, each with its own type


@configclass
class WrongShapeConfig(PreviousTokenConfig):
    """Forgets the output projection."""


class WrongShapeMixer(PreviousTokenMixer):
    def forward(self, hidden, batch, state=None):
        return self.mixed(self.input(hidden), batch, state)


@configclass
class LeakyConfig(PreviousTokenConfig):
    """Shifts over the packed batch: a document's first token sees the previous document's last one."""


class LeakyMixer(PreviousTokenMixer):
    def previous(self, values, batch, state):
        return F.pad(values, (0, 0, 1, 0))[:-1]


@configclass
class FalseTensorParallelConfig(PreviousTokenConfig):
    """Declares tensor_parallel but normalizes over the channels, which are split between ranks."""


class FalseTensorParallelMixer(PreviousTokenMixer):
    def mixed(self, values, batch, state):
        mixed = super().mixed(values, batch, state)
        return mixed / (mixed.pow(2).mean(-1, keepdim=True) + 1).sqrt()


@configclass
class UnusedFieldConfig(PreviousTokenConfig):
    temperature: float = field(1.0, doc="Declared, never used.")


@configclass
class NoGradientConfig(PreviousTokenConfig):
    """Makes a parameter it never uses."""


class NoGradientMixer(PreviousTokenMixer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        settings = config.mix.resolve(initialization=NormalInitializationConfig())
        self.unused = create_parameter(f"{self.name}.unused", (TensorDim("hidden", 4),), settings, self.distributed)


@configclass
class HandMadeParameterConfig(PreviousTokenConfig):
    """Makes a parameter without the factory."""


class HandMadeParameterMixer(PreviousTokenMixer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.offset = torch.nn.Parameter(torch.zeros(self.hidden_dim.global_size))

    def forward(self, hidden, batch, state=None):
        return super().forward(hidden, batch, state) + self.offset


@configclass
class ConstantInInitConfig(PreviousTokenConfig):
    """Computes a per-channel constant in __init__, as a plain tensor attribute."""


class ConstantInInitMixer(PreviousTokenMixer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.scale = torch.linspace(0.5, 1.5, self.hidden_dim.global_size)

    def forward(self, hidden, batch, state=None):
        return super().forward(hidden, batch, state) * self.scale


@configclass
class ConstantFlopsConfig(PreviousTokenConfig):
    """Reports the same FLOPs whatever the batch."""


class ConstantFlopsMixer(PreviousTokenMixer):
    def flops(self, batch):
        return 100, 200


@configclass
class FalseSequenceDataParallelConfig(PreviousTokenConfig):
    """Declares sequence_data_parallel but starts every slice afresh: a document continued from the slice before
    loses its previous token."""


class FalseSequenceDataParallelMixer(PreviousTokenMixer):
    def forward_slice(self, hidden, batch, previous):
        values = self.input(hidden)
        return self.output(self.mixed_slice(values, batch, torch.zeros_like(values[:1]))), None


@configclass
class NoSlicesConfig(PreviousTokenConfig):
    """Does not declare sequence_data_parallel."""

    capabilities: ClassVar[frozenset[str]] = PreviousTokenConfig.capabilities - {SEQUENCE_DATA_PARALLEL}


@configclass
class ForgetfulConfig(PreviousTokenConfig):
    """Declares generation_cache but ignores its state."""


class ForgetfulMixer(PreviousTokenMixer):
    def previous(self, values, batch, state):
        return super().previous(values, batch, None)


@configclass
class LengthBoundConfig(PreviousTokenConfig):
    """Takes max_length for the longest document's length, where a padded batch gives a bound."""


class LengthBoundMixer(PreviousTokenMixer):
    def forward(self, hidden, batch, state=None):
        return super().forward(hidden, batch, state) / batch.max_length


TYPES = {
    "previous_token": (PreviousTokenConfig, "PreviousTokenMixer"),
    "length_bound": (LengthBoundConfig, "LengthBoundMixer"),
    "wrong_shape": (WrongShapeConfig, "WrongShapeMixer"),
    "leaky": (LeakyConfig, "LeakyMixer"),
    "false_tensor_parallel": (FalseTensorParallelConfig, "FalseTensorParallelMixer"),
    "unused_field": (UnusedFieldConfig, "PreviousTokenMixer"),
    "no_gradient": (NoGradientConfig, "NoGradientMixer"),
    "hand_made_parameter": (HandMadeParameterConfig, "HandMadeParameterMixer"),
    "constant_in_init": (ConstantInInitConfig, "ConstantInInitMixer"),
    "constant_flops": (ConstantFlopsConfig, "ConstantFlopsMixer"),
    "forgetful": (ForgetfulConfig, "ForgetfulMixer"),
    "false_sequence_data_parallel": (FalseSequenceDataParallelConfig, "FalseSequenceDataParallelMixer"),
    "no_slices": (NoSlicesConfig, "PreviousTokenMixer"),
}


@hookimpl
def plugin_info():
    return PluginInfo(capabilities=tuple(sorted(PreviousTokenConfig.capabilities)), description="the kit's test mixers")


@hookimpl
def register_mixers(register):
    for name, (config_class, implementation) in TYPES.items():
        register(f"kittest.{name}", config_class, f"{__name__}:{implementation}")


# Sections converting the working mixer's config in made-up formats: one right, one broken per check.
WEIGHTS = [Weight("input.weight", "in.weight"), Weight("output.weight", "out.weight"), Weight("mix", "mix")]
SECTIONS = {
    "kit_right": Section(
        config_class=PreviousTokenConfig, config=(Rename("channels", "width"),), weights=lambda c: WEIGHTS
    ),
    "kit_unclaimed_field": Section(config_class=PreviousTokenConfig, weights=lambda c: WEIGHTS),
    "kit_lost_weight": Section(
        config_class=PreviousTokenConfig, config=(Rename("channels", "width"),), weights=lambda c: WEIGHTS[:2]
    ),
    "kit_not_inverted": Section(
        config_class=PreviousTokenConfig,
        config=(
            Computed(
                ("channels",),
                ("width",),
                import_=lambda data: {"channels": data["width"] * 2},
                export=lambda config: {"width": config.channels},
            ),
        ),
        weights=lambda c: WEIGHTS,
    ),
    "kit_unclaimed_key": Section(
        config_class=PreviousTokenConfig,
        config=(
            Computed(
                ("channels",),
                ("width",),
                import_=lambda data: {"channels": data["width"]},
                export=lambda config: {"width": config.channels, "depth": 1},
            ),
        ),
        weights=lambda c: WEIGHTS,
    ),
}


@hookimpl
def register_converters(register):
    for format_name, section in SECTIONS.items():
        register(format_name, section)


def register() -> None:
    """Register this module as plugin `kittest` (in-process: it is not installed)."""
    register_plugin(sys.modules[__name__], "kittest")


def section_conformance(format_name: str) -> ConverterSectionConformance:
    """The section kit on the working mixer's section in `format_name`."""

    class Kit(ConverterSectionConformance):
        kind = "mixer"

        def config_factory(self):
            return {"type": "kittest.previous_token", "channels": 8}

    Kit.format_name = format_name
    return Kit()


def conformance(type_name: str) -> MixerConformance:
    """The kit on `kittest.<type_name>` (named without `Test`, so pytest does not collect it here)."""

    class Kit(MixerConformance):
        def config_factory(self):
            return {"type": f"kittest.{type_name}", "channels": 8}

    return Kit()


@pytest.fixture
def kittest(blockzoo_registry):
    register()


# ---------------------------------------------------------------------------------------------------------------------
# Each check passes on the working mixer and fails on the broken one, with its message

IN_PROCESS_CHECKS = [
    "test_config_round_trip",
    "test_unknown_keys_are_rejected",
    "test_every_field_is_documented",
    "test_output_shape_and_dtype",
    "test_meta_device_construction",
    "test_packed_documents_equal_separate_runs",
    "test_padded_batches_equal_exact_ones",
    "test_gradients_reach_every_parameter",
    "test_every_field_changes_something",
    "test_generation_equals_the_full_forward",
    "test_forward_slices_equal_the_whole_forward",
    "test_flops_are_reported_and_scale_with_tokens",
]


@pytest.mark.parametrize("check_name", IN_PROCESS_CHECKS)
def test_the_working_mixer_passes(kittest, check_name):
    getattr(conformance("previous_token"), check_name)()


def test_the_working_mixer_survives_a_checkpoint(kittest, tmp_path):
    conformance("previous_token").test_checkpoint_round_trip(tmp_path)


BROKEN = [
    (
        "wrong_shape",
        "test_output_shape_and_dtype",
        r"the output of a batch of documents \[5, 1, 6\] has shape \(12, 8\), expected \(12, 16\) = \[tokens, "
        r"hidden\]: a layer returns one hidden-size vector for each token it receives",
    ),
    (
        "leaky",
        "test_packed_documents_equal_separate_runs",
        r"(?s)the output of document 1 \(tokens 5:6 of the packed batch \[5, 1, 6\]\) differs .*Information crosses a "
        r"document boundary: every token may see only tokens of its own document\. Restart convolutions",
    ),
    (
        "length_bound",
        "test_padded_batches_equal_exact_ones",
        r"(?s)a batch of \[5, 1, 6\] padded: the output differs .* from the exact batch\n.*A padded batch \(what "
        r"training\.cuda_graphs runs: Batch\.bucketed\) starts with empty documents",
    ),
    (
        "unused_field",
        "test_every_field_changes_something",
        r"these fields of UnusedFieldConfig changed neither the parameters nor the output:\n"
        r"  - temperature: \{temperature: 2\.0\} changed nothing; .*\{temperature: 0\.1\} changed nothing\n"
        r"Every declared field must change the layer",
    ),
    (
        "no_gradient",
        "test_gradients_reach_every_parameter",
        r"parameter 'unused' received no gradient from a loss on the output: it is unused, or detached",
    ),
    (
        "hand_made_parameter",
        "test_meta_device_construction",
        r"parameters offset were not made by blockzoo's parameter factory \(no `\.meta`\): make every parameter with "
        r"blockzoo\.api\.create_parameter or Linear",
    ),
    (
        "constant_in_init",
        "test_meta_device_construction",
        r"tensor attribute scale \(not a parameter\) was computed in __init__: built on the meta device .* it holds "
        r"no values, .* compute it in forward",
    ),
    (
        "constant_flops",
        "test_flops_are_reported_and_scale_with_tokens",
        r"flops\(batch\) is \(100, 200\) for the test batch and \(100, 200\) for the batch with every document twice, "
        r"expected exactly \(200, 400\)",
    ),
    (
        "forgetful",
        "test_generation_equals_the_full_forward",
        r"(?s)decoding step 1 \(2 tokens after 3\) of sequence 0 differs .* from the full forward\n.*\n"
        r"new_state\(\.\.\.\) must hold all that forward needs from earlier tokens",
    ),
    (
        "false_sequence_data_parallel",
        "test_forward_slices_equal_the_whole_forward",
        r"(?s)^slices of 1 tokens: the output differs .* from the whole forward\n.*Over slices of sequences, "
        r"forward_slice\(hidden, batch, previous\) must give what the whole forward gives",
    ),
]


@pytest.mark.parametrize(("type_name", "check_name", "message"), BROKEN, ids=[case[0] for case in BROKEN])
def test_a_broken_mixer_fails_its_check(kittest, type_name, check_name, message):
    with pytest.raises(ConformanceError, match=message):
        getattr(conformance(type_name), check_name)()


def test_an_uninstalled_plugin_is_not_discovered(kittest):
    with pytest.raises(ConformanceError, match=r"registered by plugin 'kittest', which no installed distribution"):
        conformance("previous_token").test_discovered_through_its_entry_point()


def test_a_config_module_that_imports_torch_is_refused(kittest):
    # This test module is the config module of the kittest types, and it imports torch.
    with pytest.raises(ConformanceError, match=rf"importing {__name__} imported torch\. A plugin's config and hook"):
        conformance("previous_token").test_config_and_hook_modules_import_no_torch()


# ---------------------------------------------------------------------------------------------------------------------
# Converter sections

SECTION_CHECKS = [
    "test_every_architecture_field_is_claimed",
    "test_config_round_trip",
    "test_exported_keys_are_claimed",
    "test_weights_round_trip",
]


@pytest.mark.parametrize("check_name", SECTION_CHECKS)
def test_a_right_section_passes(kittest, check_name):
    getattr(section_conformance("kit_right"), check_name)()


BROKEN_SECTIONS = [
    (
        "kit_unclaimed_field",
        "test_every_architecture_field_is_claimed",
        r"the kit_unclaimed_field section of PreviousTokenConfig claims no mapping for channels: add one",
    ),
    (
        "kit_lost_weight",
        "test_weights_round_trip",
        r"parameters mix are in no weight mapping of the kit_lost_weight section: add a Weight",
    ),
    (
        "kit_not_inverted",
        "test_config_round_trip",
        r"export -> import -> export changes the format's config:\n  \{'width': 8\}\n  \{'width': 16\}",
    ),
    (
        "kit_unclaimed_key",
        "test_exported_keys_are_claimed",
        r"the export writes depth, which no kit_unclaimed_key section claims",
    ),
    ("kit_missing", "test_weights_round_trip", r"no section converts PreviousTokenConfig in the 'kit_missing' format"),
]


@pytest.mark.parametrize(("format_name", "check_name", "message"), BROKEN_SECTIONS, ids=[c[0] for c in BROKEN_SECTIONS])
def test_a_broken_section_fails_its_check(kittest, format_name, check_name, message):
    with pytest.raises(ConformanceError, match=message):
        getattr(section_conformance(format_name), check_name)()


# ---------------------------------------------------------------------------------------------------------------------
# The public helpers plugins' own tests call


@pytest.mark.distributed
def test_check_tensor_parallel_lists_the_problems_of_every_case_and_refusal(kittest):
    cases = {
        "working": {"type": "kittest.previous_token", "channels": 8},
        "normalizes-split-channels": {"type": "kittest.false_tensor_parallel", "channels": 4},
    }
    refused = [
        # Refused by the config's check_tensor_parallel, which the engine runs before building the layer.
        (
            {"type": "kittest.previous_token", "channels": 5},
            r"mixer 'mixer' \(type '\w+'\): channels: tensor_parallel=2 must divide it",
        ),
        ({"type": "kittest.previous_token", "channels": 3}, r"cannot be split evenly between 4"),
        ({"type": "kittest.previous_token", "channels": 8}, r"must divide"),
    ]
    with pytest.raises(ConformanceError) as raised:
        check_tensor_parallel(MixerConfig, cases, lengths=(5, 3, 4), tensor_parallel=2, refused=refused)
    message = str(raised.value)
    assert "working" not in message
    assert re.search(r"^normalizes-split-channels: tensor_parallel=2: the output on rank [01] differs", message)
    assert "\nnormalizes-split-channels: tensor_parallel=2 with sequence_tensor_parallel: the output" in message
    assert "\nnormalizes-split-channels: tensor_parallel=2: decoding step 0 (3 tokens after 0) of sequence 0" in message
    # The first refusal is right; the second is refused, but not with its message; the third is not refused at all.
    assert "'channels': 5" not in message
    assert re.search(
        r"\ntensor_parallel=2: PreviousTokenConfig \{.*'channels': 3.*\} was refused with ValueError", message
    )
    assert re.search(r"\ntensor_parallel=2: PreviousTokenConfig \{.*'channels': 8.*\} was built; it should be", message)
    assert "\nWhat to fix:\nA layer that declares tensor_parallel must give" in message


@pytest.mark.distributed
def test_check_sequence_data_parallel_lists_the_problems_of_every_case(kittest):
    cases = {
        "working": {"type": "kittest.previous_token", "channels": 8},
        "forgets-the-slice-before": {"type": "kittest.false_sequence_data_parallel", "channels": 8},
    }
    with pytest.raises(ConformanceError) as raised:
        check_sequence_data_parallel(
            MixerConfig, cases, lengths=(7, 1, 4), sequence_data_parallel=2, micro_sequence_lengths=(None, 3)
        )
    message = str(raised.value)
    assert "working" not in message
    # Document 0 (tokens 0:7) straddles the ranks' slices (6:12 on rank 1) and the micro-sequences (3:6 on rank 1, 6:9
    # on rank 0): where a slice continues it, its first output differs, and the input gradient of the token before.
    plain = "forgets-the-slice-before: sequence_data_parallel=2"
    micro = f"{plain}, micro_sequence_length=3"
    assert message.startswith(f"{plain}, rank 0: the input gradient differs")
    assert f"\n{plain}, rank 1: the output differs" in message
    assert f"\n{micro}, rank 0: the output differs" in message and f"\n{micro}, rank 1: the output differs" in message
    assert "\nWhat to fix:\nA layer that declares sequence_data_parallel must give, on each rank" in message


def test_check_forward_slices_and_sequence_data_parallel_refuse_what_they_cannot_run(kittest):
    layer = build_layer(PreviousTokenConfig(channels=8))
    with pytest.raises(ValueError, match=r"slices of 5 tokens do not divide the 12 tokens of documents \[5, 1, 6\]"):
        check_forward_slices(layer, lengths=[5, 1, 6], slice_length=5, tolerance={"atol": 1e-5})
    with pytest.raises(ValueError, match="12 tokens does not split into slices of 5 tokens over 2 sequence-data-par"):
        check_sequence_data_parallel(PreviousTokenConfig, {}, lengths=(5, 1, 6), micro_sequence_lengths=(5,))
    with pytest.raises(ConformanceError, match="case 'plain': NoSlicesConfig does not declare sequence_data_parallel"):
        check_sequence_data_parallel(MixerConfig, {"plain": {"type": "kittest.no_slices"}}, lengths=(5, 1, 6))


def test_check_tensor_parallel_refuses_cases_it_cannot_split(kittest):
    cases = {"odd": {"type": "kittest.previous_token", "channels": 3}, "typo": {"type": "kittest.no_such_type"}}
    with pytest.raises(ConformanceError, match=r"(?s)case 'typo' does not structure as MixerConfig: .*unknown mixer"):
        check_tensor_parallel(MixerConfig, cases)
    with pytest.raises(ConformanceError, match=r"case 'odd' cannot be split between 2 tensor-parallel ranks: channels"):
        check_tensor_parallel(PreviousTokenConfig, {"odd": {"channels": 3}})


def test_check_matches_layer_compares_outputs_and_gradients(kittest):
    fp32 = build_layer(PreviousTokenConfig(channels=8))
    bf16 = build_layer(PreviousTokenConfig(channels=8), distributed=single_process(compute_dtype="bf16"))
    check_matches_layer(bf16, fp32, lengths=[5, 1, 6], dtype=torch.bfloat16, output_tolerance={"relative": 2e-2})
    leaky = build_layer(LeakyConfig(channels=8))  # The same parameters, but each document sees the one before.
    with pytest.raises(ConformanceError) as raised:
        check_matches_layer(leaky, fp32, lengths=[5, 1, 6], output_tolerance={"atol": 1e-5, "rtol": 1e-5})
    lines = str(raised.value).splitlines()
    assert lines[0].startswith("the output differs (max abs difference")
    assert lines[1].startswith("the input gradient differs")
    assert {line.split(" differs")[0] for line in lines[2:]} == {
        f"the gradient of {name!r}" for name in ("input.weight", "output.weight", "mix")
    }


def test_check_packed_documents_catches_state_leaking_across_documents(kittest):
    check_packed_documents(build_layer(PreviousTokenConfig(channels=8)), lengths=[5, 1, 6], tolerance={"atol": 1e-6})
    leaky = build_layer(LeakyConfig(channels=8))  # Each document's first token sees the last token of the one before.
    with pytest.raises(ConformanceError) as raised:
        check_packed_documents(leaky, lengths=[5, 1, 6], tolerance={"atol": 1e-5, "rtol": 1e-5})
    lines = str(raised.value).splitlines()
    # Document 0 has nothing before it; documents 1 and 2 differ in their output and (through the leak) the gradient
    # of the document before them; the parameters' gradients mix all three.
    assert [line.split(" differs")[0] for line in lines[:4]] == [
        "the output of document 1 (tokens 5:6 of the packed batch [5, 1, 6])",
        "the output of document 2 (tokens 6:12 of the packed batch [5, 1, 6])",
        "the input gradient of document 0 (tokens 0:5 of the packed batch [5, 1, 6])",
        "the input gradient of document 1 (tokens 5:6 of the packed batch [5, 1, 6])",
    ]
    assert {line.split(", packed vs")[0] for line in lines[4:-1]} == {
        f"the gradient of {name!r}" for name in ("input.weight", "output.weight", "mix")
    }
    assert lines[-1].startswith("Information crosses a document boundary")


def test_layer_signature_tells_whether_a_layer_changed(kittest):
    base = layer_signature(build_layer(PreviousTokenConfig(channels=8)), [5, 1, 6])
    assert not layer_signature(build_layer(PreviousTokenConfig(channels=8)), [5, 1, 6]).differs_from(base)
    # The same parameters, another output; and other parameters.
    assert layer_signature(build_layer(LeakyConfig(channels=8)), [5, 1, 6]).differs_from(base)
    assert layer_signature(build_layer(PreviousTokenConfig(channels=4)), [5, 1, 6]).differs_from(base)


def test_check_decoding_names_the_first_step_that_differs(kittest):
    steps = [(20, 9), (1, 2), (1, 1)]
    check_decoding(build_layer(PreviousTokenConfig()), tolerance={"relative": 1e-6}, lengths=[22, 12], steps=steps)
    forgetful = build_layer(ForgetfulConfig())
    with pytest.raises(ConformanceError, match=r"^decoding step 1 \(1 tokens after 20\) of sequence 0 differs \(rel"):
        check_decoding(forgetful, tolerance={"relative": 1e-6}, lengths=[22, 12], steps=steps)
    with pytest.raises(ValueError, match=r"do not add up to the sequences' lengths \[22, 13\]"):
        check_decoding(forgetful, tolerance={"relative": 1e-6}, lengths=[22, 13], steps=steps)


# ---------------------------------------------------------------------------------------------------------------------
# Through pytest, as an author sees it: shape, leak and a false tensor-parallel claim (gloo ranks)

AUTHOR_TESTS = f"""
import sys

sys.path.insert(0, {str(Path(__file__).parent)!r})
import {__name__} as kit

kit.register()


class TestWorking(type(kit.conformance("previous_token"))):
    pass


class TestWrongShape(type(kit.conformance("wrong_shape"))):
    pass


class TestLeaky(type(kit.conformance("leaky"))):
    pass


class TestFalseTensorParallel(type(kit.conformance("false_tensor_parallel"))):
    pass


class TestFalseSequenceDataParallel(type(kit.conformance("false_sequence_data_parallel"))):
    pass
"""


@pytest.mark.distributed
def test_pytest_reports_broken_plugins_with_what_to_fix(pytester):
    path = pytester.makepyfile(test_author=AUTHOR_TESTS)
    checks = ["test_output_shape_and_dtype", "test_packed_documents_equal_separate_runs"]
    checks.append("test_tensor_parallel_matches_one_process")
    selected = [f"{path.name}::TestWorking::{check}" for check in checks] + [
        f"{path.name}::TestWrongShape::{checks[0]}",
        f"{path.name}::TestLeaky::{checks[1]}",
        f"{path.name}::TestFalseTensorParallel::{checks[2]}",
    ]
    result = pytester.runpytest_subprocess(*selected, "-p", "no:cacheprovider", "--strict-markers", timeout=300)
    result.assert_outcomes(passed=3, failed=3)
    output = result.stdout.str()
    assert "FAILED test_author.py::TestWrongShape::test_output_shape_and_dtype" in output
    assert "FAILED test_author.py::TestLeaky::test_packed_documents_equal_separate_runs" in output
    assert "has shape (12, 8), expected (12, 16) = [tokens, hidden]" in output
    assert "Information crosses a document boundary" in output
    # Both tensor-parallel layouts, the outputs and the gradients, then what to fix, once each.
    assert re.search(
        r"ConformanceError: config_factory\(\): tensor_parallel=2: the output on rank [01] differs \(max abs", output
    )
    assert re.search(
        r"\nE +config_factory\(\): tensor_parallel=2 with sequence_tensor_parallel: the output on rank", output
    )
    assert re.search(r"\nE +config_factory\(\): tensor_parallel=2: the gradient of 'input.weight' differs", output)
    assert re.search(
        r"\nE +What to fix:\nE +A layer that declares tensor_parallel must give the single-process", output
    )
    # pytest repeats whole messages in its summary when it sees a CI environment: count in the reports only.
    reports = output.split("short test summary info")[0]
    assert reports.count("A layer that declares tensor_parallel must give") == 1
    assert "terminated with the following error" not in output  # the ranks' findings, not their tracebacks


@pytest.mark.distributed
def test_pytest_reports_a_false_sequence_data_parallel_claim(pytester):
    path = pytester.makepyfile(test_author=AUTHOR_TESTS)
    checks = ["test_forward_slices_equal_the_whole_forward", "test_sequence_data_parallel_matches_one_process"]
    selected = [
        f"{path.name}::{kind}::{check}" for kind in ("TestWorking", "TestFalseSequenceDataParallel") for check in checks
    ]
    result = pytester.runpytest_subprocess(*selected, "-p", "no:cacheprovider", "--strict-markers", timeout=300)
    result.assert_outcomes(passed=2, failed=2)
    output = result.stdout.str()
    assert "FAILED test_author.py::TestFalseSequenceDataParallel::test_forward_slices_equal_the_whole_forward" in output
    assert (
        "FAILED test_author.py::TestFalseSequenceDataParallel::test_sequence_data_parallel_matches_one_process"
        in output
    )
    assert "ConformanceError: slices of 1 tokens: the output differs" in output
    assert "Over slices of sequences, forward_slice(hidden, batch, previous) must give what the whole forward" in output
    # The generated documents straddle every rank's boundary: one slice a rank over 2 ranks fails already.
    assert re.search(
        r"ConformanceError: config_factory\(\): sequence_data_parallel=2, documents \[[\d, ]+\], rank 0: the input",
        output,
    )
    assert re.search(r"\nE +config_factory\(\): sequence_data_parallel=4, micro_sequence_length=3, documents", output)
    assert re.search(r"\nE +What to fix:\nE +A layer that declares sequence_data_parallel must give", output)
    assert "terminated with the following error" not in output


# ---------------------------------------------------------------------------------------------------------------------
# The pytest plugin itself: loaded through `pytest11`, cheap, and changes nothing for other projects


def test_the_pytest_plugin_is_loaded_without_torch(pytester):
    pytester.makepyfile(
        test_other_project="""
        import sys

        import pytest


        @pytest.mark.distributed
        def test_nothing_of_blockzoo_is_imported_but_the_plugin():
            assert "blockzoo_testing.pytest_plugin" in sys.modules
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    # Disabled, its marker is unknown again: the marker came from the plugin.
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider", "-p", "no:blockzoo")
    assert "'distributed' not found in `markers` configuration option" in result.stdout.str()


def test_blockzoo_registry_fixture_forgets_what_a_test_registered(pytester):
    pytester.makepyfile(
        test_registry="""
        from blockzoo.plugins import get_registry, register_plugin


        class Empty:
            pass


        def test_registers(blockzoo_registry):
            register_plugin(Empty(), "scratch")
            assert "scratch" in blockzoo_registry.plugins


        def test_forgotten():
            assert "scratch" not in get_registry().plugins
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
