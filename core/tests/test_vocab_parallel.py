"""Vocabulary parallelism: the padded vocab dim, the vocab-parallel `linear_cross_entropy`, and the language model's
vocab-parallel embeddings and head, against the single process.

- The dim: shards are slices of the zero-padded global tensor; merging truncates; the global shape is the true one.
- The loss function on 2 and 4 gloo ranks: loss, hidden-state gradient and the gathered weight gradient equal a
  float64 `F.cross_entropy` on the materialized logits, with vocabularies the ranks do not divide (padding; a rank
  holding only padding), ignored tokens, chunks, and sequence-tensor-parallel inputs.
- The model on TP2 / STP2 / TP4 / STP4 with vocab 257 (padded), tied and untied: the loss (under STP each rank's is
  its tokens' share), the logits of `model(input_ids)`, greedy generation (TP) and every parameter's gradient equal
  the single process's; a checkpoint saved under TP2 loads in one process and the reverse.

The core alone builds no tensor-parallel layer, so a tiny MLP (column-parallel up, row-parallel down) is registered
here as an in-process plugin. One spawn per world size runs all its cases.
"""

import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import blockzoo
from blockzoo.api import (
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    LinearConfig,
    MLPConfig,
    configclass,
    field,
    hookimpl,
)
from blockzoo.checkpoint import load_checkpoint, save_checkpoint
from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, MLP, Batch
from blockzoo.layers.config import NormalInitializationConfig
from blockzoo.layers.cross_entropy import linear_cross_entropy
from blockzoo.layers.dims import PaddedTensorDim, TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.model.language_model import LanguageModel
from blockzoo.plugins import register_plugin, reset_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.optimizer import AdamW
from blockzoo_testing.distributed import run_distributed

SEED = 2024
# fp32 against float64 or against the single process: sums in another order over a few dozen terms.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

# ---------------------------------------------------------------------------------------------------------------------
# The padded dim


@pytest.mark.parametrize("size, tp_size", [(257, 2), (257, 4), (5, 4), (8, 4), (7, 1)])
def test_padded_dim_shards_are_slices_of_the_zero_padded_tensor(size, tp_size):
    dim = PaddedTensorDim("vocab", size, parallel=True)
    local = -(-size // tp_size)
    assert dim.local_size(tp_size) == local and dim.global_size == size
    tensor = torch.randn(size, 3)
    padded = torch.cat([tensor, torch.zeros(local * tp_size - size, 3)])
    shards = [dim.global_to_local(tensor, 0, rank, tp_size) for rank in range(tp_size)]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, padded[rank * local : (rank + 1) * local]), rank
        assert dim.valid_size(rank, tp_size) == max(0, min(local, size - rank * local))
    assert torch.equal(dim.merge_shards(shards, 0), tensor)
    assert dim.local_to_global(tensor, 0, None) is tensor


def test_a_replicated_padded_dim_is_whole():
    dim = PaddedTensorDim("vocab", 5)
    tensor = torch.randn(2, 5)
    assert dim.local_size(4) == 5 and dim.global_to_local(tensor, 1, 3, 4) is tensor


# ---------------------------------------------------------------------------------------------------------------------
# The loss function

TOKENS, HIDDEN = 24, 8
# name -> (vocabulary, sequence-tensor-parallel). 51 leaves padding on 2 and 4 ranks; 5 over 4 ranks leaves the
# last rank nothing but padding.
FUNCTION_CASES = {"divisible": (48, False), "padded": (51, False), "tiny": (5, False), "stp-padded": (51, True)}


def _function_inputs(vocab: int):
    generator = torch.Generator().manual_seed(SEED + vocab)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(vocab, HIDDEN, generator=generator) * 0.5
    labels = torch.randint(0, vocab, (TOKENS,), generator=generator)
    labels[::5] = IGNORE_INDEX
    labels[1] = vocab - 1  # on the last rank
    return hidden, weight, labels


def _check_function_case(
    name: str,
    vocab: int,
    sequence_parallel: bool,
    group,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> None:
    """The vocab-parallel loss against float64 on the same (for bf16: bf16-rounded) inputs. bf16 tolerances as in
    test_cross_entropy.test_bf16_inputs (one bf16 rounding of the logits, two of the gradients)."""
    rank, size = group.rank(), group.size()
    hidden, weight, labels = _function_inputs(vocab)
    hidden64 = hidden.to(dtype).double().requires_grad_()
    weight64 = weight.to(dtype).double().requires_grad_()
    expected = F.cross_entropy(hidden64 @ weight64.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (expected * 0.5).backward()

    dim = PaddedTensorDim("vocab", vocab, parallel=True)
    local_weight = dim.global_to_local(weight, 0, rank, size).to(device).requires_grad_()
    own = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size) if sequence_parallel else slice(None)
    local_hidden = hidden[own].to(device, dtype).requires_grad_()
    loss = linear_cross_entropy(
        local_hidden,
        local_weight,
        labels[own].to(device),
        tensor_group=group,
        vocab_start=rank * dim.local_size(size),
        vocab_size=vocab,
        sequence_parallel=sequence_parallel,
        chunk_tokens=5,  # does not divide the 24 tokens
    )
    (loss * 0.5).backward()
    message = f"{name} ({dtype}), rank {rank} of {size}"
    fp32 = dtype == torch.float32
    loss_tolerance = TOLERANCE if fp32 else {"rtol": 2e-3, "atol": 0.0}
    torch.testing.assert_close(loss.detach().cpu().double(), expected.detach(), **loss_tolerance, msg=message)
    losses = [torch.zeros((), device=device) for _ in range(size)]
    dist.all_gather(losses, loss.detach(), group=group)
    assert all(torch.equal(other, losses[0]) for other in losses), f"{message}: the ranks' losses differ: {losses}"
    valid = dim.valid_size(rank, size)
    assert not local_weight.grad[valid:].any(), f"{message}: padding rows have a gradient"
    gathered = dim.local_to_global(local_weight.grad, 0, group)
    for grad, reference in ((local_hidden.grad, hidden64.grad[own]), (gathered, weight64.grad)):
        tolerance = TOLERANCE if fp32 else {"rtol": 1e-2, "atol": 1e-2 * float(reference.abs().max())}
        torch.testing.assert_close(grad.cpu().double(), reference, **tolerance, msg=message)


def _check_functions_on_gpus() -> None:
    """NCCL, CUDA: the compiled elementwise functions of the vocab-parallel path, in fp32 and bf16."""
    with Distributed(DistributedConfig(seed=SEED, backend="nccl", timeout=120)) as world:
        for dtype in (torch.float32, torch.bfloat16):
            for name, (vocab, sequence_parallel) in FUNCTION_CASES.items():
                _check_function_case(name, vocab, sequence_parallel, dist.group.WORLD, world.device, dtype)
        dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# The model: a tiny tensor-parallel MLP plugin


@configclass
class TensorParallelMLPConfig(MLPConfig):
    """tanh(x up) down, with up column-parallel and down row-parallel."""

    capabilities = frozenset({TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL})
    up: LinearConfig = field(factory=LinearConfig, doc="hidden -> 16, column-parallel.")
    down: LinearConfig = field(factory=LinearConfig, doc="16 -> hidden, row-parallel.")


class TensorParallelMLP(MLP):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        intermediate = TensorDim("intermediate", 16, parallel=True)
        init = NormalInitializationConfig(std=0.4)
        common = {"default_initialization": init, "lr_scale": lr_scale}
        self.up = Linear(f"{name}.up", config.up, hidden_dim, intermediate, distributed, **common)
        self.down = Linear(f"{name}.down", config.down, intermediate, hidden_dim, distributed, **common)

    def forward(self, hidden, batch, state=None):
        return self.down(torch.tanh(self.up(hidden)))

    def flops(self, batch):
        return 0, 0


@hookimpl
def _register_mlps(register):
    register("vp.mlp", TensorParallelMLPConfig, f"{__name__}:TensorParallelMLP")


@pytest.fixture(autouse=True)
def vp_plugin(fresh_registry):
    _register_plugin()


def _register_plugin() -> None:
    register_plugin(types.SimpleNamespace(register_mlps=_register_mlps), "vp")


VOCAB = 257
LENGTHS = [7, 5, 12]  # 24 tokens: 4 ranks split them
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}


def _model_data(tied: bool, positions: bool = False) -> dict:
    return {
        "hidden_size": 12,
        "tied_embedding_weight": tied,
        "embeddings": {"vocab_size": VOCAB, "position_embeddings": positions, "num_position_embeddings": 16},
        "decoder": {
            "type": "fixed",
            "num_blocks": 2,
            "block": {"mixer": {"type": "none"}, "mlp": {"type": "vp.mlp"}, "normalization": RANDOM_NORM},
        },
        "head": {"normalization": RANDOM_NORM},
    }


def _run_config(tied: bool, positions: bool = False, **distributed) -> RunConfig:
    data = {
        "model": _model_data(tied, positions),
        "distributed": {"seed": SEED, "backend": "gloo", "timeout": 60, **distributed},
    }
    return structure(data, RunConfig)


def _batch_data():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=generator)
    tokens[3] = VOCAB - 1  # the last id, on the last rank
    labels = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=generator)
    labels[[0, 6, 11]] = IGNORE_INDEX
    labels[2] = VOCAB - 1
    return tokens, labels


def _single_process(run_config: RunConfig) -> LanguageModel:
    return LanguageModel(run_config.model, Distributed(run_config.distributed, world_size=1, rank=0, local_rank=0))


def _loss_and_gradients(model: LanguageModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss (summed over the tensor group under STP, as the trainer does) and every parameter's
    global gradient after the trainer's tensor-group reduction of the replicated ones."""
    tokens, labels = _batch_data()
    model.zero_grad(set_to_none=True)
    loss, _ = model.loss(tokens, labels, Batch(LENGTHS))
    (loss * 0.25).backward()
    distributed = model.distributed
    distributed.reduce_replicated_gradients(model.parameters())
    loss = loss.detach().clone()
    if distributed.sequence_tensor_parallel:
        dist.all_reduce(loss, group=distributed.tensor_group)
    group = distributed.tensor_group
    gradients = {
        name: parameter.meta.local_to_global(parameter.grad, group) for name, parameter in model.named_parameters()
    }
    return loss, gradients


def _check_model_case(label: str, tied: bool, positions: bool, settings: dict) -> None:
    run_config = _run_config(tied, positions, **settings)
    model = LanguageModel(run_config.model, Distributed(run_config.distributed))
    reference = _single_process(_run_config(tied, positions))
    distributed = model.distributed
    tp, tp_rank = distributed.tensor_size, distributed.tensor_rank

    # The layout: vocabulary rows split (padded), one parameter when tied, the head norm replicated.
    local_rows = -(-VOCAB // tp)
    embeddings = model.embeddings.word_embeddings
    assert embeddings.shape == (local_rows, 12) and embeddings.meta.global_shape == (VOCAB, 12), label
    assert embeddings.meta.tensor_parallel and not embeddings.meta.reduce_gradient_over_tensor_group, label
    assert (model.head.output_weight is embeddings) == tied, label
    assert not model.head.normalization.weight.meta.tensor_parallel, label
    valid = VOCAB - tp_rank * local_rows
    for weight in {id(w): w for w in (embeddings, model.head.output_weight)}.values():
        assert not weight[valid:].any(), f"{label}: padding rows are not zero"

    loss, gradients = _loss_and_gradients(model)
    expected_loss, expected_gradients = _loss_and_gradients(reference)
    torch.testing.assert_close(loss, expected_loss, **TOLERANCE, msg=f"{label}: loss")
    for name, parameter in model.named_parameters():
        if name in ("embeddings.word_embeddings", "head.output_weight"):
            assert not parameter.grad[valid:].any(), f"{label}: {name}: padding rows have a gradient"
    assert gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        assert expected_gradients[name].abs().max() > 0, f"{label}: {name} has no gradient in the reference"
        torch.testing.assert_close(gradient, expected_gradients[name], **TOLERANCE, msg=f"{label}: {name}")

    input_ids = _batch_data()[0].view(2, 12)
    with torch.no_grad():
        logits, expected_logits = model(input_ids), reference(input_ids)
    assert logits.shape == (2, 12, VOCAB), label
    torch.testing.assert_close(logits, expected_logits, **TOLERANCE, msg=f"{label}: logits")
    if not distributed.sequence_tensor_parallel:  # generation gathers the vocabulary slices of the last logits
        prompts = [[1, VOCAB - 1, 7], [3]]
        assert model.generate(prompts, 4) == reference.generate(prompts, 4), f"{label}: generation"


def _check_checkpoints(root: Path) -> None:
    """TP2 (padded vocab) → one process, and one process → TP2: the global weights exactly, the logits, and the
    optimizer state of the TP2 run (one AdamW step) as global tensors."""
    run_config = _run_config(tied=True, tensor_parallel=2)
    model = LanguageModel(run_config.model, Distributed(run_config.distributed))
    distributed = model.distributed
    optimizer = AdamW(run_config.training.optimizer, model.parameters())
    tokens, labels = _batch_data()
    model.loss(tokens, labels, Batch(LENGTHS))[0].backward()
    optimizer.step()
    save_checkpoint(
        root / "tp2", model=model, optimizer=optimizer, run_config=run_config, step=1, distributed=distributed
    )
    group = distributed.tensor_group
    loaded = blockzoo.load(root / "tp2")
    assert loaded.distributed.tensor_size == 1
    for name, parameter in loaded.named_parameters():
        assert parameter.shape == parameter.meta.global_shape, name
        assert torch.equal(
            parameter.detach(), parameter.meta.local_to_global(dict(model.named_parameters())[name], group)
        )
    single_optimizer = AdamW(run_config.training.optimizer, loaded.parameters())
    load_checkpoint(root / "tp2", model=loaded, optimizer=single_optimizer, distributed=loaded.distributed)
    for (name, parameter), local in zip(loaded.named_parameters(), model.parameters(), strict=True):
        for key, state in single_optimizer.state[parameter].items():
            if state.ndim:
                assert torch.equal(state, local.meta.local_to_global(optimizer.state[local][key], group)), (name, key)
    input_ids = tokens.view(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids), model(input_ids), **TOLERANCE)

    # One process → TP2: rank 0 saves a single-process model whose weights differ from the fresh TP2 model's.
    single_config = _run_config(tied=True)
    if distributed.rank == 0:
        single = _single_process(single_config)
        with torch.no_grad():
            for parameter in single.parameters():
                parameter.mul_(-1.5)
        blockzoo.save(single, root / "single")
    dist.barrier()
    single = blockzoo.load(root / "single")
    parallel = blockzoo.load(root / "single", distributed=Distributed(run_config.distributed))
    assert parallel.distributed.tensor_size == 2
    for (name, parameter), expected in zip(parallel.named_parameters(), single.parameters(), strict=True):
        shard = parameter.meta.global_to_local(expected.detach(), distributed.tensor_rank, 2)
        assert torch.equal(parameter.detach(), shard), name
    with torch.no_grad():
        torch.testing.assert_close(parallel(input_ids), single(input_ids), **TOLERANCE)


# label -> (tied, position embeddings, distributed settings)
MODEL_CASES = {
    2: {
        "tp2-tied": (True, False, {"tensor_parallel": 2}),
        "tp2-untied-positions": (False, True, {"tensor_parallel": 2}),
        "stp2-tied-positions": (True, True, {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
        "stp2-untied": (False, False, {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
    },
    4: {
        "tp4-tied": (True, False, {"tensor_parallel": 4}),
        "stp4-untied-positions": (False, True, {"tensor_parallel": 4, "sequence_tensor_parallel": True}),
    },
}


def _check_all(world_size: int, root: str) -> None:
    reset_registry()
    _register_plugin()
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)) as world:
        group = world.mesh.get_group("tensor") if world.tensor_size > 1 else dist.group.WORLD
        for name, (vocab, sequence_parallel) in FUNCTION_CASES.items():
            _check_function_case(name, vocab, sequence_parallel, group)
        for label, (tied, positions, settings) in MODEL_CASES[world_size].items():
            _check_model_case(label, tied, positions, settings)
        if world_size == 2:
            _check_checkpoints(Path(root))
        dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_matches_single_process(world_size, tmp_path):
    run_distributed(world_size, _check_all, world_size, str(tmp_path))


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vocab_parallel_loss_on_gpus():
    run_distributed(2, _check_functions_on_gpus)
