"""FP8 training (`training.fp8`) through torchao's float8 training: no FP8 GEMM of our own.

`prepare_fp8(model, run_config)` runs where the model is prepared for its layout (`blockzoo.distributed.parallelize`),
before compilation and FSDP2 wrapping, and is imported only when `training.fp8` is set. Each of the model's `Linear`s
whose config keeps `fp8: true` computes its products with torchao's `matmul_with_hp_or_float8_args`, the autograd
function of torchao's `Float8Linear`, configured from the same `Float8LinearConfig` recipe (its `LinearMMConfig` taken
from a `Float8Linear` built on the meta device): forward, input gradient and weight gradient as scaled FP8 GEMMs
(`torch._scaled_mm`), the casts and scales torchao's.

Why not `convert_to_float8_training`: it swaps `nn.Linear` modules, and ours are not (a linear carries its
tensor-parallel collectives and its PEFT adapter around the product, which only the product changes here). The
parameters stay where they are, in their dtype (fp32 master weights): optimizer and checkpoints see nothing of FP8.

- FSDP2 (ZeRO): with the tensorwise recipe (`all_gather`), each converted weight becomes torchao's
  `WeightWithDynamicFloat8CastTensor` before FSDP wraps it, so FSDP gathers it in FP8 (torchao's float8 all-gather).
- Tensor parallelism: our collectives move bf16 activations around each rank's local product, and each local product
  is an FP8 GEMM with its own operands' scales (torchao's float8 tensor parallelism needs DTensor modules, which ours
  are not, so the collectives stay in the compute dtype). The shapes checked are the local ones.
- `training.compile`: compiled blocks trace through torchao's autograd function (its casts fuse into the blocks).
- Refused: no torchao (blockzoo[fp8]); a GPU without FP8 tensor cores (compute capability below 8.9) or a CPU,
  unless `emulate`; a linear whose local dims torchao's GEMM cannot take (not multiples of 16), by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from blockzoo.errors import UsageError
from blockzoo.training.fp8_config import FP8Config

FP8_MINIMUM_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: the first with FP8 tensor cores
SHAPE_MULTIPLE = 16  # torch._scaled_mm's requirement on both dims of each FP8 operand


def import_torchao() -> Any:
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as error:
        raise UsageError(f"training.fp8 needs torchao ({error}): pip install 'blockzoo[fp8]' (torchao>=0.18)") from None
    return float8


def check_device(device: torch.device, config: FP8Config) -> None:
    """FP8 GEMMs need FP8 tensor cores: refused on a CPU or an older GPU, naming it, unless `emulate`."""
    if config.emulate:
        return
    if device.type != "cuda":
        raise UsageError(
            f"training.fp8: FP8 training needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or above), "
            f"this run is on {device.type}; training.fp8.emulate=true runs torchao's emulation (slow, for tests)"
        )
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MINIMUM_CAPABILITY:
        raise UsageError(
            f"training.fp8: {torch.cuda.get_device_name(device)} has compute capability "
            f"{capability[0]}.{capability[1]}, without FP8 tensor cores (8.9 or above: Ada, Hopper, Blackwell); "
            "train in bf16 (remove training.fp8) or set training.fp8.emulate=true to test"
        )


def compile_options() -> dict:
    """Inductor's options for compiling blocks whose products are FP8. Inductor's mix-order reductions (the RMSNorm
    backward's row and column sums in one kernel) would also take the FP8 cast of the recomputed norm output, which
    the weight gradient's GEMM needs transposed: stored a byte at a time across rows, that kernel took 1.23 ms instead
    of about 0.2 ms a layer on an H100, and the Llama-1B step was 4 % slower."""
    if not hasattr(torch._inductor.config.triton, "mix_order_reduction"):  # a torch without them
        return {}
    return {"triton.mix_order_reduction": False}


def float8_config(config: FP8Config, *, gathers_fp8: bool) -> Any:
    """torchao's `Float8LinearConfig` of the recipe, with our emulation and FSDP float8 all-gather choices."""
    float8 = import_torchao()
    recipe = float8.Float8LinearConfig.from_recipe_name(config.recipe)
    return dataclasses.replace(recipe, emulate=config.emulate, enable_fsdp_float8_all_gather=gathers_fp8)


class Float8Product:
    """`F.linear(input, weight, bias)` as torchao's `Float8Linear.forward` computes it: the product through
    `matmul_with_hp_or_float8_args` (FP8 casts of both operands, scaled GEMMs forward and backward), the bias added
    in the output's dtype. The weight is passed in its own dtype, never cast first."""

    def __init__(self, config: Any):
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        with torch.device("meta"):  # torchao builds the GEMM configs from the recipe; the module itself is unused
            template = Float8Linear(SHAPE_MULTIPLE, SHAPE_MULTIPLE, bias=False, config=config)
        self.config, self.mm_config = config, template.linear_mm_config
        self.matmul = matmul_with_hp_or_float8_args  # held here: no import inside what torch.compile traces

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        output = self.matmul.apply(input, weight.t(), self.mm_config, self.config)
        return output if bias is None else output + bias.to(output.dtype)


def converted_linears(model: nn.Module) -> list[nn.Module]:
    """The model's linears that FP8 takes: those whose configs all keep `fp8: true`, each checked for its local
    shape (a `UsageError` naming every one torchao cannot take)."""
    from blockzoo.layers.linear import Linear

    linears = [module for module in model.modules() if isinstance(module, Linear) and module.fp8]
    refused = [
        linear
        for linear in linears
        if linear.weight.shape[0] % SHAPE_MULTIPLE or linear.weight.shape[1] % SHAPE_MULTIPLE
    ]
    if refused:
        # decoder.<index>.<path in the block> -> the block config's field (a `fixed` decoder's `block`)
        example = refused[0].name.split(".", 2)[-1]
        raise UsageError(
            f"training.fp8: torchao's FP8 GEMMs need both dims of a linear's weight (this rank's part under tensor "
            f"parallelism) to be multiples of {SHAPE_MULTIPLE}, and these are not: "
            + ", ".join(f"{linear.name} ({linear.weight.shape[1]} -> {linear.weight.shape[0]})" for linear in refused)
            + f"; set `fp8: false` in each one's linear config (e.g. model.decoder.block.{example}.fp8=false) to keep "
            "it in the compute dtype"
        )
    return linears


def prepare_fp8(model: nn.Module, run_config: Any) -> int:
    """Make the model's linears compute in FP8 (module docstring), in place, before compilation and FSDP2. Returns
    how many linears were converted."""
    from blockzoo.distributed.data_parallel import uses_data_parallel_sharding

    config: FP8Config = run_config.training.fp8
    distributed = model.distributed
    if config.emulate and run_config.training.compile != "none":
        raise UsageError(
            "training.fp8.emulate: torchao's emulation does not run under torch.compile; set training.compile=none "
            "to test FP8 with emulation"
        )
    check_device(distributed.device, config)
    gathers_fp8 = config.gathers_fp8 and uses_data_parallel_sharding(distributed)
    torchao_config = float8_config(config, gathers_fp8=gathers_fp8)
    product = Float8Product(torchao_config)
    linears = converted_linears(model)
    for linear in linears:
        linear.float8 = product
        if gathers_fp8:
            _gather_in_fp8(linear, product)
    return len(linears)


def _gather_in_fp8(linear: nn.Module, product: Float8Product) -> None:
    """The weight as torchao's `WeightWithDynamicFloat8CastTensor` (what `Float8Linear.from_float` does under FSDP
    float8 all-gather): FSDP2 then gathers its FP8 cast. Its dtype and values are the weight's; our parameter
    metadata goes with it."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = linear.weight
    wrapped = nn.Parameter(
        WeightWithDynamicFloat8CastTensor(
            weight.data, product.mm_config, product.config.cast_config_weight.target_dtype
        ),
        requires_grad=weight.requires_grad,
    )
    wrapped.__dict__.update(weight.__dict__)  # `meta` (blockzoo.layers.parameter.ParameterMeta) and the like
    linear.weight = wrapped
