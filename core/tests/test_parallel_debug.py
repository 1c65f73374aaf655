"""Debugging and safety of parallel runs: the debug mode (`blockzoo.distributed.debug`) names the first layer whose
tensor-parallel claim is false, forward or backward, and leaves a correct model's results bit for bit those of the
run without it; the check after each step names a parameter that drifted; ranks that run different configs or
plugins refuse to start (`blockzoo.distributed.consistency`); the process group is destroyed however the CLI's
`train` ends.

The core has no mixer, so a test plugin registered in-process provides one: a gated MLP used as a mixer (a
column-parallel `up`, a replicated `gate` inside the tensor region, a row-parallel `down`) that can be told to break
its claim (`fault`), and a plain column/row MLP. One spawn of two gloo ranks runs every multi-process case.
"""

import logging
import os
import types
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from blockzoo import cli
from blockzoo.api import (
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    LinearConfig,
    MixerConfig,
    MLPConfig,
    NormalInitializationConfig,
    configclass,
    field,
    hookimpl,
)
from blockzoo.config import structure, update
from blockzoo.distributed import debug
from blockzoo.distributed.check import ParallelMismatchError
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.consistency import check_ranks_agree
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.layers.base import MLP, Batch, Mixer
from blockzoo.layers.config import ResolvedParameter
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.layers.parameter import create_parameter
from blockzoo.model.language_model import LanguageModel
from blockzoo.plugins import register_plugin, reset_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import free_port, run_distributed

# ---------------------------------------------------------------------------------------------------------------------
# The test plugin


@configclass
class GatedMixerConfig(MixerConfig):
    """down(silu(up(x)) * sigmoid(gate(x))); `fault` breaks its tensor-parallel claim on purpose."""

    capabilities = frozenset({TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL})
    inner_size: int = field(8, doc="Split between tensor-parallel ranks.")
    # output_offset: adds tensor_rank * 1e-3 to its output (forward). missing_backward_reduction: its input enters
    # the tensor region without the all-reduce of its gradient (backward: each rank's input gradient is partial).
    fault: Literal["none", "output_offset", "missing_backward_reduction"] = field("none", doc="The planted bug.")


@configclass
class PlainMLPConfig(MLPConfig):
    capabilities = frozenset({TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL})
    inner_size: int = field(12, doc="Split between tensor-parallel ranks.")


def _linear(name, input_dim, output_dim, distributed, lr_scale, **options) -> Linear:
    initialization = NormalInitializationConfig(std=0.3)
    return Linear(
        name,
        LinearConfig(),
        input_dim,
        output_dim,
        distributed,
        default_initialization=initialization,
        lr_scale=lr_scale,
        **options,
    )


class GatedMixer(Mixer):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        inner = TensorDim("inner", config.inner_size, parallel=True)
        self.up = _linear(f"{name}.up", hidden_dim, inner, distributed, lr_scale)
        self.gate = _linear(
            f"{name}.gate", hidden_dim, TensorDim("gate", 1), distributed, lr_scale, inside_tensor_region=True
        )
        self.down = _linear(f"{name}.down", inner, hidden_dim, distributed, lr_scale)

    def forward(self, hidden, batch, state=None):
        if self.config.fault == "missing_backward_reduction":
            up = F.linear(hidden, self.up.weight.to(hidden.dtype))  # should enter through copy_to_tensor_region
        else:
            up = self.up(hidden)
        output = self.down(F.silu(up) * torch.sigmoid(self.gate(hidden)))
        if self.config.fault == "output_offset":
            output = output + self.distributed.tensor_rank * 1e-3
        return output

    def flops(self, batch):
        linears = (self.up, self.gate, self.down)
        return tuple(
            sum(getattr(linear, f"{d}_flops")(batch.num_tokens) for linear in linears) for d in ("forward", "backward")
        )


class PlainMLP(MLP):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        inner = TensorDim("inner", config.inner_size, parallel=True)
        self.up = _linear(f"{name}.up", hidden_dim, inner, distributed, lr_scale)
        self.down = _linear(f"{name}.down", inner, hidden_dim, distributed, lr_scale)

    def forward(self, hidden, batch, state=None):
        return self.down(torch.tanh(self.up(hidden)))

    def flops(self, batch):
        linears = (self.up, self.down)
        return tuple(
            sum(getattr(linear, f"{d}_flops")(batch.num_tokens) for linear in linears) for d in ("forward", "backward")
        )


@hookimpl
def _register_mixers(register):
    register("debugtest.gated", GatedMixerConfig, f"{__name__}:GatedMixer")


@hookimpl
def _register_mlps(register):
    register("debugtest.plain", PlainMLPConfig, f"{__name__}:PlainMLP")


def _register_test_plugin() -> None:
    register_plugin(types.SimpleNamespace(register_mixers=_register_mixers, register_mlps=_register_mlps), "debugtest")


@pytest.fixture(autouse=True)
def test_plugin(fresh_registry):
    _register_test_plugin()


RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
VOCAB, TOKENS = 32, 16


def _block(fault: str = "none") -> dict:
    return {
        "mixer": {"type": "debugtest.gated", "fault": fault},
        "mlp": {"type": "debugtest.plain"},
        "normalization": RANDOM_NORM,
    }


def _model(fault: str = "none") -> dict:
    """Three blocks, the middle one with the planted `fault`."""
    return {
        "hidden_size": 16,
        "tied_embedding_weight": False,
        "embeddings": {"vocab_size": VOCAB},
        "decoder": {
            "type": "pattern",
            "pattern": ["good", "suspect", "good"],
            "blocks": {"good": _block(), "suspect": _block(fault)},
        },
        "head": {"normalization": RANDOM_NORM},
    }


def _run_config(fault: str = "none", **distributed) -> RunConfig:
    data = {
        "model": _model(fault),
        "distributed": {"seed": 77, "backend": "gloo", "timeout": 60, **distributed},
        "data": {"type": "random", "sequence_length": TOKENS, "micro_batch_size": 1},
        "training": {"train_iters": 4},
    }
    return structure(data, RunConfig)


def _micro_batch(step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor, Batch]:
    generator = torch.Generator().manual_seed(1000 * step + data_rank)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return tokens, labels, Batch([5, 3, 8])


def _train(run_config: RunConfig, distributed: Distributed, *, steps: int, with_debug: bool, drift=None):
    """`steps` AdamW steps; the losses (summed over the tensor group's token shards) and the final global weights.
    `drift(model, step)` may change the model after a step, before the debug check."""
    model = LanguageModel(run_config.model, distributed)
    hooks = debug.install(model, distributed) if with_debug else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(1, steps + 1):
        tokens, labels, batch = _micro_batch(step, distributed.data_rank)
        cross_entropy, _ = model.loss(tokens, labels, batch)
        (cross_entropy / TOKENS).backward()
        distributed.reduce_replicated_gradients(model.parameters())
        if distributed.data_group is not None:
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad, group=distributed.data_group)
        optimizer.step()
        if drift is not None:
            drift(model, step)
        if with_debug:
            debug.after_step(model, distributed, step)
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy.detach()
        if distributed.sequence_tensor_parallel:
            dist.all_reduce(loss, group=distributed.tensor_group)
        losses.append(float(loss))
    weights = {
        name: parameter.meta.local_to_global(parameter.detach(), distributed.tensor_group)
        for name, parameter in model.named_parameters()
    }
    return losses, weights, hooks


# ---------------------------------------------------------------------------------------------------------------------
# One process


def test_debug_mode_without_tensor_parallelism_has_nothing_to_compare():
    distributed = Distributed(DistributedConfig(seed=1, backend="gloo"), world_size=1, rank=0, local_rank=0)
    run_config = _run_config()
    plain, _, _ = _train(run_config, distributed, steps=2, with_debug=False)
    checked, _, hooks = _train(run_config, distributed, steps=2, with_debug=True)
    assert checked == plain
    assert hooks.checked == {"forward": 0, "backward": 0}


def test_what_a_linear_shares_follows_its_layout():
    distributed = Distributed(DistributedConfig(seed=1, backend="gloo"), world_size=1, rank=0, local_rank=0)
    hidden, split = TensorDim("hidden", 4), TensorDim("inner", 4, parallel=True)
    column = _linear("column", hidden, split, distributed, 1.0)
    row = _linear("row", split, hidden, distributed, 1.0)
    plain = _linear("plain", hidden, hidden, distributed, 1.0)
    inside = _linear("inside", hidden, hidden, distributed, 1.0, inside_tensor_region=True)
    watch = debug.Watch
    assert debug.linear_watch(column, False) == watch(output=False, output_gradient=False, input_gradient=True)
    assert debug.linear_watch(row, False) == watch(output=True, output_gradient=True, input_gradient=False)
    assert debug.linear_watch(plain, False) == debug.EVERYTHING
    assert debug.linear_watch(inside, False) == watch(output=True, output_gradient=False, input_gradient=True)
    # Sequence-tensor-parallel: the token-split stream is nowhere replicated, but inside the tensor region.
    assert [debug.linear_watch(linear, True) for linear in (column, row, plain)] == [None, None, None]
    assert debug.linear_watch(inside, True) == watch(output=True, output_gradient=False, input_gradient=False)


# ---------------------------------------------------------------------------------------------------------------------
# Two processes


def _check_correct_models_pass_unchanged(label: str, **layout) -> None:
    run_config = _run_config(**layout)
    distributed = Distributed(run_config.distributed)
    plain, plain_weights, _ = _train(run_config, distributed, steps=3, with_debug=False)
    checked, checked_weights, hooks = _train(run_config, distributed, steps=3, with_debug=True)
    assert checked == plain, label
    for name, weight in checked_weights.items():
        assert torch.equal(weight, plain_weights[name]), f"{label}: {name}"
    # The checks ran: forward, and backward where gradients are replicated (not under sequence-tensor-parallel).
    assert hooks.checked["forward"] > 0, label
    assert (hooks.checked["backward"] > 0) == (not distributed.sequence_tensor_parallel), label
    hooks.remove()


def _check_planted_faults_are_named(distributed: Distributed, output: str) -> None:
    with pytest.raises(ParallelMismatchError) as raised:
        _train(_run_config("output_offset", tensor_parallel=2), distributed, steps=1, with_debug=True)
    message = str(raised.value)
    assert message.startswith("tensor-parallel ranks disagree at decoder.1.mixer (forward: its output): "), message
    assert "ranks [1] differ from rank 0; max difference 0.001" in message, message
    assert "rtol=1.3e-06, atol=1e-05 (fp32 compute)" in message, message

    with pytest.raises(ParallelMismatchError) as raised:
        _train(_run_config("missing_backward_reduction", tensor_parallel=2), distributed, steps=1, with_debug=True)
    message = str(raised.value)
    expected = (
        "tensor-parallel ranks disagree at decoder.1.mixer (backward: the gradient of its input; the same tensor "
    )
    assert message.startswith(expected), message
    assert "decoder.1.norm_1 output): " in message, message
    # Without the debug mode the same faults go unnoticed.
    for fault in ("output_offset", "missing_backward_reduction"):
        _train(_run_config(fault, tensor_parallel=2), distributed, steps=1, with_debug=False)
    # The trainer installs the debug mode when the config asks for it.
    run_config = _run_config("output_offset", tensor_parallel=2, debug=True)
    run_config = update(run_config, {"training": {"output_dir": output}})
    with pytest.raises(ParallelMismatchError, match=r"disagree at decoder\.1\.mixer \(forward: its output\)"):
        Trainer(run_config, distributed=distributed, log=lambda _: None).run()


def _check_drift_is_named(distributed: Distributed, parameter: str, what: str, group: str) -> None:
    def drift(model, step):
        if step == 2 and dist.get_rank() == 1:
            tensor = model.get_parameter(parameter)
            tensor = tensor.grad if what == "gradient of" else tensor
            with torch.no_grad():
                tensor.view(-1)[0] += 1e-6

    with pytest.raises(ParallelMismatchError, match=rf"MISMATCH after step 2: {what} {parameter} \({group} group\)"):
        _train(_run_config(tensor_parallel=distributed.tensor_size), distributed, steps=3, with_debug=True, drift=drift)


def _check_fsdp_parameters_are_compared_where_replicated(world: Distributed) -> None:
    """FSDP2's parameters are DTensors over the data mesh: compared over it where their placement replicates them
    (ZeRO 0), not where it shards them (their shards differ by design)."""
    mesh = world.mesh["data"]
    settings = ResolvedParameter(initialization=NormalInitializationConfig(), lr_scale=1.0, weight_decay=True)
    module = nn.Module()
    for name, placement in (("replicated", Replicate()), ("sharded", Shard(0))):
        made = create_parameter(name, (TensorDim("rows", 4),), settings, world)
        parameter = nn.Parameter(distribute_tensor(made.detach(), mesh, [placement]))
        parameter.meta = made.meta
        module.register_parameter(name, parameter)
    debug.after_step(module, world, 1)  # the same on both ranks
    if dist.get_rank() == 1:
        with torch.no_grad():
            module.sharded.to_local().add_(1.0)
    debug.after_step(module, world, 2)  # shards differ by design
    if dist.get_rank() == 1:
        with torch.no_grad():
            module.replicated.to_local().add_(1.0)
    with pytest.raises(ParallelMismatchError, match=r"MISMATCH after step 3: parameter replicated \(data group\)"):
        debug.after_step(module, world, 3)


def _check_ranks_must_agree(distributed: Distributed) -> None:
    rank = dist.get_rank()
    check_ranks_agree(_run_config(), distributed)  # the same on both ranks

    own = _run_config(seed=77 + rank)
    with pytest.raises(UsageError) as raised:
        check_ranks_agree(own, distributed)
    message = str(raised.value)
    assert message.startswith("rank 1 does not run what rank 0 runs"), message
    assert "-distributed.seed: 77\n" in message and "+distributed.seed: 78" in message, message

    if rank == 1:
        register_plugin(types.SimpleNamespace(), "extra")
    with pytest.raises(UsageError) as raised:
        check_ranks_agree(_run_config(), distributed)
    assert "plugin 'extra': absent on rank 0, registered in-process (loaded) on rank 1" in str(raised.value)
    reset_registry()
    _register_test_plugin()
    check_ranks_agree(_run_config(), distributed)


def _check_cli_train_destroys_the_process_group(config: str, ports: list[int]) -> None:
    # Each process group on a port of its own: a new one on the port of a destroyed one may meet its stale store.
    os.environ["MASTER_PORT"] = str(ports[0])
    assert cli.main(["train", config]) == 0
    assert not dist.is_initialized()
    # A failure inside the run (its data files are missing: a usage error, exit 2) destroys it too.
    os.environ["MASTER_PORT"] = str(ports[1])
    assert cli.main(["train", config, "data={type: memmap, path: /nonexistent/tokens}"]) == 2
    assert not dist.is_initialized()
    os.environ["MASTER_PORT"] = str(ports[2])
    with pytest.raises(KeyboardInterrupt), Distributed(DistributedConfig(backend="gloo", timeout=60)):
        assert dist.is_initialized()
        raise KeyboardInterrupt
    assert not dist.is_initialized()


def _parallel_cases(config: str, ports: list[int]) -> None:
    logging.disable(logging.WARNING)  # the planted mismatches are logged on purpose
    _register_test_plugin()  # a spawned rank does not inherit its parent's in-process plugins
    with Distributed(DistributedConfig(seed=77, backend="gloo", timeout=60)) as world:
        _check_correct_models_pass_unchanged("tp2", tensor_parallel=2)
        _check_correct_models_pass_unchanged("stp2", tensor_parallel=2, sequence_tensor_parallel=True)
        tensor_parallel = Distributed(_run_config(tensor_parallel=2).distributed)
        _check_planted_faults_are_named(tensor_parallel, str(Path(config).parent / "faulty"))
        _check_drift_is_named(tensor_parallel, "decoder.0.norm_1.weight", "parameter", "tensor")
        _check_drift_is_named(tensor_parallel, "decoder.2.mixer.gate.weight", "gradient of", "tensor")
        _check_drift_is_named(world, "head.normalization.weight", "parameter", "data")
        _check_fsdp_parameters_are_compared_where_replicated(world)
        _check_ranks_must_agree(world)
    assert not dist.is_initialized()
    _check_cli_train_destroys_the_process_group(config, ports)


@pytest.mark.distributed
def test_debug_mode_rank_agreement_and_shutdown(tmp_path):
    config = tmp_path / "run.yaml"
    data = {
        "model": _model(),
        "distributed": {"seed": 77, "backend": "gloo", "timeout": 60, "tensor_parallel": 2, "debug": True},
        "data": {"type": "random", "sequence_length": TOKENS, "micro_batch_size": 1},
        "training": {"train_iters": 1, "log_interval": 1, "output_dir": str(tmp_path / "run")},
    }
    config.write_text(yaml.safe_dump(data))
    run_distributed(2, _parallel_cases, str(config), [free_port() for _ in range(3)])
