"""`training.fp8`: FP8 training through torchao's float8, on the CPU with torchao's emulation (the FP8 casts and
scales as on a GPU, the products in high precision)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

pytest.importorskip("torchao.float8", reason="torchao (blockzoo[fp8]) is not installed here")

from blockzoo import cli
from blockzoo.checkpoint import latest_checkpoint
from blockzoo.config import load
from blockzoo.distributed.fp8 import Float8Product, check_device, float8_config
from blockzoo.errors import UsageError
from blockzoo.layers.linear import Linear
from blockzoo.run_config import RunConfig
from blockzoo.training.fp8_config import FP8Config
from blockzoo.training.trainer import Trainer

# A Llama-like model whose linears torchao takes (every dim a multiple of 16): 5 linears a block.
MODEL = {
    "hidden_size": 64,
    "embeddings": {"vocab_size": 257},
    "decoder": {
        "num_blocks": 2,
        "block": {
            "mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 16},
            "mlp": {"type": "mlp", "intermediate_size": 128, "gated": True, "activation": "silu"},
        },
    },
}
LINEARS = 10
BASE = {
    "model": MODEL,
    "distributed": {"backend": "gloo", "compute_dtype": "bf16"},
    "data": {"type": "embedded", "sequence_length": 64, "micro_batch_size": 2, "num_documents": 8},
    "training": {
        "train_iters": 4,
        "optimizer": {"learning_rate": 0.003},
        "schedule": {"decay": "constant"},
        "log_interval": 1,
    },
}
EMULATED = "training.fp8={recipe: tensorwise, emulate: true}"
FP8_TENSOR_CORES = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)


def configure(output_dir: Path, *overrides: str) -> RunConfig:
    return load(RunConfig, data=BASE, overrides=[f"training.output_dir={output_dir}", *overrides])


def run(output_dir: Path, *overrides: str) -> tuple[Trainer, list[float]]:
    trainer = Trainer(configure(output_dir, *overrides), log=lambda _: None)
    return trainer, [record.loss for record in trainer.run()]


def linears(trainer: Trainer) -> dict[str, Linear]:
    return {module.name: module for module in trainer.model.modules() if isinstance(module, Linear)}


# -- the product -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_product_is_torchaos_float8_linear(recipe):
    """Our FP8 product of an fp32 weight and bf16 activations gives torchao's own Float8Linear's output and
    gradients, bit for bit (the same autograd function, the same GEMM configs)."""
    from torchao.float8.float8_linear import Float8Linear

    config = float8_config(FP8Config(recipe=recipe, emulate=True), gathers_fp8=False)
    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(48, 64, generator=generator) * 0.1)
        reference.bias.copy_(torch.randn(48, generator=generator))
    theirs = Float8Linear.from_float(reference, config=config)
    weight = reference.weight.detach().clone().requires_grad_()
    bias = reference.bias.detach().clone().requires_grad_()
    inputs = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    ours_input, their_input = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    output = Float8Product(config)(ours_input, weight, bias.to(torch.bfloat16))
    expected = theirs(their_input)
    grad = torch.randn_like(output)
    output.backward(grad)
    expected.backward(grad)
    assert output.dtype == torch.bfloat16 and torch.equal(output, expected)
    assert torch.equal(ours_input.grad, their_input.grad) and torch.equal(weight.grad, theirs.weight.grad)
    assert weight.grad.dtype == torch.float32  # the master weight's gradient stays in its dtype
    # FP8 it is: the product differs from the bf16 one by FP8's rounding, not by bf16's
    plain = torch.nn.functional.linear(
        inputs, reference.weight.detach().to(torch.bfloat16), reference.bias.to(torch.bfloat16)
    )
    difference = float((output.float() - plain.float()).norm() / plain.float().norm())
    assert 1e-3 < difference < 0.1


def test_a_split_product_scales_each_part_as_its_own_float8_linear(tmp_path):
    """`Linear.forward_split` under FP8 (the gated MLP's gate and up): each part is torchao's Float8Linear of that
    part's rows of the weight, scaled on its own (as separate gate and up projections are), outputs and gradients
    bit for bit."""
    from torchao.float8.float8_linear import Float8Linear

    trainer = Trainer(configure(tmp_path, EMULATED), log=lambda _: None)
    gate_up = next(linear for name, linear in linears(trainer).items() if name.endswith("gate_up"))
    size = gate_up.weight.shape[0] // 2
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(40, gate_up.weight.shape[1], generator=generator).to(torch.bfloat16)
    grads = [torch.randn(40, size, generator=generator).to(torch.bfloat16) for _ in range(2)]
    ours_input = inputs.clone().requires_grad_()
    parts = gate_up.forward_split(ours_input, size)
    torch.autograd.backward(parts, grads)
    their_input_grads = []
    for index, (part, grad) in enumerate(zip(parts, grads)):
        reference = torch.nn.Linear(gate_up.weight.shape[1], size, bias=False)
        with torch.no_grad():
            reference.weight.copy_(gate_up.weight[index * size : (index + 1) * size])
        theirs = Float8Linear.from_float(reference, config=gate_up.float8.config)
        their_input = inputs.clone().requires_grad_()
        expected = theirs(their_input)
        expected.backward(grad)
        assert torch.equal(part, expected)
        assert torch.equal(gate_up.weight.grad[index * size : (index + 1) * size], theirs.weight.grad)
        their_input_grads.append(their_input.grad)
    assert torch.equal(ours_input.grad, their_input_grads[0] + their_input_grads[1])


# -- training ----------------------------------------------------------------------------------------------------------


def test_fp8_converts_every_linear_but_those_opted_out_and_checkpoints_stay_fp32(tmp_path):
    trainer, losses = run(tmp_path / "run", EMULATED, "model.decoder.block.mixer.dense.fp8=false")
    converted = {name for name, linear in linears(trainer).items() if linear.float8 is not None}
    assert len(linears(trainer)) == LINEARS
    assert converted == {name for name in linears(trainer) if not name.endswith("mixer.dense")}
    assert all(math.isfinite(loss) for loss in losses)
    checkpoint = latest_checkpoint(tmp_path / "run")
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as weights:
        dtypes = {name: weights.get_tensor(name).dtype for name in weights.keys()}  # noqa: SIM118
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["training"]["fp8"]["recipe"] == "tensorwise"


PARALLEL_CASES = {
    "zero_3": ["data.micro_batch_size=2", "distributed.zero_stage=3"],
    "tensor_parallel": ["data.micro_batch_size=4", "distributed.tensor_parallel=2"],
}
PARALLEL_COMMON = [EMULATED, "training.train_iters=3"]


def _parallel_fp8_runs(root: str) -> None:
    import json

    import torch.distributed as dist
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from blockzoo.distributed.runtime import Distributed

    dist.init_process_group("gloo")
    try:
        for name, overrides in PARALLEL_CASES.items():
            config = configure(Path(root) / name, *PARALLEL_COMMON, *overrides)
            with Distributed(config.distributed) as distributed:
                trainer = Trainer(config, distributed=distributed, log=lambda _: None)
                history = trainer.run()
            weights = [linear.weight for linear in linears(trainer).values()]
            gathered = [isinstance(getattr(w, "_local_tensor", w), WeightWithDynamicFloat8CastTensor) for w in weights]
            if dist.get_rank() == 0:
                result = {"losses": [record.loss for record in history], "fp8_gathered": gathered}
                (Path(root) / f"{name}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fp8_under_zero_3_and_tensor_parallelism_trains_as_one_process(tmp_path):
    """2 ranks: ZeRO 3 (the converted weights gathered in FP8: torchao's all-gather tensors under FSDP2) and tensor
    parallelism (each rank's local products in FP8); each run's losses near the one-process FP8 run's (the FP8
    scales are per rank's operands, so not bit-identical), its checkpoint fp32."""
    import json

    from blockzoo_testing.distributed import run_distributed

    run_distributed(2, _parallel_fp8_runs, str(tmp_path))
    _, expected = run(tmp_path / "single", *PARALLEL_COMMON, "data.micro_batch_size=4")
    for name in PARALLEL_CASES:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["losses"] == pytest.approx(expected, rel=0.01), name
        assert all(result["fp8_gathered"]) == (name == "zero_3"), name
        with safe_open(str(latest_checkpoint(tmp_path / name) / "model.safetensors"), framework="pt") as weights:
            assert {weights.get_tensor(key).dtype for key in weights.keys()} == {torch.float32}, name  # noqa: SIM118


def fp8_against_bf16(tmp_path: Path, recipe: str, steps: int) -> tuple[list[float], list[float]]:
    overrides = [f"training.train_iters={steps}", "training.log_interval=10"]
    _, bf16 = run(tmp_path / "bf16", *overrides)
    _, fp8 = run(tmp_path / recipe, f"training.fp8={{recipe: {recipe}, emulate: true}}", *overrides)
    return bf16, fp8


# The stated tolerance: each step's FP8 loss within 3 % of the bf16 run's (FP8 rounds each operand to 3 mantissa bits,
# bf16 to 8; measured on this model: at most about 1 % over 50 steps).
LOSS_TOLERANCE = 0.03


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_losses_stay_within_tolerance_of_bf16_for_50_steps(tmp_path, recipe):
    bf16, fp8 = fp8_against_bf16(tmp_path, recipe, 50)
    assert len(fp8) == len(bf16) == 50
    assert fp8 == pytest.approx(bf16, rel=LOSS_TOLERANCE)
    assert fp8 != bf16  # FP8 did run: the losses are not bf16's
    assert fp8[-1] < fp8[0] - 1.0  # and it learns as bf16 does


def test_fp8_losses_stay_within_tolerance_of_bf16_for_a_few_steps(tmp_path):
    bf16, fp8 = fp8_against_bf16(tmp_path, "tensorwise", 5)
    assert fp8 == pytest.approx(bf16, rel=LOSS_TOLERANCE) and fp8 != bf16


# -- refusals ----------------------------------------------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, "training": {**BASE["training"], "output_dir": str(tmp_path / "run")}}))
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.fp8={recipe: tensorwise}"], "needs a CUDA GPU with FP8 tensor cores"),
        (
            [EMULATED, "model.decoder.block.mlp.intermediate_size=40"],
            "decoder.0.mlp.down (40 -> 64), decoder.1.mlp.down (40 -> 64); set `fp8: false` in each one's linear "
            "config (e.g. model.decoder.block.mlp.down.fp8=false)",
        ),
        ([EMULATED, "training.compile=blocks"], "emulation does not run under torch.compile"),
        (["training.fp8={recipe: rowwise, all_gather: true, emulate: true}"], "all_gather"),
        (["training.fp8={recipe: sometimes}"], "recipe"),
    ],
)
def test_the_train_command_refuses_what_fp8_cannot_do_with_exit_2(tmp_path, capsys, overrides, message):
    assert cli.main(["train", str(write_config(tmp_path)), *overrides]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert latest_checkpoint(tmp_path / "run") is None


def test_the_train_command_names_the_missing_torchao(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)  # as if not installed
    assert cli.main(["train", str(write_config(tmp_path)), EMULATED]) == 2
    assert "pip install 'blockzoo[fp8]'" in capsys.readouterr().err


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UsageError, match=r"NVIDIA A100-SXM4-80GB has compute capability 8\.0, without FP8"):
        check_device(torch.device("cuda", 0), FP8Config())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_device(torch.device("cuda", 0), FP8Config())  # an H100/H200: taken
    check_device(torch.device("cuda", 0), FP8Config(emulate=True))


@pytest.mark.gpu
@FP8_TENSOR_CORES
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_a_gpu_trains_as_bf16_compiled(tmp_path, recipe):
    """On FP8 tensor cores (torch._scaled_mm, no emulation), compiled blocks: 30 steps within the tolerance of the
    compiled bf16 run."""
    common = [
        "distributed.backend=nccl",
        "training.compile=blocks",
        "training.train_iters=30",
        "training.log_interval=10",
    ]
    _, bf16 = run(tmp_path / "bf16", *common)
    trainer, fp8 = run(tmp_path / recipe, *common, f"training.fp8={{recipe: {recipe}}}")
    assert sum(linear.float8 is not None for linear in linears(trainer).values()) == LINEARS
    assert fp8 == pytest.approx(bf16, rel=LOSS_TOLERANCE) and fp8 != bf16


@pytest.mark.gpu
@FP8_TENSOR_CORES
def test_fp8_blocks_compile_without_mix_order_reductions(tmp_path, monkeypatch):
    """Inductor's mix-order reduction would fuse the FP8 cast of the recomputed norm output, stored transposed, into
    the norm's backward (slow: see `compile_options`). At a shape where inductor makes one (16384 rows of 512), the
    FP8 blocks compile without, and the same blocks compiled with inductor's defaults have one."""
    from torch._inductor import metrics

    from blockzoo.distributed import fp8

    wide = [
        "model.hidden_size=512",
        "model.decoder.block.mixer.heads=8",
        "model.decoder.block.mixer.head_size=64",
        "model.decoder.block.mlp.intermediate_size=1024",
        "data.sequence_length=4096",
        "data.micro_batch_size=4",
        "data.num_documents=100",
        "distributed.backend=nccl",
        "training.compile=blocks",
        "training.train_iters=1",
        "training.fp8={recipe: tensorwise}",
    ]
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # count what codegen makes

    def mix_order_kernels(output_dir: Path) -> int:
        torch._dynamo.reset()
        metrics.reset()
        run(output_dir, *wide)
        return metrics.codegen_mix_order_reduction

    assert mix_order_kernels(tmp_path / "ours") == 0
    monkeypatch.setattr(fp8, "compile_options", lambda: {})
    assert mix_order_kernels(tmp_path / "defaults") > 0
