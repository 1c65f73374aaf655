"""`training.cuda_graphs`: steps replayed as one CUDA graph train as the eager steps do (the same Trainer with the
option off is the reference), fall back to eager steps where they cannot replay, and say so; refused off a GPU."""

from pathlib import Path

import pytest
import torch

from blockzoo.cli import main
from blockzoo.config import load
from blockzoo.data.dataset import build_dataset
from blockzoo.layers.base import Batch
from blockzoo.run_config import RunConfig
from blockzoo.training.step import place_micro_batch
from blockzoo.training.trainer import Trainer

EXAMPLES = Path(__file__).parents[1] / "examples"
STEPS = 8
# The hybrid example scaled down (Mamba 2 through mamba_ssm's kernels where installed, varlen attention).
SMALL_HYBRID = [
    "training.cuda_graphs=false",  # the example graphs its steps; the eager references do not
    "model.hidden_size=256",
    "model.decoder.num_blocks=3",
    "model.embeddings.vocab_size=1024",
    "model.decoder.blocks.ssm.mixer.heads=8",
    "model.decoder.blocks.ssm.mlp.intermediate_size=512",
    "model.decoder.blocks.attn.mixer.heads=4",
    "model.decoder.blocks.attn.mixer.head_groups=2",
    "model.decoder.blocks.attn.mlp.intermediate_size=512",
    "data.sequence_length=512",
    "data.micro_batch_size=4",
    f"training.train_iters={STEPS}",
    "training.log_interval=4",
    "training.schedule.warmup_iters=2",
]
WHOLE_ROWS = ["data.min_document_length=512"]
# The most one AdamW step moves a weight (about): the example's learning rate.
LEARNING_RATE = load(RunConfig, EXAMPLES / "gpu_hybrid.yaml").training.optimizer.learning_rate


def train(tmp_path: Path, name: str, overrides: list[str], example: str = "gpu_hybrid.yaml"):
    lines: list[str] = []
    config = load(RunConfig, EXAMPLES / example, [*overrides, f"training.output_dir={tmp_path / name}"])
    with Trainer(config, log=lines.append) as trainer:
        history = trainer.run()
        weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        graph = trainer._gradients
    return [record.loss for record in history], weights, lines, graph


def assert_same_training(graphed, eager, eager_again, *, rtol=1e-4, atol=1e-5, weight_atol=None):
    """The graphed run's losses and weights are the eager run's: within `rtol`/`atol` (the weights: `weight_atol`
    if given), or where two eager runs differ from each other (kernels that add up in a varying order: varlen
    attention's backward), within three times that."""

    def check(actual, expected, again, name, atol=atol):
        spread = (again - expected).abs().max().item()
        worst = (actual - expected).abs().max().item()
        if worst <= 3 * spread:
            return
        torch.testing.assert_close(
            actual,
            expected,
            rtol=rtol,
            atol=atol,
            msg=lambda message: f"{name} (eager runs differ by {spread:.3g}): {message}",
        )

    check(*(torch.tensor(run[0]) for run in (graphed, eager, eager_again)), "losses")
    for name in eager[1]:
        check(graphed[1][name], eager[1][name], eager_again[1][name], name, atol=weight_atol or atol)


def train_eagerly_twice(tmp_path: Path, overrides: list[str], **options):
    return train(tmp_path, "eager", overrides, **options), train(tmp_path, "eager_again", overrides, **options)


@pytest.mark.gpu
def test_graphed_steps_train_as_the_eager_steps_do(tmp_path):
    eager = train_eagerly_twice(tmp_path, SMALL_HYBRID + WHOLE_ROWS)
    graphed = train(tmp_path, "graphed", [*SMALL_HYBRID, *WHOLE_ROWS, "training.cuda_graphs=true"])
    assert_same_training(graphed, *eager)
    # The first step runs eagerly, the second is captured and replayed, every later one replayed.
    assert graphed[3].replays == STEPS - 1
    assert not any("cuda_graphs" in line for line in graphed[2]), graphed[2]


@pytest.mark.gpu
def test_graphed_steps_under_compiled_blocks_and_recomputation(tmp_path):
    settings = [*SMALL_HYBRID, *WHOLE_ROWS, "training.compile=blocks", "training.recompute=selective"]
    eager = train_eagerly_twice(tmp_path, settings)
    graphed = train(tmp_path, "graphed", [*settings, "training.cuda_graphs=true"])
    assert_same_training(graphed, *eager)
    assert graphed[3].replays == STEPS - 1


def bucketed_shapes(overrides: list[str], steps: int) -> list[tuple]:
    """The shapes (`Batch.bucketed`) of the first `steps` micro-batches of the run, from its dataset directly."""
    config = load(RunConfig, EXAMPLES / "gpu_hybrid.yaml", overrides)
    data = build_dataset(config.data, seed=config.distributed.seed, model_vocab_size=config.model.embeddings.vocab_size)
    batches = data.training_batches()
    shapes = []
    for _ in range(steps):
        batch = Batch.bucketed(next(batches).lengths)
        shapes.append((batch.num_documents, batch.max_length, batch.padded))
    return shapes


@pytest.mark.gpu
def test_documents_of_changing_lengths_replay_in_a_few_shapes(tmp_path):
    # The random dataset's documents of random lengths: padded, they fall in a few shapes (a graph each).
    steps = 12
    settings = [*SMALL_HYBRID, f"training.train_iters={steps}"]
    shapes = bucketed_shapes(settings, steps)
    assert len(set(shapes)) <= steps // 3 and all(padded for *_, padded in shapes), shapes
    eager = train_eagerly_twice(tmp_path, settings)
    graphed = train(tmp_path, "graphed", [*settings, "training.cuda_graphs=true"])
    # Varlen attention's backward adds up in a varying order, and AdamW turns that rounding on a near-zero gradient
    # into up to a whole update: on the H200 two eager runs differed by 8.6e-6 and an all-eager run of the option by
    # 1.9e-4 in one embedding (the same element on two machines), under one step's size.
    assert_same_training(graphed, *eager, weight_atol=LEARNING_RATE)
    # Each shape's first step runs eagerly, its second is captured (and replayed), the later ones replayed.
    assert graphed[3].replays == steps - len(set(shapes)), shapes
    assert not any("cuda_graphs" in line for line in graphed[2]), graphed[2]


@pytest.mark.gpu
def test_a_step_that_cannot_be_captured_runs_eagerly_and_the_run_says_why(tmp_path):
    # fp32 experts take one product per expert, sized by counts read on the host: not capturable.
    moe = [
        "model.hidden_size=128",
        "model.decoder.num_blocks=2",
        "model.embeddings.vocab_size=512",
        "model.decoder.block.mixer.heads=4",
        "model.decoder.block.mixer.head_groups=2",
        "model.decoder.block.mlp={type: moe, experts: 4, experts_per_token: 2, intermediate_size: 64}",
        "distributed.compute_dtype=fp32",
        "data.sequence_length=256",
        "data.micro_batch_size=2",
        "data.min_document_length=256",
        f"training.train_iters={STEPS}",
        "training.cuda_graphs=false",  # the example graphs its steps; the eager references do not
    ]
    eager = train_eagerly_twice(tmp_path, moe, example="gpu.yaml")
    graphed = train(tmp_path, "graphed", [*moe, "training.cuda_graphs=true"], example="gpu.yaml")
    assert_same_training(graphed, *eager)
    assert graphed[3].replays == 0
    told = [line for line in graphed[2] if "cannot be captured" in line]
    assert len(told) == 1 and "training.cuda_graphs=false" in told[0], graphed[2]


def test_padded_micro_batches_give_the_exact_ones_loss_and_gradients(tmp_path):
    """What a graphed step runs (`Batch.bucketed`) against the exact micro-batch, through the whole hybrid model in
    fp32: the same loss and gradients (the GPU kernels' own padded tests are in each mixer's GPU tests)."""
    overrides = [*SMALL_HYBRID, "distributed.compute_dtype=fp32", f"training.output_dir={tmp_path}"]
    config = load(RunConfig, EXAMPLES / "gpu_hybrid.yaml", overrides)
    with Trainer(config, log=lambda line: None) as trainer:
        micro = next(trainer.data.training_batches())
        runs = []
        for bucketed in (False, True):
            placed = place_micro_batch(micro, trainer.distributed, bucketed=bucketed)
            assert placed.batch.padded == bucketed
            trainer.optimizer.zero_grad(set_to_none=True)
            loss, _ = trainer.forward_backward([placed])
            runs.append((loss.detach(), [parameter.grad.clone() for parameter in trainer.model.parameters()]))
    (exact_loss, exact_grads), (padded_loss, padded_grads) = runs
    torch.testing.assert_close(padded_loss, exact_loss, rtol=1e-5, atol=1e-6)
    for padded, exact in zip(padded_grads, exact_grads, strict=True):
        torch.testing.assert_close(padded, exact, rtol=1e-4, atol=1e-6)


def test_cuda_graphs_off_a_gpu_is_a_usage_error(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {hidden_size: 32, embeddings: {vocab_size: 64}, decoder: {type: fixed, num_blocks: 1, block: "
        "{mixer: {type: attention, heads: 2, head_size: 16}, mlp: {type: mlp, intermediate_size: 64}}}}\n"
        "data: {type: random, sequence_length: 16, micro_batch_size: 2}\n"
        f"training: {{train_iters: 2, cuda_graphs: true, output_dir: {tmp_path / 'run'}}}\n"
    )
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for runs on the CPU")
    code = main(["train", str(config)])
    captured = capsys.readouterr()
    assert code == 2
    assert "cuda_graphs needs a CUDA device, and this run's is cpu: this config is made for a GPU" in captured.err
    assert "Traceback" not in captured.err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step_*"))
