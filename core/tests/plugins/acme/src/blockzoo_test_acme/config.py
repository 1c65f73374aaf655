"""A working third-party mixer config: torch-free, as every plugin's config module must be."""

from blockzoo.api import MixerConfig, at_least, configclass, field


@configclass
class ShiftMixerConfig(MixerConfig):
    """Each token sees the token `shift` positions before it (a toy mixer)."""

    shift: int = field(1, doc="How far back to look.", validator=at_least(0))
