"""LoRA's config (`peft: {type: lora, ...}`). Torch-free."""

from __future__ import annotations

from blockzoo.config import at_least, check, configclass, field, greater_than
from blockzoo.peft.config import PeftConfig


@configclass
class LoraConfig(PeftConfig):
    """LoRA: each adapted linear's output gains `(alpha / rank) · B A x`, A `[rank, in]`, B `[out, rank]` (zeros at
    first), for each enabled component of a concatenated linear its own A and B. Base weights are frozen."""

    rank: int = field(8, doc="Rank of the update B A.", validator=at_least(1))
    alpha: float = field(16.0, doc="The update is scaled by alpha / rank.", validator=greater_than(0))
    dropout: float = field(0.0, doc="Dropout on the adapter's input (training only).", validator=at_least(0))

    def __attrs_post_init__(self) -> None:
        check(self.dropout < 1, "dropout", f"must be < 1, got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
