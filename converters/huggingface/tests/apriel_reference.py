"""A float64 forward pass of ServiceNow's Apriel hybrid SSM (`AprielHybridSSMForCausalLM`, Fast-LLM
`fast_llm_external_models/apriel_hybrid_ssm/modeling_apriel_hybrid_ssm.py`), written from their modelling code's
maths, step by step: their model runs only on CUDA (mamba_ssm kernels), so this is the oracle of the format.

Layers: "t" Mistral's decoder layer, "m2" their `Mamba2` (a Mamba 1 selective scan with grouped x and B, whose
`dt_proj.bias` is added twice: inside `dt_proj` and as the scan's `delta_bias`), "m2d" their `DiscreteMamba2`,
"i" identity. Every mixer layer but "i" is norm → mixer → residual, norm → Mistral MLP → residual.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from mamba_cases import apriel_sizes

from blockzoo_huggingface.formats_mamba import APRIEL_SSM_DEFAULTS

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "identity": lambda x: x}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [batch, length, channels], weight [channels, 1, kernel]: each output sees its own and earlier inputs."""
    kernel = weight.shape[-1]
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    out = sum(padded[:, tap : tap + x.shape[1]] * weight[:, 0, tap] for tap in range(kernel))
    return out if bias is None else out + bias


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _attention(x: torch.Tensor, t: dict, config: dict, s: dict) -> torch.Tensor:
    """Mistral: GQA, RoPE (rotate-half), a window of `sliding_window` tokens including itself."""
    batch, length, _ = x.shape
    q = (x @ t["self_attn.q_proj.weight"].T).view(batch, length, s["heads"], s["head_dim"])
    k = (x @ t["self_attn.k_proj.weight"].T).view(batch, length, s["kv_heads"], s["head_dim"])
    v = (x @ t["self_attn.v_proj.weight"].T).view(batch, length, s["kv_heads"], s["head_dim"])
    exponents = torch.arange(0, s["head_dim"], 2, dtype=torch.float64) / s["head_dim"]
    angles = torch.arange(length, dtype=torch.float64)[:, None] / config["rope_theta"] ** exponents
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    repeats = s["heads"] // s["kv_heads"]
    k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(s["head_dim"])
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = key <= query
    if config["sliding_window"] is not None:
        visible &= key > query - config["sliding_window"]
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, -1)
    return out @ t["self_attn.o_proj.weight"].T


def _linear(x: torch.Tensor, t: dict, name: str) -> torch.Tensor:
    out = x @ t[f"{name}.weight"].T
    return out + t[f"{name}.bias"] if f"{name}.bias" in t else out


def _mamba(x: torch.Tensor, t: dict, ssm: dict, s: dict) -> torch.Tensor:
    """Their `Mamba2.forward`: z, x, B, C from in_proj; x and B heads shared by inner / xb C heads (repeat_kv
    order); dt = dt_proj(dt_in_proj(h)), then the scan adds dt_proj.bias again before the softplus."""
    inner, xb, state = s["inner"], s["xb"], s["state"]
    repeats = inner // xb
    z, xs, b, c = _linear(x, t, "mixer.in_proj").split([inner, xb, xb, inner], dim=-1)

    def repeat_heads(tensor: torch.Tensor) -> torch.Tensor:  # [..., xb] -> [..., inner]
        return tensor.unflatten(-1, (-1, state)).repeat_interleave(repeats, dim=-2).flatten(-2)

    b, c = repeat_heads(b).unflatten(-1, (-1, state)), c.unflatten(-1, (-1, state))  # [batch, length, heads, state]
    dt = _linear(_linear(x, t, "mixer.dt_in_proj"), t, "mixer.dt_proj")
    conv = (t["mixer.conv1d.weight"], t.get("mixer.conv1d.bias"))
    if ssm["repeat_kv_before_conv"]:
        xs = F.silu(_causal_conv(repeat_heads(xs), *conv))
    else:
        xs = repeat_heads(F.silu(_causal_conv(xs, *conv)))
    delta = F.softplus(dt + t["mixer.dt_proj.bias"])  # [batch, length, inner]
    a = -torch.exp(t["mixer.A_log"])  # [inner, state]
    channel_b = b.repeat_interleave(state, dim=-2)  # channel i reads head i // state: [batch, length, inner, state]
    channel_c = c.repeat_interleave(state, dim=-2)
    scan_state = torch.zeros(x.shape[0], inner, state, dtype=x.dtype)
    outputs = []
    for step in range(x.shape[1]):
        d = delta[:, step, :, None]
        scan_state = torch.exp(d * a) * scan_state + d * channel_b[:, step] * xs[:, step, :, None]
        outputs.append((scan_state * channel_c[:, step]).sum(-1))
    y = (torch.stack(outputs, 1) + xs * t["mixer.D"]) * F.silu(z)
    return _linear(y, t, "mixer.out_proj")


def _discrete_mamba_2(x: torch.Tensor, t: dict, ssm: dict, s: dict) -> torch.Tensor:
    """Their `DiscreteMamba2.forward`: s_t = exp(-softplus(A_log_t)) · s_{t-1} + x_t ⊗ B_t (the kernel's input is
    x / dt, multiplied by dt again), y = C_t · s_t + D · x_t, out_proj(y · silu(z + z_bias))."""
    inner, state, heads, groups = s["inner"], s["state"], s["v_heads"], s["qk_heads"]
    xbc, z, dt_raw = _linear(x, t, "mixer.in_proj").split([inner + 2 * groups * state, inner, heads], dim=-1)
    xbc = _ACTIVATIONS[ssm["activation"]](_causal_conv(xbc, t["mixer.conv1d.weight"], t.get("mixer.conv1d.bias")))
    xs, b, c = xbc.split([inner, groups * state, groups * state], dim=-1)
    xs = xs.unflatten(-1, (heads, -1))  # [batch, length, heads, head_size]
    per_group = heads // groups
    b = b.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=-2)  # head h reads group h // per_group
    c = c.unflatten(-1, (groups, state)).repeat_interleave(per_group, dim=-2)
    decay = torch.exp(-F.softplus(dt_raw))  # [batch, length, heads]
    scan_state = torch.zeros(x.shape[0], heads, inner // heads, state, dtype=x.dtype)
    outputs = []
    for step in range(x.shape[1]):
        scan_state = decay[:, step, :, None, None] * scan_state + xs[:, step, :, :, None] * b[:, step, :, None, :]
        outputs.append((scan_state * c[:, step, :, None, :]).sum(-1))
    y = (torch.stack(outputs, 1) + t["mixer.D"][:, None] * xs).flatten(-2)
    return _linear(y * F.silu(z + t.get("mixer.z_bias", 0)), t, "mixer.out_proj")


def _mlp(x: torch.Tensor, t: dict, activation: str) -> torch.Tensor:
    gate, up = x @ t["mlp.gate_proj.weight"].T, x @ t["mlp.up_proj.weight"].T
    return (_ACTIVATIONS[activation](gate) * up) @ t["mlp.down_proj.weight"].T


def logits(config: dict, tensors: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Their model's logits (float64) for token ids [batch, length]."""
    t = {name: tensor.double() for name, tensor in tensors.items()}
    ssm = {**APRIEL_SSM_DEFAULTS, **config["ssm_cfg"]}
    sizes = apriel_sizes(config)
    eps = config["rms_norm_eps"]
    mixers = {"t": _attention, "m2": _mamba, "m2d": _discrete_mamba_2}
    hidden = t["model.embed_tokens.weight"][tokens]
    for index, code in enumerate(config["hybrid_block_layout"]):
        if code == "i":
            continue
        prefix = f"model.layers.{index}."
        layer = {name[len(prefix) :]: tensor for name, tensor in t.items() if name.startswith(prefix)}
        normed = _rms_norm(hidden, layer["input_layernorm.weight"], eps)
        extra = config if code == "t" else ssm
        hidden = hidden + mixers[code](normed, layer, extra, sizes)
        hidden = hidden + _mlp(
            _rms_norm(hidden, layer["post_attention_layernorm.weight"], eps), layer, config["hidden_act"]
        )
    hidden = _rms_norm(hidden, t["model.norm.weight"], eps)
    return hidden @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T
