"""The trainer, optimizer and schedule: learning, exact resumption, gradient accumulation, per-parameter settings,
clipping, non-finite losses, checkpoints, evaluation, bf16, logging, the `train` command and data/tensor parallelism.

The models are bigram-like (no mixer, no MLP: embeddings, final norm, output projection), which the core alone builds.
"""

import json
import math
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file
from tiny_runs import BASE, VOCAB, configure
from torch import nn

import blockzoo
from blockzoo import cli
from blockzoo.checkpoint import latest_checkpoint
from blockzoo.data.dataset import Sample, build_dataset
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import LinearConfig, NormalInitializationConfig, ParameterConfig
from blockzoo.layers.dims import ConcatenatedTensorDim, TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.config import AdamWConfig, ScheduleConfig
from blockzoo.training.optimizer import AdamW, learning_rate
from blockzoo.training.trainer import StepRecord, Trainer, TrainingError
from blockzoo_testing.distributed import run_distributed


def quiet(_: str) -> None:
    pass


def train(config: RunConfig, log=quiet) -> tuple[Trainer, list[StepRecord]]:
    trainer = Trainer(config, log=log)
    return trainer, trainer.run()


def capture_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """The gradients the optimizer steps with (after reduction and clipping), one dict per step."""
    captured = []
    step = trainer.optimizer.step

    def capturing_step(*args, **kwargs):
        captured.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing_step
    return captured


def fresh_model(config: RunConfig) -> LanguageModel:
    """The model a trainer of `config` starts from (initialization depends only on the seed and the names)."""
    return LanguageModel(config.model, Distributed(config.distributed))


def reference_loss(model: LanguageModel, samples: list[Sample]) -> torch.Tensor:
    """The mean cross-entropy over every labelled token, each sample run alone and labelled here: a token's target
    is the next token of the same document piece."""
    total, count = torch.zeros(()), 0
    for sample in samples:
        log_probabilities = torch.log_softmax(model.forward_packed(sample.tokens, Batch(sample.lengths)).float(), -1)
        start = 0
        for length in sample.lengths:
            for position in range(start, start + length - 1):
                total = total - log_probabilities[position, sample.tokens[position + 1]]
                count += 1
            start += length
    return total / count


def training_samples(config: RunConfig, count: int) -> list[Sample]:
    dataset = build_dataset(config.data, seed=config.distributed.seed, model_vocab_size=VOCAB)
    return [dataset.training_sample(index) for index in range(count)]


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------------
# Learning and resumption


def test_the_loss_falls_on_the_embedded_corpus(tmp_path):
    _, history = train(configure(tmp_path, "training.train_iters=30", "training.optimizer.learning_rate=0.03"))
    losses = [record.loss for record in history]
    assert [record.step for record in history] == list(range(1, 31))
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[0] > math.log(VOCAB) - 0.5  # starts near chance
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0


class Interrupted(Exception):
    pass


def interrupt_after_a_checkpoint(message: str) -> None:
    if message.startswith("saved checkpoint"):
        raise Interrupted


def test_resuming_from_a_checkpoint_is_exact(tmp_path):
    # 17 windows of 64 tokens per epoch, 4 per step: the resumed half starts a new epoch of the sampling order.
    overrides = [
        "training.train_iters=8",
        "training.checkpoint_interval=4",
        "training.gradient_accumulation=2",
        "training.schedule={warmup_iters: 2, decay: cosine}",
        "data.sequence_length=64",
        "data.num_documents=2",
        "data.validation_fraction=0",
    ]
    straight, history = train(configure(tmp_path / "straight", *overrides))

    config = configure(tmp_path / "interrupted", *overrides)
    with pytest.raises(Interrupted):
        Trainer(config, log=interrupt_after_a_checkpoint).run()
    assert latest_checkpoint(tmp_path / "interrupted").name == "step_4"
    messages = []
    resumed, second_half = train(config, log=messages.append)

    assert f"resumed from {tmp_path / 'interrupted' / 'step_4'} (step 4)" in messages
    assert [record.step for record in second_half] == [5, 6, 7, 8]
    assert [record.loss for record in second_half] == [record.loss for record in history[4:]]
    assert [record.gradient_norm for record in second_half] == [record.gradient_norm for record in history[4:]]
    assert [record.learning_rate for record in second_half] == [record.learning_rate for record in history[4:]]
    final, other = weights(straight.model), weights(resumed.model)
    assert all(torch.equal(final[name], other[name]) for name in final)
    saved = load_file(tmp_path / "interrupted" / "step_8" / "model.safetensors")
    assert saved.keys() == final.keys() and all(torch.equal(saved[name], final[name]) for name in final)


# ---------------------------------------------------------------------------------------------------------------------
# The loss and its gradient


def test_gradient_accumulation_equals_one_big_micro_batch_and_the_reference(tmp_path):
    common = ["training.train_iters=1", "training.gradient_clipping=null"]
    accumulated = configure(tmp_path / "a", *common, "training.gradient_accumulation=4", "data.micro_batch_size=1")
    one_batch = configure(tmp_path / "b", *common, "training.gradient_accumulation=1", "data.micro_batch_size=4")

    # Both take samples 0-3: four micro-batches of one, or one of four.
    small = Trainer(accumulated, log=quiet).data.training_batches()
    big = next(Trainer(one_batch, log=quiet).data.training_batches())
    assert torch.equal(torch.cat([next(small).tokens for _ in range(4)]), big.tokens)

    results = []
    for config in (accumulated, one_batch):
        trainer = Trainer(config, log=quiet)
        gradients = capture_gradients(trainer)
        (record,) = trainer.run()
        results.append((record, gradients[0], weights(trainer.model)))

    model = fresh_model(one_batch)
    loss = reference_loss(model, training_samples(one_batch, 4))
    loss.backward()
    reference_gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    norm = torch.cat([grad.flatten() for grad in reference_gradients.values()]).norm()
    for record, gradients, _ in results:
        assert record.loss == pytest.approx(loss.item(), rel=1e-6)
        assert record.gradient_norm == pytest.approx(float(norm), rel=1e-5)
        assert gradients.keys() == reference_gradients.keys()
        for name, gradient in gradients.items():
            torch.testing.assert_close(gradient, reference_gradients[name], rtol=1e-5, atol=1e-6)
    for name, value in results[0][2].items():
        torch.testing.assert_close(value, results[1][2][name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("limit", [0.05, 100.0])
def test_gradient_clipping_matches_torch(tmp_path, limit):
    config = configure(tmp_path, "training.train_iters=1", f"training.gradient_clipping={limit}")
    trainer = Trainer(config, log=quiet)
    gradients = capture_gradients(trainer)
    (record,) = trainer.run()

    model = fresh_model(config)
    reference_loss(model, training_samples(config, 2)).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), limit)
    assert record.gradient_norm == pytest.approx(float(norm), rel=1e-5)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(gradients[0][name], parameter.grad, rtol=1e-5, atol=1e-7)
    clipped = torch.cat([gradient.flatten() for gradient in gradients[0].values()]).norm()
    assert float(clipped) == pytest.approx(min(limit, float(norm)), rel=1e-4)
    assert (float(norm) > limit) == (limit == 0.05)  # one case clips, the other does not


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer and the schedule


def test_parameters_are_grouped_by_lr_scale_and_weight_decay_and_lr_scale_0_freezes(tmp_path):
    config = configure(
        tmp_path,
        "model.embeddings={vocab_size: 257, lr_scale: 0.5, position_embeddings: true, num_position_embeddings: 32}",
        "model.head={normalization: {lr_scale: 0}, output_weight: {weight_decay: false}}",
        "training.optimizer={learning_rate: 0.01, weight_decay: 0.1}",
        "training.train_iters=3",
    )
    trainer = Trainer(config, log=quiet)
    names = {id(parameter): name for name, parameter in trainer.model.named_parameters()}
    groups = {
        (group["lr_scale"], group["weight_decay"]): {names[id(p)] for p in group["params"]}
        for group in trainer.optimizer.param_groups
    }
    assert groups == {
        (0.5, 0.1): {"embeddings.word_embeddings", "embeddings.position_embeddings"},
        (1.0, 0.0): {"head.output_weight"},
    }
    frozen = trainer.model.head.normalization.weight
    assert not frozen.requires_grad
    before = weights(trainer.model)
    history = trainer.run()
    after = weights(trainer.model)
    assert torch.equal(after["head.normalization.weight"], before["head.normalization.weight"])
    assert torch.equal(after["head.normalization.weight"], torch.ones(16))
    for name in ("embeddings.word_embeddings", "embeddings.position_embeddings", "head.output_weight"):
        assert not torch.equal(after[name], before[name]), name
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == pytest.approx(history[-1].learning_rate * group["lr_scale"], rel=1e-12)


def test_a_concatenated_parameter_takes_adamw_steps_per_component():
    """key‖value rows with their own lr_scale and weight decay, against one torch AdamW per component."""
    distributed = Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0)
    key_value = ConcatenatedTensorDim("key_value", [TensorDim("key", 3), TensorDim("value", 5)])
    components = [LinearConfig(lr_scale=0.5, weight=ParameterConfig(weight_decay=False)), LinearConfig(lr_scale=2.0)]
    init = NormalInitializationConfig(std=0.5)
    layer = Linear("kv", components, TensorDim("hidden", 4), key_value, distributed, default_initialization=init)
    scaled = Linear(
        "other",
        LinearConfig(lr_scale=0.25),
        TensorDim("hidden", 4),
        TensorDim("out", 2),
        distributed,
        default_initialization=init,
        default_bias=True,
    )
    assert not layer.weight.meta.uniform
    optimizer = AdamW(AdamWConfig(learning_rate=0.01, weight_decay=0.1), [layer.weight, scaled.weight, scaled.bias])

    rows = {"key": slice(0, 3), "value": slice(3, 8)}
    copies = {name: layer.weight.detach()[part].clone().requires_grad_() for name, part in rows.items()}
    others = [scaled.weight.detach().clone().requires_grad_(), scaled.bias.detach().clone().requires_grad_()]
    betas, eps = (0.9, 0.95), 1e-8
    references = {
        "key": torch.optim.AdamW([copies["key"]], lr=0.01 * 0.5, weight_decay=0.0, betas=betas, eps=eps),
        "value": torch.optim.AdamW([copies["value"]], lr=0.01 * 2.0, weight_decay=0.1, betas=betas, eps=eps),
        "other": torch.optim.AdamW(
            [{"params": others[:1], "weight_decay": 0.1}, {"params": others[1:], "weight_decay": 0.0}],
            lr=0.01 * 0.25,
            betas=betas,
            eps=eps,
        ),
    }
    scales = {"key": 0.5, "value": 2.0, "other": 0.25}
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:  # a new learning rate from the schedule
            optimizer.set_learning_rate(0.002)
            for name, reference in references.items():
                for group in reference.param_groups:
                    group["lr"] = 0.002 * scales[name]
        inputs = torch.randn(6, 4, generator=generator)
        optimizer.zero_grad()
        ((layer(inputs) ** 2).sum() + (scaled(inputs) ** 3).sum()).backward()
        for name, part in rows.items():
            copies[name].grad = layer.weight.grad[part].clone()
        others[0].grad, others[1].grad = scaled.weight.grad.clone(), scaled.bias.grad.clone()
        optimizer.step()
        for reference in references.values():
            reference.step()
        for name, part in rows.items():
            torch.testing.assert_close(layer.weight.detach()[part], copies[name].detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(scaled.weight.detach(), others[0].detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(scaled.bias.detach(), others[1].detach(), rtol=1e-6, atol=1e-7)


def expected_learning_rate(step: int, peak: float, total: int, warmup: int, decay: str, ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay == "constant":
        return peak
    progress = (step - warmup) / (total - warmup - 1)  # 0 after the warmup, 1 at the last step
    minimum = peak * ratio
    if decay == "linear":
        return peak + (minimum - peak) * progress
    return minimum + (peak - minimum) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedule_warms_up_then_decays(decay, warmup):
    schedule = ScheduleConfig(warmup_iters=warmup, decay=decay, minimum_learning_rate_ratio=0.2)
    rates = [learning_rate(step, peak=0.1, train_iters=12, schedule=schedule) for step in range(12)]
    expected = [expected_learning_rate(step, 0.1, 12, warmup, decay, 0.2) for step in range(12)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert rates[max(warmup - 1, 0)] == pytest.approx(0.1)  # the peak once warmed up
    assert rates[-1] == pytest.approx(0.1 if decay == "constant" else 0.02)  # the minimum at the last step


def test_the_trainer_follows_the_schedule(tmp_path):
    config = configure(
        tmp_path,
        "training.train_iters=6",
        "training.schedule={warmup_iters: 2, decay: cosine, minimum_learning_rate_ratio: 0.1}",
    )
    _, history = train(config)
    assert [record.learning_rate for record in history] == pytest.approx(
        [expected_learning_rate(step, 0.01, 6, 2, "cosine", 0.1) for step in range(6)], rel=1e-12
    )


# ---------------------------------------------------------------------------------------------------------------------
# Non-finite values stop the run and leave the last checkpoint intact


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    snapshot = {}

    def poison_after_the_checkpoint(message: str) -> None:
        if message.startswith("saved checkpoint"):
            snapshot.update(checkpoint_files(tmp_path / "step_2"))
            with torch.no_grad():
                trainer.model.head.output_weight[0, 0] = float("inf")

    config = configure(tmp_path, "training.train_iters=5", "training.checkpoint_interval=2")
    trainer = Trainer(config, log=poison_after_the_checkpoint)
    with pytest.raises(TrainingError) as caught:
        trainer.run()
    assert (
        str(caught.value)
        == f"the loss is nan at step 3; stopping, the last checkpoint ({tmp_path / 'step_2'}) is intact"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "step_2"]
    assert checkpoint_files(tmp_path / "step_2") == snapshot
    loaded = blockzoo.load(tmp_path)
    assert all(torch.isfinite(parameter).all() for parameter in loaded.parameters())


@pytest.mark.parametrize(
    ("device", "on_device"),
    [("cpu", True), ("cpu", False), pytest.param("cuda", True, marks=pytest.mark.gpu)],
    ids=["cpu-skipped-on-the-device", "cpu-checked-by-the-host", "cuda"],
)
def test_a_non_finite_gradient_stops_the_run_before_the_update(tmp_path, device, on_device):
    """The fused AdamW skips a non-finite update on the device; an optimizer that cannot waits for the host's check
    (here: the same one told so)."""

    def poison_gradients_after_the_checkpoint(message: str) -> None:
        if message.startswith("saved checkpoint"):
            trainer.model.head.output_weight.register_hook(lambda gradient: gradient * float("inf"))

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine)")
    backend = ["distributed.backend=nccl"] if device == "cuda" else []
    config = configure(tmp_path, "training.train_iters=5", "training.checkpoint_interval=1", *backend)
    trainer = Trainer(config, log=poison_gradients_after_the_checkpoint)
    assert trainer.optimizer.skips_non_finite_on_device
    trainer.optimizer.skips_non_finite_on_device = on_device
    with pytest.raises(TrainingError, match=r"^the gradient norm is (nan|inf) at step 2; stopping, the last check"):
        trainer.run()
    assert all(torch.isfinite(parameter).all() for parameter in trainer.model.parameters())
    saved = load_file(tmp_path / "step_1" / "model.safetensors")
    assert all(torch.equal(saved[name], value.cpu()) for name, value in weights(trainer.model).items())


def test_figures_read_at_the_log_line_stop_at_the_first_non_finite_step_with_its_weights(tmp_path):
    """Between log lines the host does not wait for the device: a non-finite gradient at step 2 is seen when step 4
    logs, and steps 2 to 4 left the weights as step 1 made them (compared with a run of one step)."""
    (tmp_path / "one").mkdir()
    one_step, _ = train(configure(tmp_path / "one", "training.train_iters=1"))
    config = configure(tmp_path / "run", "training.train_iters=6", "training.log_interval=4")
    trainer = Trainer(config, log=quiet)
    step = trainer._train_step

    def poisoning_step(*args, **kwargs):
        if trainer.step == 1:
            trainer.model.head.output_weight.register_hook(lambda gradient: gradient * float("inf"))
        return step(*args, **kwargs)

    trainer._train_step = poisoning_step
    with pytest.raises(TrainingError, match=r"^the gradient norm is (nan|inf) at step 2; stopping, no checkpoint"):
        trainer.run()
    assert trainer.step == 4
    assert [record.step for record in trainer.history] == [1]
    for name, value in weights(trainer.model).items():
        assert torch.equal(value, weights(one_step.model)[name]), name
    assert not (tmp_path / "run" / "step_4").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints, evaluation, numerics, logs


def test_checkpoints_at_the_interval_and_the_end_keeping_the_last(tmp_path):
    messages = []
    config = configure(
        tmp_path, "training.train_iters=5", "training.checkpoint_interval=2", "training.checkpoint_keep=2"
    )
    train(config, log=messages.append)
    saved = [message for message in messages if message.startswith("saved checkpoint")]
    assert saved == [f"saved checkpoint {tmp_path / f'step_{step}'}" for step in (2, 4, 5)]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "step_4", "step_5"]
    assert yaml.safe_load((tmp_path / "step_5" / "metadata.yaml").read_text())["step"] == 5


def test_evaluation_runs_at_its_interval_and_at_the_end(tmp_path):
    messages = []
    config = configure(tmp_path, "training.train_iters=5", "training.evaluation={interval: 2, iters: 3}")
    trainer, _ = train(config, log=messages.append)
    assert [step for step, _ in trainer.evaluations] == [2, 4, 5]
    assert all(math.isfinite(loss) for _, loss in trainer.evaluations)
    assert [m.split(":")[0] for m in messages if m.startswith("evaluation")] == [
        f"evaluation at step {step}" for step in (2, 4, 5)
    ]
    # The last one is the final model's loss over the first 3 micro-batches (6 sequences) of the evaluation split.
    dataset = build_dataset(config.data, seed=config.distributed.seed, model_vocab_size=VOCAB)
    with torch.no_grad():
        expected = reference_loss(trainer.model, [dataset.evaluation_sample(index) for index in range(6)])
    assert trainer.evaluations[-1][1] == pytest.approx(float(expected), rel=1e-5)


def test_bf16_compute_trains_with_fp32_master_weights(tmp_path):
    overrides = ["training.train_iters=20", "training.optimizer.learning_rate=0.03"]
    trainer, history = train(configure(tmp_path / "bf16", *overrides, "distributed.compute_dtype=bf16"))
    _, fp32_history = train(configure(tmp_path / "fp32", *overrides, "training.train_iters=1"))
    losses = [record.loss for record in history]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert losses[0] != fp32_history[0].loss  # the forward pass ran in bf16
    assert losses[0] == pytest.approx(fp32_history[0].loss, rel=2e-2)
    assert all(parameter.dtype == torch.float32 for parameter in trainer.model.parameters())
    tokens = torch.arange(8)
    assert trainer.model.forward_packed(tokens, Batch([8])).dtype == torch.bfloat16


LOG_LINE = re.compile(
    r"^step (\d+)/4 \| loss (\S+) \| lr (\S+) \| grad norm (\S+) \| ([\d,]+) tokens/s \| (\S+) TFLOP/s"
    r"(?: \| MFU (\S+)%)?$"
)


@pytest.mark.parametrize("peak_tflops", [None, 0.0001])
def test_log_lines_report_loss_lr_gradient_norm_throughput_and_mfu(tmp_path, peak_tflops):
    messages = []
    config = configure(tmp_path, "training.log_interval=2", f"training.peak_tflops={peak_tflops or 'null'}")
    _, history = train(config, log=messages.append)
    lines = [LOG_LINE.match(message) for message in messages if "tokens/s" in message]
    assert all(lines) and [int(line[1]) for line in lines] == [2, 4]
    for line in lines:
        record = history[int(line[1]) - 1]
        assert line[2] == f"{record.loss:.4f}"
        assert line[3] == f"{record.learning_rate:.3g}" and line[4] == f"{record.gradient_norm:.3g}"
        tokens_per_second, tflops = float(line[5].replace(",", "")), float(line[6])
        # A bigram model's FLOPs per token: the output projection, forward and backward (2 + 4) × hidden × vocab.
        assert tflops * 1e12 / tokens_per_second == pytest.approx(6 * 16 * VOCAB, rel=1e-2)
        if peak_tflops is None:
            assert line[7] is None
        else:
            assert float(line[7]) / 100 == pytest.approx(tflops / peak_tflops, rel=1e-2)


# ---------------------------------------------------------------------------------------------------------------------
# The command line


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    data = {**BASE, "training": {**BASE["training"], "output_dir": str(tmp_path / "run")}}
    path.write_text(yaml.safe_dump(data))
    return path


def blockzoo_command(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockzoo", *arguments], capture_output=True, text=True, timeout=120)


def test_the_train_command_trains_and_writes_a_checkpoint(tmp_path):
    done = blockzoo_command("train", str(write_config(tmp_path)), "training.train_iters=3", "training.log_interval=3")
    assert done.returncode == 0, done.stderr
    assert "step 3/3 | loss" in done.stdout and f"saved checkpoint {tmp_path / 'run' / 'step_3'}" in done.stdout
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "step_3"
    assert yaml.safe_load((tmp_path / "run" / "step_3" / "config.yaml").read_text())["training"]["train_iters"] == 3


def test_the_train_command_stops_on_a_non_finite_loss(tmp_path, capsys):
    # A finite weight (configs refuse inf) whose logits overflow float32.
    infinite = "model.head.output_weight.initialization={type: fill, value: 1.0e+38}"
    assert cli.main(["train", str(write_config(tmp_path)), infinite]) == 1
    error = capsys.readouterr().err
    assert error == "blockzoo: error: the loss is nan at step 1; stopping, no checkpoint was written\n"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.train_iters=many", "training.train_iters: expected an integer, got 'many' (str)"),
        ("training.train_iter=3", "training.train_iter: unknown key; did you mean 'train_iters'?"),
        ("data={type: memmap, path: nowhere/tokens}", "no dataset at nowhere/tokens"),
    ],
)
def test_the_train_command_refuses_bad_input_in_one_paragraph(tmp_path, capsys, override, message):
    assert cli.main(["train", str(write_config(tmp_path)), override]) == 2
    error = capsys.readouterr().err
    assert error.startswith("blockzoo: error: ") and message in error
    assert "Traceback" not in error and "\n\n" not in error.strip()
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Data and tensor parallelism: the single-process run, split differently

# Rank r of 2 data-parallel ranks takes samples r, r + 2, ...: two ranks of 2 sequences read the 4 sequences of one
# micro-batch of 4. Under tensor parallelism both ranks read the whole micro-batch.
PARALLEL_COMMON = ["training.train_iters=3", "training.gradient_accumulation=2", "training.schedule.warmup_iters=1"]
PARALLEL_CASES = {
    "data_parallel": ["data.micro_batch_size=2"],
    "tensor_parallel": [
        "data.micro_batch_size=4",
        "distributed.tensor_parallel=2",
        "distributed.sequence_tensor_parallel=true",
    ],
}


def _parallel_runs(root: str, backend: str) -> None:
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    try:
        for name, overrides in PARALLEL_CASES.items():
            config = configure(Path(root) / name, *PARALLEL_COMMON, *overrides, f"distributed.backend={backend}")
            with Distributed(config.distributed) as distributed:
                history = Trainer(config, distributed=distributed, log=quiet).run()
            if dist.get_rank() == 0:
                records = [[record.loss, record.gradient_norm] for record in history]
                (Path(root) / f"{name}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def check_parallel_runs(root: Path, tolerance: float) -> None:
    _, history = train(configure(root / "single", *PARALLEL_COMMON, "data.micro_batch_size=4"))
    expected = [[record.loss, record.gradient_norm] for record in history]
    final = load_file(root / "single" / "step_3" / "model.safetensors")
    for name in PARALLEL_CASES:
        records = json.loads((root / f"{name}.json").read_text())
        assert len(records) == len(expected), name
        for record, reference in zip(records, expected):
            assert record == pytest.approx(reference, rel=tolerance), name
        saved = load_file(root / name / "step_3" / "model.safetensors")
        assert saved.keys() == final.keys()
        for key, value in final.items():
            assert torch.allclose(saved[key], value, rtol=tolerance, atol=tolerance), f"{name}: {key}"


@pytest.mark.distributed
def test_data_and_tensor_parallel_runs_match_the_single_process_run(tmp_path):
    run_distributed(2, _parallel_runs, str(tmp_path), "gloo")
    check_parallel_runs(tmp_path, 1e-5)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_data_and_tensor_parallel_runs_on_gpus_match_the_single_process_run(tmp_path):
    run_distributed(2, _parallel_runs, str(tmp_path), "nccl")
    check_parallel_runs(tmp_path, 1e-4)


@pytest.mark.gpu
def test_training_on_a_gpu(tmp_path):
    overrides = ["training.train_iters=20", "training.optimizer.learning_rate=0.03", "distributed.compute_dtype=bf16"]
    trainer, history = train(
        configure(tmp_path, *overrides, "distributed.backend=nccl", "training.evaluation.interval=10")
    )
    assert trainer.model.embeddings.word_embeddings.is_cuda
    losses = [record.loss for record in history]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert [step for step, _ in trainer.evaluations] == [10, 20]
