"""The core language model: shapes, packed documents, tied weights, every config field, parameter names and
learning-rate scales, save/load, and the refusal of layouts a layer cannot run. The core alone builds no mixer or
MLP, so a tiny causal mixer and a dense MLP are defined here and registered as an in-process plugin."""

import types

import attrs
import pytest
import torch
from safetensors.torch import load_file

import blockzoo
import blockzoo.layers.parameter
from blockzoo.api import (
    TENSOR_PARALLEL,
    LinearConfig,
    MixerConfig,
    MLPConfig,
    NormalInitializationConfig,
    configclass,
    field,
    hookimpl,
)
from blockzoo.checkpoint import CheckpointError
from blockzoo.config import ConfigError, merge, structure
from blockzoo.conversion import Origin
from blockzoo.layers.base import MLP, Batch, Mixer
from blockzoo.layers.config import LayerNormalizationConfig, ParameterConfig, RMSNormalizationConfig
from blockzoo.layers.linear import Linear
from blockzoo.model.config import (
    DecoderBlockConfig,
    EmbeddingsConfig,
    FixedBlockSequenceConfig,
    HeadConfig,
    ModelConfig,
    ParallelBlockConfig,
    PatternBlockSequenceConfig,
)
from blockzoo.model.language_model import LanguageModel
from blockzoo.plugins import get_registry, register_plugin
from blockzoo.run_config import RunConfig

# ---------------------------------------------------------------------------------------------------------------------
# The test plugin: a causal mixer (the mean of the document's states so far, projected) and a dense MLP.


@configclass
class PrefixMeanMixerConfig(MixerConfig):
    """Each token takes a projection of the mean of its document's hidden states up to and including it."""

    projection: LinearConfig = field(factory=LinearConfig, doc="Maps the prefix mean.")


@configclass
class TensorParallelMixerConfig(MixerConfig):
    """Declares tensor parallelism but not its sequence-parallel variant (only structured, never built)."""

    capabilities = frozenset({TENSOR_PARALLEL})


@configclass
class DenseMLPConfig(MLPConfig):
    layer: LinearConfig = field(factory=LinearConfig, doc="The token-wise map, followed by tanh.")


def _linear(name, config, hidden_dim, distributed, lr_scale) -> Linear:
    initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
    return Linear(
        name, config, hidden_dim, hidden_dim, distributed, default_initialization=initialization, lr_scale=lr_scale
    )


class PrefixMeanMixer(Mixer):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        self.projection = _linear(f"{name}.projection", config.projection, hidden_dim, distributed, lr_scale)

    def forward(self, hidden, batch, state=None):
        means = [
            piece.cumsum(0) / torch.arange(1, len(piece) + 1, dtype=piece.dtype, device=piece.device)[:, None]
            for piece in hidden.split(batch.lengths.tolist())
        ]
        return self.projection(torch.cat(means))

    def flops(self, batch):
        return self.projection.forward_flops(batch.num_tokens), self.projection.backward_flops(batch.num_tokens)


class DenseMLP(MLP):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        self.layer = _linear(f"{name}.layer", config.layer, hidden_dim, distributed, lr_scale)

    def forward(self, hidden, batch, state=None):
        return torch.tanh(self.layer(hidden))

    def flops(self, batch):
        return self.layer.forward_flops(batch.num_tokens), self.layer.backward_flops(batch.num_tokens)


@hookimpl
def _register_mixers(register):
    register("toy.prefix_mean", PrefixMeanMixerConfig, f"{__name__}:PrefixMeanMixer")
    register("toy.tensor_parallel", TensorParallelMixerConfig)


@hookimpl
def _register_mlps(register):
    register("toy.dense", DenseMLPConfig, f"{__name__}:DenseMLP")


@pytest.fixture(autouse=True)
def toy_plugin(fresh_registry):
    register_plugin(types.SimpleNamespace(register_mixers=_register_mixers, register_mlps=_register_mlps), "toy")


MIXER = {"type": "toy.prefix_mean"}
DENSE_MLP = {"type": "toy.dense"}
BLOCK = {"mixer": MIXER, "mlp": DENSE_MLP}
MODEL = {"hidden_size": 8, "embeddings": {"vocab_size": 16}, "decoder": {"num_blocks": 2, "block": BLOCK}}


def build(model: dict | None = None, **changes) -> LanguageModel:
    return blockzoo.build({"model": merge(model or MODEL, changes)})


def logits_of(model: LanguageModel, rows: int = 2, length: int = 5) -> torch.Tensor:
    tokens = torch.arange(rows * length).view(rows, length) % 13
    with torch.no_grad():
        return model(tokens)


# ---------------------------------------------------------------------------------------------------------------------
# The forward pass


def test_logits_are_batch_by_sequence_by_vocab():
    model = build()
    assert logits_of(model, rows=3, length=7).shape == (3, 7, 16)
    assert logits_of(model).dtype == torch.float32
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, sequence\], got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.int64))


def test_packed_documents_equal_each_document_run_alone():
    model = build(embeddings={"vocab_size": 16, "position_embeddings": True})
    documents = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9]), torch.tensor([2, 6, 5, 3])]
    tokens, batch = Batch.from_documents(documents)
    weights = torch.randn(len(tokens), 16, generator=torch.Generator().manual_seed(0))

    packed = model.forward_packed(tokens, batch)
    (packed * weights).sum().backward()
    packed_gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    alone = []
    for document, document_weights in zip(documents, weights.split([len(d) for d in documents])):
        logits = model.forward_packed(document, Batch([len(document)]))
        (logits * document_weights).sum().backward()  # gradients accumulate over the documents
        alone.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(alone), rtol=1e-6, atol=1e-6)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            packed_gradients[name], parameter.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_tied_output_weight_is_the_embedding_table_and_saved_once(tmp_path):
    tied, untied = build(tied_embedding_weight=True), build()
    assert tied.head.output_weight is tied.embeddings.word_embeddings
    assert untied.head.output_weight is not untied.embeddings.word_embeddings
    names = [name for name, _ in tied.named_parameters()]
    assert "head.output_weight" not in names and "embeddings.word_embeddings" in names
    # The tied logits are the normalized hidden states times the embedding table.
    torch.testing.assert_close(
        tied.head(torch.eye(8)), tied.head.normalization(torch.eye(8)) @ tied.embeddings.word_embeddings.T
    )

    blockzoo.save(tied, tmp_path / "tied")
    blockzoo.save(untied, tmp_path / "untied")
    saved = load_file(tmp_path / "tied" / "model.safetensors")
    assert saved.keys() == set(names) and torch.equal(saved["embeddings.word_embeddings"], tied.head.output_weight)
    saved = load_file(tmp_path / "untied" / "model.safetensors")
    assert {"embeddings.word_embeddings", "head.output_weight"} <= saved.keys()
    loaded = blockzoo.load(tmp_path / "tied")
    assert loaded.head.output_weight is loaded.embeddings.word_embeddings


# ---------------------------------------------------------------------------------------------------------------------
# Every declared field of the core model configs changes the parameters or the outputs

POSITIONS = merge(MODEL, {"embeddings": {"position_embeddings": True}})
LAYER_NORM_HEAD = merge(MODEL, {"head": {"normalization": {"type": "layer_norm"}}})
PATTERN = {
    **MODEL,
    "decoder": {
        "type": "pattern",
        "blocks": {"full": BLOCK, "mixer_only": {"mixer": MIXER, "mlp": {"type": "none"}}},
        "pattern": ["full", "mixer_only"],
    },
}


PARALLEL = {
    **MODEL,
    "decoder": {
        "num_blocks": 2,
        "block": {"type": "parallel", "mixers": {"a": MIXER, "b": MIXER}, "mlp": DENSE_MLP},
    },
}


def _block(**changes) -> dict:
    return {"decoder": {"block": changes}}


def _head_norm(**changes) -> dict:
    return {"head": {"normalization": changes}}


def _word_embeddings(**changes) -> dict:
    return {"embeddings": {"word_embeddings": changes}}


FILL_2 = {"initialization": {"type": "fill", "value": 2.0}}
LORA = {"type": "lora", "rank": 2}  # its fields: tests/test_lora.py (they need the plugins' linears)

MODEL_CONFIG_CLASSES = {
    ModelConfig,
    EmbeddingsConfig,
    HeadConfig,
    DecoderBlockConfig,
    ParallelBlockConfig,
    FixedBlockSequenceConfig,
    PatternBlockSequenceConfig,
    RMSNormalizationConfig,
    LayerNormalizationConfig,
    ParameterConfig,
}

# (config class, field) -> (the base model config, the change to it).
FIELD_CASES = {
    (ModelConfig, "hidden_size"): (MODEL, {"hidden_size": 12}),
    (ModelConfig, "tied_embedding_weight"): (MODEL, {"tied_embedding_weight": True}),
    (ModelConfig, "embeddings"): (MODEL, {"embeddings": {"position_embeddings": True}}),
    (ModelConfig, "decoder"): (MODEL, {"decoder": {"num_blocks": 1}}),
    (ModelConfig, "head"): (MODEL, _head_norm(type="none")),
    (ModelConfig, "lr_scale"): (MODEL, {"lr_scale": 0.5}),
    (ModelConfig, "peft"): (merge(MODEL, _block(mixer={**MIXER, "projection": {"apply_peft": True}})), {"peft": LORA}),
    (EmbeddingsConfig, "vocab_size"): (MODEL, {"embeddings": {"vocab_size": 20}}),
    (EmbeddingsConfig, "word_embeddings"): (MODEL, _word_embeddings(**FILL_2)),
    (EmbeddingsConfig, "position_embeddings"): (MODEL, {"embeddings": {"position_embeddings": True}}),
    (EmbeddingsConfig, "num_position_embeddings"): (POSITIONS, {"embeddings": {"num_position_embeddings": 64}}),
    (EmbeddingsConfig, "lr_scale"): (MODEL, {"embeddings": {"lr_scale": 0.5}}),
    (EmbeddingsConfig, "multiplier"): (MODEL, {"embeddings": {"multiplier": 2.0}}),
    (HeadConfig, "normalization"): (MODEL, _head_norm(type="layer_norm")),
    (HeadConfig, "output_weight"): (MODEL, {"head": {"output_weight": FILL_2}}),
    (HeadConfig, "lr_scale"): (MODEL, {"head": {"lr_scale": 0.5}}),
    (HeadConfig, "logits_multiplier"): (MODEL, {"head": {"logits_multiplier": 2.0}}),
    (DecoderBlockConfig, "mixer"): (MODEL, _block(mixer={"type": "none"})),
    (DecoderBlockConfig, "mlp"): (MODEL, _block(mlp={"type": "none"})),
    (DecoderBlockConfig, "normalization"): (MODEL, _block(normalization={"epsilon": 10.0})),
    (DecoderBlockConfig, "post_mixer_normalization"): (MODEL, _block(post_mixer_normalization={"type": "rms_norm"})),
    (DecoderBlockConfig, "post_mlp_normalization"): (MODEL, _block(post_mlp_normalization={"type": "rms_norm"})),
    (DecoderBlockConfig, "residual_multiplier"): (MODEL, _block(residual_multiplier=0.5)),
    (DecoderBlockConfig, "lr_scale"): (MODEL, _block(lr_scale=0.5)),
    (ParallelBlockConfig, "mixers"): (PARALLEL, _block(mixers={"c": MIXER})),
    (ParallelBlockConfig, "input_multipliers"): (PARALLEL, _block(input_multipliers={"a": 2.0})),
    (ParallelBlockConfig, "output_multipliers"): (PARALLEL, _block(output_multipliers={"b": 0.5})),
    (ParallelBlockConfig, "mlp"): (PARALLEL, _block(mlp={"type": "none"})),
    (ParallelBlockConfig, "normalization"): (PARALLEL, _block(normalization={"epsilon": 10.0})),
    (ParallelBlockConfig, "residual_multiplier"): (PARALLEL, _block(residual_multiplier=0.5)),
    (ParallelBlockConfig, "lr_scale"): (PARALLEL, _block(lr_scale=0.5)),
    (FixedBlockSequenceConfig, "block"): (MODEL, _block(mixer={"type": "none"})),
    (FixedBlockSequenceConfig, "num_blocks"): (MODEL, {"decoder": {"num_blocks": 3}}),
    (PatternBlockSequenceConfig, "blocks"): (PATTERN, {"decoder": {"blocks": {"mixer_only": {"lr_scale": 0.5}}}}),
    (PatternBlockSequenceConfig, "pattern"): (PATTERN, {"decoder": {"pattern": ["mixer_only", "full"]}}),
    (PatternBlockSequenceConfig, "num_blocks"): (PATTERN, {"decoder": {"num_blocks": 3}}),
    (RMSNormalizationConfig, "epsilon"): (MODEL, _head_norm(epsilon=10.0)),
    (RMSNormalizationConfig, "weight"): (MODEL, _head_norm(weight=FILL_2)),
    (RMSNormalizationConfig, "lr_scale"): (MODEL, _head_norm(lr_scale=0.5)),
    (LayerNormalizationConfig, "epsilon"): (LAYER_NORM_HEAD, _head_norm(epsilon=10.0)),
    (LayerNormalizationConfig, "weight"): (LAYER_NORM_HEAD, _head_norm(weight=FILL_2)),
    (LayerNormalizationConfig, "bias"): (LAYER_NORM_HEAD, _head_norm(bias=FILL_2)),
    (LayerNormalizationConfig, "lr_scale"): (LAYER_NORM_HEAD, _head_norm(lr_scale=0.5)),
    (ParameterConfig, "initialization"): (MODEL, _word_embeddings(initialization={"std": 3.0})),
    (ParameterConfig, "lr_scale"): (MODEL, _word_embeddings(lr_scale=0.5)),
    (ParameterConfig, "weight_decay"): (MODEL, _word_embeddings(weight_decay=False)),
}


def test_every_field_of_the_model_configs_has_a_case():
    # The core's blocks, block sequences and normalizations with fields are all here (a new one needs cases too).
    core_types = {
        entry.config_class
        for kind in ("block", "block_sequence", "normalization")
        for entry in get_registry().entries(kind)
        if entry.plugin.name == "blockzoo" and attrs.fields(entry.config_class)
    }
    assert core_types <= MODEL_CONFIG_CLASSES
    declared = {(cls, attribute.name) for cls in MODEL_CONFIG_CLASSES for attribute in attrs.fields(cls)}
    # `pretrained` names a checkpoint on disk: test_pretrained_starts_from_the_saved_weights covers it; `preset` names
    # an architecture whose fields are the others: core/tests/test_presets_registry.py covers it.
    assert declared - {(ModelConfig, "pretrained"), (ModelConfig, "preset")} == set(FIELD_CASES)


def test_pretrained_starts_from_the_saved_weights(tmp_path):
    saved = build(MODEL)
    with torch.no_grad():
        for parameter in saved.parameters():
            parameter.add_(torch.randn_like(parameter))  # weights no fresh build has
    blockzoo.save(saved, tmp_path / "checkpoint")
    loaded = build({**MODEL, "pretrained": str(tmp_path / "checkpoint")})
    assert loaded.config.pretrained is None  # consumed: the built model's config does not point to the files
    assert _same(_fingerprint(loaded), _fingerprint(saved))
    assert not _same(_fingerprint(build(MODEL)), _fingerprint(saved))


def test_models_loaded_from_checkpoints_are_not_initialized_first(tmp_path, monkeypatch):
    blockzoo.save(build(MODEL), tmp_path / "checkpoint")
    monkeypatch.setattr(blockzoo.layers.parameter, "initialize_parameter", _never_called)
    blockzoo.load(tmp_path / "checkpoint")
    build({**MODEL, "pretrained": str(tmp_path / "checkpoint")})
    with pytest.raises(AssertionError, match="initialized"):
        build(MODEL)


def _never_called(parameter, distributed):
    raise AssertionError(f"{parameter.meta.name} initialized, then overwritten by the checkpoint")


def test_origin_files_follow_the_model_through_native_checkpoints(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"bos_token_id": 5}')
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    model = build(MODEL)
    assert model.origin is None
    model.origin = Origin(tmp_path / "hf", ("config.json", "tokenizer.json"))  # as an import from that format sets it
    blockzoo.save(model, tmp_path / "first")
    loaded = blockzoo.load(tmp_path / "first")
    assert loaded.origin == Origin(tmp_path / "first" / "origin", ("config.json", "tokenizer.json"))
    blockzoo.save(loaded, tmp_path / "second")
    pretrained = build({**MODEL, "pretrained": str(tmp_path / "second")})
    assert pretrained.origin == Origin(tmp_path / "second" / "origin", ("config.json", "tokenizer.json"))
    assert (tmp_path / "second" / "origin" / "config.json").read_text() == '{"bos_token_id": 5}'


def _fingerprint(model: LanguageModel) -> dict:
    """Everything a field may change: each parameter's shape, values and optimizer settings, and the logits."""
    parameters = {
        name: (
            tuple(parameter.shape),
            parameter.detach().clone(),
            [(settings.lr_scale, settings.weight_decay) for settings in parameter.meta.settings],
        )
        for name, parameter in model.named_parameters()
    }
    return {"parameters": parameters, "logits": logits_of(model)}


def _same(first: dict, second: dict) -> bool:
    if first["parameters"].keys() != second["parameters"].keys():
        return False
    for name, (shape, values, settings) in first["parameters"].items():
        other_shape, other_values, other_settings = second["parameters"][name]
        if shape != other_shape or settings != other_settings or not torch.equal(values, other_values):
            return False
    return first["logits"].shape == second["logits"].shape and torch.equal(first["logits"], second["logits"])


@pytest.mark.parametrize(("cls", "name"), list(FIELD_CASES), ids=[f"{c.__name__}.{n}" for c, n in FIELD_CASES])
def test_every_field_changes_the_parameters_or_the_outputs(cls, name):
    base, change = FIELD_CASES[(cls, name)]
    assert _same(_fingerprint(build(base)), _fingerprint(build(base)))  # building is reproducible
    assert not _same(_fingerprint(build(base)), _fingerprint(build(merge(base, change))))


# ---------------------------------------------------------------------------------------------------------------------
# Parameter names and learning-rate scales


def test_the_pattern_lays_out_its_named_blocks_in_order():
    model = build(PATTERN, decoder={"num_blocks": 5})
    with_mlp = [index for index in range(5) if f"decoder.{index}.mlp.layer.weight" in dict(model.named_parameters())]
    assert with_mlp == [0, 2, 4]  # full, mixer_only, full, mixer_only, full
    names = {name for name, _ in model.named_parameters()}
    assert {f"decoder.{index}.mixer.projection.weight" for index in range(5)} <= names
    # The factory's names (initialization seeds, checkpoints) are the module paths.
    for name, parameter in model.named_parameters():
        assert parameter.meta.name == name


def test_lr_scale_multiplies_down_the_tree():
    model = build(
        lr_scale=0.5,
        embeddings={"vocab_size": 16, "lr_scale": 0.4, "word_embeddings": {"lr_scale": 0.3}},
        decoder={"block": {**BLOCK, "lr_scale": 0.4, "normalization": {"lr_scale": 0.3}}},
        head={"lr_scale": 0.2, "normalization": {"lr_scale": 0.3}},
    )
    parameters = dict(model.named_parameters())
    expected = {
        "embeddings.word_embeddings": 0.5 * 0.4 * 0.3,
        "decoder.1.norm_1.weight": 0.5 * 0.4 * 0.3,
        "decoder.1.mixer.projection.weight": 0.5 * 0.4,
        "head.normalization.weight": 0.5 * 0.2 * 0.3,
        "head.output_weight": 0.5 * 0.2,
    }
    for name, lr_scale in expected.items():
        assert parameters[name].meta.settings[0].lr_scale == pytest.approx(lr_scale, rel=1e-12), name
    frozen = build(decoder={"block": {**BLOCK, "lr_scale": 0.0}})
    for name, parameter in frozen.named_parameters():
        assert parameter.requires_grad == (not name.startswith("decoder.")), name


# ---------------------------------------------------------------------------------------------------------------------
# Save and load


def test_save_then_load_gives_bit_identical_logits(tmp_path):
    model = build(PATTERN, embeddings={"vocab_size": 16, "position_embeddings": True})
    with torch.no_grad():  # weights unlike any fresh initialization
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    blockzoo.save(model, tmp_path / "run" / "step_7")
    for path in (tmp_path / "run" / "step_7", tmp_path / "run"):  # a checkpoint, or a run's latest
        loaded = blockzoo.load(path)
        assert loaded.config == model.config
        assert torch.equal(logits_of(loaded), logits_of(model))


def test_load_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing: does not exist"):
        blockzoo.load(tmp_path / "missing")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="notes: is not a checkpoint"):
        blockzoo.load(tmp_path / "notes")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"hf: .*Hugging Face .*blockzoo-huggingface"):
        blockzoo.load(tmp_path / "hf")


# ---------------------------------------------------------------------------------------------------------------------
# Capabilities


def test_a_layout_the_mixer_cannot_run_is_refused_at_config_time():
    def problems(model: dict, **distributed) -> dict:
        with pytest.raises(ConfigError) as caught:
            structure({"model": model, "distributed": distributed}, RunConfig)
        return dict(caught.value.errors)

    assert problems(MODEL, tensor_parallel=2) == {
        "model.decoder.block.mixer": "mixer type 'toy.prefix_mean' does not support tensor-parallel "
        "(distributed.tensor_parallel)"
    }
    assert problems(PATTERN, tensor_parallel=2)["model.decoder.blocks.full.mixer"].startswith(
        "mixer type 'toy.prefix_mean'"
    )
    model = merge(MODEL, _block(mixer={"type": "toy.tensor_parallel"}, mlp={"type": "none"}))
    assert problems(model, tensor_parallel=2, sequence_tensor_parallel=True) == {
        "model.decoder.block.mixer": "mixer type 'toy.tensor_parallel' does not support sequence-tensor-parallel "
        "(distributed.sequence_tensor_parallel)"
    }
    # What it declares is accepted, and layers without a mixer or MLP run any layout.
    structure({"model": model, "distributed": {"tensor_parallel": 2}}, RunConfig)
    empty = merge(MODEL, _block(mixer={"type": "none"}, mlp={"type": "none"}))
    structure({"model": empty, "distributed": {"tensor_parallel": 2, "sequence_tensor_parallel": True}}, RunConfig)
