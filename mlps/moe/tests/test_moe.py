"""The mixture of experts on one process: against a plain per-token float64 loop for every routing variant, gated or
not, with and without biases and shared experts (outputs and gradients); the load-balancing and z-loss values and
gradients against their formulas; router jitter; every config field changes the layer; per-component settings;
FLOPs against a hand count; config errors; the plugin's registration; the expert order, the gather-based dispatch
and combine against plain indexing (gradcheck). On CUDA: no host sync in the routed path, and the compiled pieces
(BLOCKZOO_MOE_COMPILE=1) against the eager ones."""

import subprocess
import sys

import attrs
import pytest
import torch

from blockzoo.config import ConfigError, structure, update
from blockzoo.layers.base import Batch
from blockzoo.layers.config import GENERATION_CACHE, SEQUENCE_DATA_PARALLEL, TENSOR_PARALLEL, MLPConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.plugins import get_registry
from blockzoo_moe import dispatch as pairs
from blockzoo_moe.config import EXPERT_PARALLEL, MoEMLPConfig
from blockzoo_moe.dispatch import Combine, Dispatch, ExpertOrder
from blockzoo_moe.moe import MoEMLP
from blockzoo_testing import layer_inputs, reference_activation, single_process

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 8, 6, 5, 2
LENGTHS = [5, 6]
TOKENS = sum(LENGTHS)
# Non-zero biases, so that a misplaced bias shows.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
# The router's default std (hidden ** -0.5) gives nearly uniform probabilities; sharper ones test the routing better.
SHARP_ROUTER = {"weight": {"initialization": {"type": "normal", "std": 1.0}}}
ROUTINGS = {
    "softmax, top-k, renormalized": {"routing": "softmax_top_k", "norm_topk_prob": True},
    "softmax, top-k": {"routing": "softmax_top_k", "norm_topk_prob": False},
    "top-k, softmax": {"routing": "top_k_softmax"},
    "sigmoid, top-k, renormalized, scaled": {"routing": "sigmoid_top_k", "routed_scale": 2.5},
    # Six experts in three groups, each token choosing from its two best: DeepSeek-V3's and NemotronH's router.
    "sigmoid, top-k, groups, correction bias": {
        "routing": "sigmoid_top_k",
        "norm_topk_prob": False,
        "experts": 6,
        "routing_groups": 3,
        "routing_groups_per_token": 2,
        "score_correction_bias": True,
    },
}
SHARED = {
    "none": {},
    "two shared": {"shared_experts": 2},
    "two shared, gated": {"shared_experts": 2, "shared_expert_gate": RANDOM_BIAS | {"bias": {"enabled": True}}},
    # Qwen2-MoE / NemotronH: a shared MLP whose width is no multiple of the experts'.
    "one shared of its own width": {"shared_experts": 1, "shared_intermediate_size": INTERMEDIATE + 5},
}


def make_config(**data) -> MoEMLPConfig:
    base = {"type": "moe", "intermediate_size": INTERMEDIATE, "experts": EXPERTS, "experts_per_token": TOP_K}
    return structure({**base, "router": SHARP_ROUTER, **data}, MLPConfig)


def build(config: MoEMLPConfig, seed: int = 1) -> MoEMLP:
    distributed = single_process(seed)
    model = MoEMLP(
        config, name="block.mlp", hidden_dim=TensorDim("hidden", HIDDEN), distributed=distributed, lr_scale=1
    )
    if model.score_correction_bias is not None:  # zero until a checkpoint sets it: as one would
        with torch.no_grad():
            model.score_correction_bias.copy_(
                0.1 * torch.randn(config.experts, generator=torch.Generator().manual_seed(7))
            )
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return layer_inputs(TOKENS, HIDDEN)


def reference_mlp(config, x, gate_up_weight, gate_up_bias, down_weight, down_bias):
    """One MLP on one token; gate_up rows are [gate; up] when gated, down_weight is [hidden, intermediate]."""
    projected = gate_up_weight @ x + (0 if gate_up_bias is None else gate_up_bias)
    if config.gated:
        gate, up = projected.chunk(2)
        intermediate = reference_activation(config.activation, gate) * up
    else:
        intermediate = reference_activation(config.activation, projected)
    return down_weight @ intermediate + (0 if down_bias is None else down_bias)


def reference_routing(config, logits, correction_bias=None):
    """(scores, experts) of one token, from its logits, as Mixtral / Qwen-MoE / Fast-LLM / DeepSeek-V3 describe
    them."""
    if config.routing == "top_k_softmax":
        top_logits, experts = logits.topk(config.experts_per_token)
        return config.routed_scale * torch.exp(top_logits) / torch.exp(top_logits).sum(), experts
    if config.routing == "sigmoid_top_k":
        probabilities = 1 / (1 + torch.exp(-logits))
        choice = probabilities + (0 if correction_bias is None else correction_bias)
        size = config.experts // config.routing_groups
        group_scores = [sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(config.routing_groups)]
        groups = sorted(range(config.routing_groups), key=lambda g: sum(group_scores[g]))
        allowed = [e for g in groups[-config.routing_groups_per_token :] for e in range(g * size, (g + 1) * size)]
        experts = torch.tensor(sorted(allowed, key=lambda e: choice[e])[-config.experts_per_token :])
    else:
        probabilities = torch.exp(logits) / torch.exp(logits).sum()
        experts = probabilities.topk(config.experts_per_token).indices
    scores = probabilities[experts]
    return config.routed_scale * (scores / scores.sum() if config.norm_topk_prob else scores), experts


def reference_moe(model: MoEMLP, hidden: torch.Tensor):
    """The MoE token by token in float64 from the module's weights: (output, float64 leaves, experts per token)."""
    config = model.config
    leaves = {name: parameter.detach().double().requires_grad_() for name, parameter in model.named_parameters()}
    parts, experts = (2 if config.gated else 1), config.experts
    # The documented layouts: gate_up is [part, expert, intermediate, hidden]; down is [expert, intermediate, hidden].
    gate_up = leaves["gate_up.weight"].view(parts, experts, -1, HIDDEN)
    gate_up_bias = leaves["gate_up.bias"].view(parts, experts, -1) if "gate_up.bias" in leaves else None
    down = leaves["down.weight"].view(experts, -1, HIDDEN)
    down_bias = leaves["down.bias"].view(experts, HIDDEN) if "down.bias" in leaves else None
    outputs, chosen = [], []
    for x in hidden.double():
        logits = leaves["router.weight"] @ x
        scores, experts = reference_routing(config, logits, leaves.get("score_correction_bias"))
        chosen.append(sorted(experts.tolist()))
        output = 0
        for score, expert in zip(scores, experts.tolist()):
            output = output + score * reference_mlp(
                config,
                x,
                gate_up[:, expert].flatten(0, 1),
                None if gate_up_bias is None else gate_up_bias[:, expert].flatten(),
                down[expert].t(),
                None if down_bias is None else down_bias[expert],
            )
        if config.shared_experts:
            shared = reference_mlp(
                config,
                x,
                leaves["shared_gate_up.weight"],
                leaves.get("shared_gate_up.bias"),
                leaves["shared_down.weight"],
                leaves.get("shared_down.bias"),
            )
            if config.shared_expert_gate is not None:
                gate = leaves["shared_expert_gate.weight"] @ x + leaves["shared_expert_gate.bias"]
                shared = shared / (1 + torch.exp(-gate))
            output = output + shared
        outputs.append(output)
    return torch.stack(outputs), leaves, chosen


def model_choices(model: MoEMLP, hidden: torch.Tensor) -> list[list[int]]:
    return [sorted(row) for row in model.route(model.router(hidden).float())[1].tolist()]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("biases", [True, False])
def test_matches_a_per_token_loop(routing, shared, gated, biases):
    config = make_config(
        **ROUTINGS[routing],
        **SHARED[shared],
        gated=gated,
        activation="gelu" if gated else "squared_relu",
        add_linear_biases=biases,
        up=RANDOM_BIAS,
        gate=RANDOM_BIAS if gated else {},
        down=RANDOM_BIAS,
        auxiliary_loss_coefficient=0,
    )
    model = build(config)
    bias_names = {"gate_up.bias", "down.bias"} | (
        {"shared_gate_up.bias", "shared_down.bias"} if shared != "none" else set()
    )
    expected_biases = (bias_names if biases else set()) | ({"shared_expert_gate.bias"} if "gated" in shared else set())
    found = {name for name, _ in model.named_parameters() if name.endswith("bias")} - {"score_correction_bias"}
    assert found == expected_biases
    hidden, output_weights = inputs()
    hidden.requires_grad_()
    batch = Batch(LENGTHS)
    output = model(hidden, batch)
    assert batch.losses == {}
    (output * output_weights).sum().backward()

    reference_input = hidden.detach().double().requires_grad_()
    reference_output, leaves, chosen = reference_moe(model, reference_input)
    (reference_output * output_weights.double()).sum().backward()
    assert model_choices(model, hidden.detach()) == chosen
    assert len({tuple(experts) for experts in chosen}) > 2  # The tokens do not all go to the same experts.
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(output.double(), reference_output.detach(), **tolerance)
    torch.testing.assert_close(hidden.grad.double(), reference_input.grad, **tolerance)
    for name, parameter in model.named_parameters():
        if name == "score_correction_bias":  # frozen: it only chooses
            assert parameter.grad is None and not parameter.requires_grad
            continue
        torch.testing.assert_close(parameter.grad.double(), leaves[name].grad, **tolerance, msg=name)


def test_an_expert_no_token_chose_gets_a_zero_gradient():
    model = build(make_config(experts=EXPERTS, experts_per_token=1))
    hidden, _ = inputs()
    hidden = hidden[:2]
    model(hidden, Batch([2])).sum().backward()
    unused = sorted(set(range(EXPERTS)) - {expert for row in model_choices(model, hidden) for expert in row})
    assert unused
    down = model.down.weight.grad.view(EXPERTS, INTERMEDIATE, HIDDEN)
    assert all((down[expert] == 0).all() for expert in unused)


def test_the_correction_bias_chooses_the_experts_but_does_not_weight_them():
    config = make_config(**ROUTINGS["sigmoid, top-k, groups, correction bias"])
    model, hidden = build(config), inputs()[0]
    logits = model.router(hidden).float()
    scores, selected = model.route(logits)
    torch.testing.assert_close(scores, logits.sigmoid().gather(-1, selected))  # the bias does not weight
    with torch.no_grad():
        model.score_correction_bias.zero_()
    assert model.route(logits)[1].sort().values.tolist() != selected.sort().values.tolist()  # but it chooses


def test_top_k_softmax_equals_renormalized_softmax_top_k():
    hidden, _ = inputs()
    renormalized = build(make_config(**ROUTINGS["softmax, top-k, renormalized"]))(hidden, Batch(LENGTHS))
    top_k_first = build(make_config(**ROUTINGS["top-k, softmax"]))(hidden, Batch(LENGTHS))
    torch.testing.assert_close(top_k_first, renormalized)


@pytest.mark.parametrize("routing", ["softmax_top_k", "sigmoid_top_k"])
def test_router_losses_match_their_formulas(routing):
    aux, z = 0.03, 0.2
    model = build(make_config(auxiliary_loss_coefficient=aux, z_loss_coefficient=z, routing=routing))
    hidden, _ = inputs()
    batch = Batch(LENGTHS)
    model(hidden, batch)
    assert set(batch.losses) == {"block.mlp.load_balancing", "block.mlp.router_z_loss"}

    router = model.router.weight.detach().double().requires_grad_()
    logits = hidden.double() @ router.t()
    # Each expert's share of a token: the softmax, or (DeepSeek-V3) the sigmoid scores normalized to sum to 1.
    shares = torch.exp(logits) if routing == "softmax_top_k" else 1 / (1 + torch.exp(-logits))
    probabilities = shares / shares.sum(-1, keepdim=True)
    # Switch / Mixtral: experts · Σ_e (share of the top-k routings that go to e) · (mean probability of e).
    expected_balance = 0
    for expert in range(EXPERTS):
        routed_share = sum(expert in row.topk(TOP_K).indices.tolist() for row in probabilities) / TOKENS
        expected_balance = expected_balance + routed_share * probabilities[:, expert].mean()
    expected_balance = aux * EXPERTS * expected_balance
    expected_z = z * torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()

    for name, expected in [("load_balancing", expected_balance), ("router_z_loss", expected_z)]:
        model.zero_grad()
        router.grad = None
        loss_batch = Batch(LENGTHS)
        model(hidden, loss_batch)
        loss = loss_batch.losses[f"block.mlp.{name}"]
        torch.testing.assert_close(loss.double(), expected.detach(), atol=1e-6, rtol=1e-5)
        loss.backward()
        expected.backward(retain_graph=True)
        torch.testing.assert_close(model.router.weight.grad.double(), router.grad, atol=1e-6, rtol=1e-5, msg=name)
    # Perfect balance gives coefficient · experts_per_token; the default coefficient is 0.01, Fast-LLM's.
    assert MoEMLPConfig().auxiliary_loss_coefficient == 0.01


def test_router_jitter_only_in_training_and_only_on_the_router():
    hidden, _ = inputs()
    clean = build(make_config())
    jittered = build(make_config(router_jitter=0.3))
    # Evaluation: no noise.
    jittered.eval()
    torch.testing.assert_close(jittered(hidden, Batch(LENGTHS)), clean(hidden, Batch(LENGTHS)))
    # Training: the noise changes the logits, reproducibly from the seed; the experts see the clean input.
    jittered.train()
    batch = Batch(LENGTHS)
    noisy_logits = []
    jittered.router.register_forward_hook(lambda module, args, output: noisy_logits.append((args[0], output)))
    output = jittered(hidden, batch)
    router_input, _ = noisy_logits[0]
    ratio = router_input / hidden
    assert not torch.allclose(ratio, torch.ones_like(ratio)) and bool(((ratio - 1).abs() <= 0.3 + 1e-6).all())
    assert torch.equal(build(make_config(router_jitter=0.3))(hidden, Batch(LENGTHS)), output)
    # The same layer with these routing decisions and clean expert inputs:
    scores, selected = jittered.route(noisy_logits[0][1].float())
    expected = jittered._routed_experts(hidden, scores, selected)
    torch.testing.assert_close(output, expected)


def _signature(model: MoEMLP) -> tuple:
    """Everything a field may change: parameter names, shapes, values and settings, the output and the losses."""
    hidden, _ = inputs()
    parameters = [
        (name, tuple(parameter.shape), parameter.detach().tolist(), parameter.meta.settings)
        for name, parameter in model.named_parameters()
    ]
    batch = Batch(LENGTHS)
    output = model(hidden, batch).detach().tolist()
    return parameters, output, {name: loss.item() for name, loss in batch.losses.items()}


UNIFORM = {"weight": {"initialization": {"type": "uniform", "low": -1.0, "high": 1.0}}}
# One change per field, from a base with one shared expert and renormalization off (so that `routing` shows).
BASE = {"shared_experts": 1, "norm_topk_prob": False}
FIELD_CHANGES = {
    "experts": {"experts": EXPERTS + 1},
    "experts_per_token": {"experts_per_token": 1},
    "shared_experts": {"shared_experts": 2},
    "shared_expert_gate": {"shared_expert_gate": {}},
    "shared_intermediate_size": {"shared_intermediate_size": INTERMEDIATE + 5},
    "intermediate_size": {"intermediate_size": 2 * INTERMEDIATE},
    "gated": {"gated": False},
    "activation": {"activation": "relu"},
    "router": {"router": UNIFORM},
    "gate": {"gate": UNIFORM},
    "up": {"up": UNIFORM},
    "down": {"down": UNIFORM},
    "add_linear_biases": {"add_linear_biases": True},
    "routing": {"routing": "top_k_softmax", "norm_topk_prob": True},
    "norm_topk_prob": {"norm_topk_prob": True},
    "routed_scale": {"routed_scale": 2.0},
    # (what the base needs besides, the change): the fields of sigmoid routing, from a sigmoid-routed base.
    "routing_groups": ({"routing": "sigmoid_top_k", "experts": 6}, {"routing_groups": 3}),
    "routing_groups_per_token": (
        {"routing": "sigmoid_top_k", "experts": 6, "routing_groups": 3},
        {"routing_groups_per_token": 2},
    ),
    "score_correction_bias": ({"routing": "sigmoid_top_k"}, {"score_correction_bias": True}),
    "auxiliary_loss_coefficient": {"auxiliary_loss_coefficient": 0.5},
    "z_loss_coefficient": {"z_loss_coefficient": 0.5},
    "router_jitter": {"router_jitter": 0.2},
    "lr_scale": {"lr_scale": 0.5},
}


# Fields that only act with several ranks; test_moe_parallel.py checks that they change the layer.
DISTRIBUTED_ONLY = {"expert_parallel"}


@pytest.mark.parametrize(
    "field_name", [field.name for field in attrs.fields(MoEMLPConfig) if field.name not in DISTRIBUTED_ONLY]
)
def test_every_field_changes_the_layer(field_name):
    assert field_name in FIELD_CHANGES, f"no test changes field {field_name!r}"
    needs, change = FIELD_CHANGES[field_name] if isinstance(FIELD_CHANGES[field_name], tuple) else ({}, None)
    base = make_config(**BASE, **needs)
    changed = update(base, change or FIELD_CHANGES[field_name])
    assert _signature(build(changed)) != _signature(build(base))


def test_components_keep_their_own_settings():
    config = make_config(
        add_linear_biases=True,
        lr_scale=2.0,
        shared_experts=1,
        router={"weight": {"initialization": {"type": "fill", "value": 0.125}}, "lr_scale": 0.25},
        gate={"weight": {"initialization": {"type": "fill", "value": 0.25}, "weight_decay": False}, "lr_scale": 0.5},
        up={"weight": {"initialization": {"type": "fill", "value": -0.5}}, "bias": {"lr_scale": 3.0}},
        down={"lr_scale": 0},
    )
    model = build(config)
    gate_rows, up_rows = slice(0, EXPERTS * INTERMEDIATE), slice(EXPERTS * INTERMEDIATE, None)
    for projection in (model.gate_up, model.shared_gate_up):
        weight = projection.weight.detach()
        half = len(weight) // 2
        assert (weight[:half] == 0.25).all() and (weight[half:] == -0.5).all()
    meta = model.gate_up.weight.meta
    assert (meta.lr_scale_rows()[gate_rows] == 1.0).all() and (meta.lr_scale_rows()[up_rows] == 2.0).all()
    assert (meta.weight_decay_rows()[gate_rows] == 0).all() and (meta.weight_decay_rows()[up_rows] == 1).all()
    assert (model.gate_up.bias.meta.lr_scale_rows()[up_rows] == 6.0).all()
    assert (model.router.weight.detach() == 0.125).all() and model.router.weight.meta.settings[0].lr_scale == 0.5
    assert model.router.bias is None  # add_linear_biases is for the experts only.
    assert not model.down.weight.requires_grad and not model.down.bias.requires_grad
    assert not model.shared_down.weight.requires_grad
    default = build(make_config(router={})).router.weight.detach()
    assert abs(default.std().item() - HIDDEN**-0.5) < 0.1


def test_flops_count_the_active_experts():
    batch = Batch(LENGTHS)
    routed = TOKENS * TOP_K
    matmul = 2 * routed * HIDDEN * INTERMEDIATE  # One expert projection over every routed (token, expert) pair.
    router = 2 * TOKENS * HIDDEN * EXPERTS
    shared = 2 * TOKENS * HIDDEN * 2 * INTERMEDIATE  # One projection of two shared experts.
    assert build(make_config()).flops(batch) == (3 * matmul + router, 6 * matmul + 2 * router)
    config = make_config(gated=False, shared_experts=2, shared_expert_gate={}, down={"lr_scale": 0})
    gate = 2 * TOKENS * HIDDEN
    forward = 2 * matmul + router + 2 * shared + gate
    backward = 3 * matmul + 2 * router + 3 * shared + 2 * gate  # Frozen down projections: no weight gradient.
    assert build(config).flops(batch) == (forward, backward)


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"experts_per_token": 9}, "experts_per_token", "must be <= experts (8), got 9"),
        ({"experts": 0}, "experts", "must be >= 1"),
        ({"shared_experts": -1}, "shared_experts", "must be >= 0"),
        ({"shared_expert_gate": {}}, "shared_expert_gate", "gates the shared experts, but shared_experts is 0"),
        ({"shared_intermediate_size": 8}, "shared_intermediate_size", "the shared experts, but shared_experts is 0"),
        ({"shared_experts": 1, "shared_intermediate_size": 0}, "shared_intermediate_size", "must be >= 1"),
        ({"gated": False, "gate": {"lr_scale": 0.5}}, "gate", "only gated experts have a gate projection"),
        ({"routing": "top_k_softmax", "norm_topk_prob": False}, "norm_topk_prob", "always sums to 1"),
        ({"routing": "sinkhorn"}, "routing", "expected one of 'softmax_top_k', 'top_k_softmax', 'sigmoid_top_k'"),
        ({"routing_groups": 2}, "routing_groups", "needs routing sigmoid_top_k"),
        ({"score_correction_bias": True}, "score_correction_bias", "needs routing sigmoid_top_k"),
        ({"routing": "sigmoid_top_k", "routing_groups": 3}, "routing_groups", "must divide the experts (8), got 3"),
        ({"routing": "sigmoid_top_k", "routing_groups": 8}, "routing_groups", "each needs at least 2 experts"),
        (
            {"routing": "sigmoid_top_k", "routing_groups": 2, "routing_groups_per_token": 3},
            "routing_groups_per_token",
            "must be <= routing_groups (2), got 3",
        ),
        (
            {"routing": "sigmoid_top_k", "routing_groups": 4, "experts_per_token": 3},
            "experts_per_token",
            "must be <= the experts of the 1 groups a token chooses from",
        ),
        ({"routed_scale": 0}, "routed_scale", "must be > 0"),
        ({"router_jitter": 1.0}, "router_jitter", "must be < 1"),
        ({"auxiliary_loss_coefficient": -0.1}, "auxiliary_loss_coefficient", "must be >= 0"),
        ({"z_loss_coefficient": -0.1}, "z_loss_coefficient", "must be >= 0"),
        ({"add_linear_biases": True, "gate": {"bias": {"enabled": False}}}, "up.bias.enabled", "both have a bias"),
        ({"expert": 4}, "expert", "did you mean 'experts'?"),
    ],
)
def test_config_errors_name_the_field(data, path, message):
    with pytest.raises(ConfigError) as error:
        structure({"type": "moe", **data}, MLPConfig, root="model.decoder.block.mlp")
    assert error.value.errors[0][0] == f"model.decoder.block.mlp.{path}"
    assert message in error.value.errors[0][1]


def test_tensor_parallel_must_divide_the_intermediate_size():
    from blockzoo.run_config import RunConfig

    block = {"mixer": {"type": "none"}, "mlp": {"type": "moe", "intermediate_size": 10}}
    with pytest.raises(ConfigError) as caught:
        structure({"model": {"decoder": {"block": block}}, "distributed": {"tensor_parallel": 4}}, RunConfig)
    assert dict(caught.value.errors) == {
        "model.decoder.block.mlp.intermediate_size": "tensor_parallel=4 must divide it (10)"
    }


def test_registered_as_moe():
    entry = get_registry().resolve("mlp", "moe")
    assert entry.config_class is MoEMLPConfig and entry.load_implementation() is MoEMLP
    assert entry.plugin.distribution == "blockzoo-moe"
    expected = {TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE, EXPERT_PARALLEL}
    assert set(entry.plugin.info.capabilities) == MoEMLPConfig.capabilities == expected


def test_config_and_plugin_modules_import_no_torch():
    script = (
        "import sys; from blockzoo.config import structure; from blockzoo.layers.config import MLPConfig; "
        "structure({'type': 'moe', 'shared_experts': 1}, MLPConfig); assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_matches_the_per_token_loop():
    # fp32 (the per-expert products); bf16 and the grouped GEMMs are checked below.
    model = build(make_config(add_linear_biases=True, up=RANDOM_BIAS, gate=RANDOM_BIAS, shared_experts=1))
    hidden, _ = inputs()
    expected, _, _ = reference_moe(model, hidden)
    output = model.cuda()(hidden.cuda(), Batch(LENGTHS, device="cuda"))
    torch.testing.assert_close(output.cpu().double(), expected.detach(), atol=1e-4, rtol=1e-4)


def _grouped_mm_runs_on(device: str) -> bool:
    # CUDA runs the grouped GEMM kernel; recent CPU builds have a reference implementation of the same op.
    if device == "cuda":
        return torch.cuda.is_available()
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("gated", [True, False])
def test_grouped_gemm_path_matches_the_per_expert_loop(device, gated):
    """In bf16 on CUDA the experts run as grouped GEMMs: same outputs and gradients as one product per expert, on
    the same routed tokens (an expert with no token included)."""
    if not _grouped_mm_runs_on(device):
        pytest.skip(f"torch._grouped_mm does not run on {device} with this torch")
    hidden_size, intermediate, experts = 64, 32, 8
    config = make_config(
        intermediate_size=intermediate,
        experts=experts,
        gated=gated,
        add_linear_biases=True,
        up=RANDOM_BIAS,
        gate=RANDOM_BIAS if gated else {},
    )
    distributed = single_process(3)
    model = MoEMLP(
        config, name="mlp", hidden_dim=TensorDim("hidden", hidden_size), distributed=distributed, lr_scale=1
    ).to(device)
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 3, 9, 1, 12, 8], device=device)
    routed = torch.randn(int(counts.sum()), hidden_size, generator=generator).to(device).bfloat16()
    sorted_experts = torch.repeat_interleave(torch.arange(experts, device=device), counts)
    output_weights = torch.randn(len(routed), hidden_size, generator=generator).to(device).bfloat16()
    assert model.uses_grouped_mm(routed) == (device == "cuda")
    results = []
    for products in (
        lambda inputs: model._grouped_expert_products(inputs, counts, sorted_experts),
        lambda inputs: model._looped_expert_products(inputs, counts.tolist()),
    ):
        model.zero_grad()
        inputs = routed.clone().requires_grad_()
        output = products(inputs)
        (output.float() * output_weights.float()).sum().backward()
        results.append(
            [output.float(), inputs.grad.float(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
        )
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, looped, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_layer_matches_the_cpu_layer():
    hidden_size = 64
    config = make_config(intermediate_size=32, experts=8, shared_experts=1, add_linear_biases=True, up=RANDOM_BIAS)
    distributed = single_process(3)
    model = MoEMLP(config, name="mlp", hidden_dim=TensorDim("hidden", hidden_size), distributed=distributed, lr_scale=1)
    hidden = torch.randn(48, hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    expected = model(hidden.float(), Batch([48]))
    gpu_model = model.cuda()
    output = gpu_model(hidden.cuda(), Batch([48], device="cuda"))
    assert gpu_model.uses_grouped_mm(hidden.cuda())
    # bf16 logits may pick another expert where two are nearly tied: compare the tokens with a clear choice.
    logits = hidden.float() @ model.router.weight.detach().cpu().t()
    ranked = logits.sort(dim=-1, descending=True).values
    clear = ranked[:, TOP_K - 1] - ranked[:, TOP_K] > 0.5
    assert clear.sum() > 24
    torch.testing.assert_close(output.float().cpu()[clear], expected.detach()[clear], atol=5e-2, rtol=5e-2)


def test_the_router_runs_in_float32_whatever_the_compute_dtype():
    model = build(make_config(routing="sigmoid_top_k"))
    seen = []
    model.router.register_forward_hook(lambda module, args, output: seen.append((args[0].dtype, output.dtype)))
    hidden = inputs()[0].to(torch.bfloat16)
    output = model(hidden, Batch(LENGTHS))
    assert seen == [(torch.float32, torch.float32)] and output.dtype == torch.bfloat16


def test_the_expert_order_against_a_plain_sort():
    selected = torch.tensor([[3, 0], [1, 3], [0, 2], [3, 1], [4, 0]])
    order = ExpertOrder.of(selected, experts=6)
    pairs = sorted(range(selected.numel()), key=lambda pair: (int(selected.flatten()[pair]), pair))  # stable
    assert order.tokens.tolist() == [pair // 2 for pair in pairs]
    assert order.sorted_experts.tolist() == sorted(selected.flatten().tolist())
    assert [pairs[row] for row in order.inverse.tolist()] == list(range(selected.numel()))
    assert order.counts.tolist() == [3, 2, 1, 3, 1, 0]  # expert 5 chosen by no token


def test_dispatch_and_combine_equal_plain_indexing_and_their_gradients_check():
    generator = torch.Generator().manual_seed(3)
    selected = torch.stack([torch.randperm(5, generator=generator)[:3] for _ in range(7)])  # 7 tokens, top-3
    order = ExpertOrder.of(selected, experts=5)
    hidden = torch.randn(7, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    outputs = torch.randn(21, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    scores = torch.rand(7, 3, generator=generator, dtype=torch.float64, requires_grad=True)

    def dispatch(hidden):
        return Dispatch.apply(hidden, order.tokens, order.inverse, 3)

    def combine(outputs, scores):
        return Combine.apply(outputs, scores, order.tokens, order.inverse)

    torch.testing.assert_close(dispatch(hidden), hidden[order.tokens])
    # Pair p = (t, j) went to sorted row inverse[p]: the token's sum over its choices, weighted by the scores.
    expected = torch.stack([sum(scores[t, j] * outputs[order.inverse[3 * t + j]] for j in range(3)) for t in range(7)])
    torch.testing.assert_close(combine(outputs, scores), expected)
    assert torch.autograd.gradcheck(dispatch, (hidden,))
    assert torch.autograd.gradcheck(combine, (outputs, scores))


def test_the_compile_switch_only_applies_on_cuda(monkeypatch):
    monkeypatch.setenv(pairs.COMPILE_VARIABLE, "1")
    assert pairs.compiled_piece(pairs._gather_sum, torch.zeros(2)) is pairs._gather_sum
    assert not pairs._compiling(torch.zeros(2))
    monkeypatch.setenv(pairs.COMPILE_VARIABLE, "0")
    assert not pairs._compiling(torch.zeros(2, device="meta"))


def _bf16_layer(experts=8, top_k=2, seed=3):
    hidden_size = 64
    config = make_config(intermediate_size=32, experts=experts, experts_per_token=top_k, shared_experts=1)
    distributed = single_process(seed)
    model = MoEMLP(config, name="mlp", hidden_dim=TensorDim("hidden", hidden_size), distributed=distributed, lr_scale=1)
    hidden = torch.randn(96, hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    return model.cuda(), hidden.cuda()


@pytest.mark.gpu
def test_the_routed_path_does_not_sync_with_the_host():
    """Forward and backward on CUDA (grouped GEMMs, losses on) with CUDA's sync debug mode set to error: any
    device-to-host read in the layer raises."""
    model, hidden = _bf16_layer()
    batch = Batch([96], device="cuda")
    inputs = hidden.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        output = model(inputs, batch)
        loss = output.float().square().sum() + sum(batch.losses.values())
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert inputs.grad is not None and model.uses_grouped_mm(hidden)


@pytest.mark.gpu
def test_the_compiled_pieces_equal_the_eager_ones(monkeypatch):
    """BLOCKZOO_MOE_COMPILE=1 (torch.compile of the gathers, sums and the gated activation) against eager on the same
    layer and inputs: output, input gradient and every parameter's gradient."""
    model, hidden = _bf16_layer(experts=16, top_k=4)
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(pairs.COMPILE_VARIABLE, switch)
        model.zero_grad()
        inputs = hidden.detach().requires_grad_()
        output = model(inputs, Batch([96], device="cuda"))
        output.float().square().sum().backward()
        results.append([output.float(), inputs.grad.float(), *(p.grad.float() for p in model.parameters())])
    # bf16 sums of several expert outputs that may cancel: the error is relative to the terms, so the absolute
    # tolerance is scaled by each tensor's largest entry.
    for compiled, eager in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=2e-2 * float(eager.abs().max()), rtol=2e-2)
