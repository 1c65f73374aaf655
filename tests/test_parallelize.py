"""Activation recomputation and per-block compilation (`blockzoo.distributed.parallelize`) change what is kept for the
backward pass and how it runs, never the results: the losses (named ones included, added once) and every gradient
equal those of the plain model; `full` keeps less than `none`, and `selective` keeps the matrix products (the backward
pass redoes none of them) while `full` redoes them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockzoo.config import ConfigError, structure
from blockzoo.distributed.parallelize import parallelize
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig

# Attention + MoE (named losses) and Mamba 2 + MLP blocks: every first-party layer kind the trainer recomputes.
MODEL = {
    "hidden_size": 32,
    "embeddings": {"vocab_size": 64},
    "decoder": {
        "type": "pattern",
        "pattern": ["attn", "ssm"],
        "num_blocks": 2,
        "blocks": {
            "attn": {
                "mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8},
                "mlp": {
                    "type": "moe",
                    "experts": 4,
                    "experts_per_token": 2,
                    "intermediate_size": 16,
                    "auxiliary_loss_coefficient": 0.01,
                    "z_loss_coefficient": 0.001,
                },
            },
            "ssm": {
                "mixer": {"type": "mamba_2", "heads": 4, "head_size": 8, "state_size": 8, "chunk_size": 4},
                "mlp": {"type": "mlp", "intermediate_size": 48},
            },
        },
    },
}


class _CountMatrixProducts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def _step(training: dict) -> tuple[torch.Tensor, dict, dict, int, int]:
    """(cross-entropy, named losses, gradients, bytes saved for the backward pass outside recomputed regions, matrix
    products of the backward pass) of one forward+backward."""
    run_config = structure({"model": MODEL, "distributed": {"backend": "gloo"}, "training": training}, RunConfig)
    model = LanguageModel(run_config.model, Distributed(run_config.distributed, world_size=1, rank=0, local_rank=0))
    parallelize(model, run_config)
    generator = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 64, (20,), generator=generator) for _ in range(2))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cross_entropy, losses = model.loss(tokens, labels, Batch([7, 13]))
    with _CountMatrixProducts() as backward_products:
        (cross_entropy + sum(losses.values())).backward()
    gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    named = {name: value.detach() for name, value in losses.items()}
    return cross_entropy.detach(), named, gradients, saved, backward_products.count


@pytest.fixture(scope="module")
def plain():
    return _step({})


@pytest.mark.parametrize(
    "training",
    [
        {"recompute": "full"},
        {"recompute": "selective"},
        {"recompute": "full", "recompute_blocks": {"ssm": "none", "attn": "selective"}},
    ],
    ids=["full", "selective", "per-block"],
)
def test_recomputation_changes_nothing_but_what_is_kept(training, plain):
    cross_entropy, losses, gradients, *_ = _step(training)
    expected_cross_entropy, expected_losses, expected_gradients, *_ = plain
    assert torch.equal(cross_entropy, expected_cross_entropy)
    assert losses.keys() == expected_losses.keys() and len(losses) == 2  # added once, not again when recomputed
    for name, value in losses.items():
        assert torch.equal(value, expected_losses[name]), name
    for name, gradient in gradients.items():
        assert gradient is not None, name
        torch.testing.assert_close(gradient, expected_gradients[name], rtol=0, atol=0, msg=name)


def test_what_each_policy_keeps(plain):
    _, _, _, saved_full, products_full = _step({"recompute": "full"})
    _, _, _, _, products_selective = _step({"recompute": "selective"})
    _, _, _, saved_plain, products_plain = plain
    assert saved_full < saved_plain / 4  # only the blocks' inputs (and the head's) are kept
    assert products_selective == products_plain < products_full


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_compiled_blocks_match_eager(recompute, plain):
    cross_entropy, losses, gradients, *_ = _step({"compile": "blocks", "recompute": recompute})
    torch.testing.assert_close(cross_entropy, plain[0], rtol=1e-5, atol=1e-5)
    assert losses.keys() == plain[1].keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, plain[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_recompute_blocks_must_name_a_block():
    with pytest.raises(ConfigError, match=r"training.recompute_blocks.mlp: the model has no block named 'mlp'"):
        structure({"model": MODEL, "training": {"recompute_blocks": {"mlp": "full"}}}, RunConfig)
