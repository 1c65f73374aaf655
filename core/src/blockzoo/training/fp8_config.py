"""`training.fp8`: FP8 training through torchao's float8 (see docs/fp8.md). Torch-free."""

from __future__ import annotations

from typing import Literal

from blockzoo.config import Config, check, configclass, field


@configclass
class FP8Config(Config):
    """Each linear layer's three products (forward, input gradient, weight gradient) as FP8 GEMMs with torchao's float8
    training; the parameters, optimizer and checkpoints stay in their dtype (FP8 is a compute choice). A linear whose
    config says `fp8: false` keeps the compute dtype; the embeddings, the output head and MoE experts always do."""

    recipe: Literal["tensorwise", "rowwise"] = field(
        "tensorwise",
        doc="torchao's scaling recipe: `tensorwise` (one scale per tensor: the fastest, torchtitan's published "
        "figures) or `rowwise` (one scale per row: closer to bf16, slower).",
    )
    all_gather: bool | None = field(
        None,
        doc="Under ZeRO (FSDP2), gather the linears' weights in FP8 (torchao's float8 all-gather: a quarter of fp32's "
        "traffic); tensorwise only. None: on with tensorwise.",
    )
    emulate: bool = field(
        False,
        doc="torchao's emulation: the FP8 casts and scales, the products in high precision. For testing on a CPU or "
        "a GPU without FP8 tensor cores (compute capability below 8.9, where FP8 is refused otherwise); slow, and "
        "not with `training.compile`.",
    )

    def __attrs_post_init__(self) -> None:
        check(
            not (self.all_gather and self.recipe != "tensorwise"),
            "all_gather",
            f"torchao gathers FP8 weights with the tensorwise recipe only, the recipe is {self.recipe}",
        )

    @property
    def gathers_fp8(self) -> bool:
        return self.recipe == "tensorwise" if self.all_gather is None else self.all_gather
