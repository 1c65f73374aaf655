"""blockzoo's conformance kit (`blockzoo_testing`) on the Mamba 1 mixer, in its standard and its grouped (xb_size)
layout: discovery, config, shapes, meta-device construction, packed documents, every field, gradients, tensor and
sequence-tensor parallel, decoding, checkpoints and FLOPs, as any plugin's mixer is checked."""

from blockzoo_testing import MixerConformance

GROUPED_ONLY = "grouped layout only (xb_size set): TestGroupedMambaConformance checks it"


class TestMambaConformance(MixerConformance):
    # inner_size and expand exclude each other: the change of expand drops inner_size.
    field_changes = {"expand": {"inner_size": None, "expand": 1}}
    field_exceptions = {name: GROUPED_ONLY for name in ("b", "c", "dt_in_proj", "repeat_xb_before_convolution")}

    def config_factory(self):
        return {"type": "mamba", "state_size": 4, "inner_size": 8, "dt_rank": 2}


class TestGroupedMambaConformance(MixerConformance):
    # expand 1 would give the same inner size (16) as the base with hidden size 16.
    field_changes = {"expand": {"inner_size": None, "expand": 2}}
    field_exceptions = {"x_proj": "standard layout only: TestMambaConformance checks it"}

    def config_factory(self):
        # Two x/B heads of state_size channels, each shared by two C heads.
        return {"type": "mamba", "state_size": 4, "inner_size": 16, "xb_size": 8, "dt_rank": 2}
