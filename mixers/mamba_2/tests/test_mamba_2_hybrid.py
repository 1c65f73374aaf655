"""A hybrid language model (a `pattern` decoder of Mamba 2, attention and MLP-only blocks) built with
`blockzoo.build`: packed documents equal separate runs, generation through the Mamba 2 state and the KV cache
equals greedy decoding by full forwards, and it trains on the CPU (the loss falls) and reloads from its checkpoint.
Needs blockzoo-attention and blockzoo-mlp (`[tool.blockzoo] test-with` in pyproject.toml)."""

import torch

import blockzoo
from blockzoo.config import structure
from blockzoo.layers.base import Batch
from blockzoo.run_config import RunConfig
from blockzoo_mamba_2.mamba_2 import Mamba2, Mamba2State
from blockzoo_testing import check_trains_and_reloads, greedy_by_full_forward

VOCAB = 64
LENGTHS = [5, 1, 9]
PROMPTS = [[3, 14, 15, 9, 2, 6], [5], [35, 8, 9]]
MLP = {"type": "mlp", "intermediate_size": 48, "gated": True}
DECODER = {
    "type": "pattern",
    "num_blocks": 4,  # ssm, attn, ffn, ssm
    "pattern": ["ssm", "attn", "ffn"],
    "blocks": {
        "ssm": {
            "mixer": {
                "type": "mamba_2",
                "heads": 4,
                "head_size": 8,
                "groups": 2,
                "state_size": 8,
                "chunk_size": 4,
                "dt_bias": {"initialization": {"type": "normal", "std": 1.0}},
            },
            "mlp": {"type": "none"},
        },
        "attn": {"mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8}, "mlp": MLP},
        "ffn": {"mixer": {"type": "none"}, "mlp": MLP},
    },
}


def _model_data(vocab: int = VOCAB) -> dict:
    return {"hidden_size": 32, "embeddings": {"vocab_size": vocab}, "decoder": DECODER}


def _run_config(**sections) -> RunConfig:
    return structure({"model": _model_data(), "distributed": {"seed": 7, "backend": "gloo"}, **sections}, RunConfig)


def test_the_pattern_builds_mamba_2_blocks():
    model = blockzoo.build(_run_config())
    assert [type(block.mixer).__name__ if block.mixer is not None else None for block in model.decoder] == [
        "Mamba2",
        "Attention",
        None,
        "Mamba2",
    ]
    assert isinstance(model.decoder[0].mixer, Mamba2) and not hasattr(model.decoder[0], "norm_2")
    assert "decoder.3.mixer.in_proj.weight" in dict(model.named_parameters())


def test_packed_documents_equal_separate_runs():
    model = blockzoo.build(_run_config())
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(len(tokens), VOCAB, generator=torch.Generator().manual_seed(1))
    packed = model.forward_packed(tokens, Batch(LENGTHS))
    (packed * weights).sum().backward()
    packed_gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    separate = []
    for document, document_weights in zip(tokens.split(LENGTHS), weights.split(LENGTHS)):
        logits = model.forward_packed(document, Batch([len(document)]))
        (logits * document_weights).sum().backward()
        separate.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(separate), atol=1e-5, rtol=1e-5)
    for name, parameter in model.named_parameters():
        scale = float(parameter.grad.abs().max())
        torch.testing.assert_close(packed_gradients[name], parameter.grad, atol=1e-6 * scale, rtol=1e-4, msg=name)


def test_generation_equals_greedy_decoding_by_full_forwards():
    model = blockzoo.build(_run_config())
    states = [block.new_state(3, 16, torch.device("cpu"), torch.float32) for block in model.decoder]
    assert isinstance(states[0], Mamba2State) and states[2] is None
    expected = [greedy_by_full_forward(model, prompt, 6) for prompt in PROMPTS]
    assert model.generate(PROMPTS, 6) == expected


def test_trains_on_cpu_and_reloads(tmp_path):
    run_config = structure(
        {
            "model": _model_data(vocab=257),
            "distributed": {"seed": 7, "backend": "gloo"},
            "data": {"type": "embedded", "sequence_length": 64, "micro_batch_size": 4},
            "training": {
                "train_iters": 12,
                "optimizer": {"type": "adamw", "learning_rate": 1.0e-2},
                "schedule": {"warmup_iters": 2},
                "log_interval": 4,
                "output_dir": str(tmp_path),
            },
        },
        RunConfig,
    )
    # Every Mamba 2 parameter is trained; the checkpoint (config.yaml with the mixer's settings, global tensors)
    # rebuilds the trained model.
    trainer, reloaded = check_trains_and_reloads(
        run_config, moved=lambda name: ".mixer." in name and name.startswith(("decoder.0.", "decoder.3."))
    )
    assert reloaded.config == trainer.model.config
