"""The benchmark suite's CPU-checkable parts: the shape builders give ours and each peer the same parameter count (and,
at scaled-down shapes, the same outputs once our weights are copied in); the harness's timing, ratios, table and JSON
lines; a contender's failure staying its own; the settings of ours. The suites themselves run on a GPU
(benchmarks/device.sh); `slow` tests run each one here at `--tiny` shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks import harness, ours, shapes

REPOSITORY = Path(__file__).resolve().parent.parent
FP32 = "distributed.compute_dtype=fp32"  # a setting: exact comparisons on the CPU


def mamba_ssm_or_skip():
    """mamba_ssm through the project's adapter, or skip the test (only where it is absent: CPU machines)."""
    from blockzoo_ssm import import_mamba_ssm

    try:
        import_mamba_ssm()
    except ImportError as error:
        pytest.skip(f"mamba_ssm does not import here: {error}")


# -- equal shapes ------------------------------------------------------------------------------------------------------


def test_llama_1b_has_transformers_parameter_count():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        theirs = LlamaForCausalLM(shapes.transformers_llama_config(shapes.LLAMA_1B, 4096))
    ours_count = shapes.parameter_count(shapes.our_model(shapes.llama_model(shapes.LLAMA_1B)))
    assert ours_count == shapes.parameter_count(theirs)


def test_llama_weight_map_gives_transformers_logits_and_loss():
    """Our initial weights copied into transformers' LlamaForCausalLM give our logits, and our step-0 loss (our
    labels of packed rows) is transformers' `labels=input_ids` loss: what the suite's loss check relies on."""
    from transformers import LlamaForCausalLM

    shape = shapes.LLAMA_TINY
    model, _ = ours.build(ours.run_config(shapes.llama_model(shape), FP32, rows=1, length=16))
    theirs = LlamaForCausalLM._from_config(shapes.transformers_llama_config(shape, 16), attn_implementation="sdpa")
    weights = shapes.llama_to_transformers(dict(model.named_parameters()), shape.layers)
    shapes.load_into(theirs, {name: tensor.detach() for name, tensor in weights.items()})
    tokens = ours.random_tokens(3, 16, shape.vocab, torch.device("cpu"))
    with torch.no_grad():
        output = theirs(input_ids=tokens, labels=tokens)
        torch.testing.assert_close(model(tokens), output.logits, rtol=1e-4, atol=1e-5)
    assert ours.reference_loss(model, tokens, rows_per_call=2) == pytest.approx(float(output.loss), rel=1e-5)


def test_hybrid_1b_has_transformers_parameter_count_and_qwen3_nexts_pattern():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from benchmarks import hybrid

    with torch.device("meta"):
        theirs = Qwen3NextForCausalLM(Qwen3NextConfig(**hybrid.config_json(hybrid.HYBRID_1B)))
    model = shapes.our_model(hybrid.our_model(hybrid.HYBRID_1B))
    assert shapes.parameter_count(model) == shapes.parameter_count(theirs)
    assert 1.1e9 < shapes.parameter_count(model) < 1.3e9
    mixers = [type(block.mixer).__name__ for block in model.decoder]
    assert mixers == (["GatedDeltaNet"] * 3 + ["Attention"]) * 4, mixers


def test_hybrid_export_gives_transformers_our_loss(tmp_path):
    """Our initial weights saved in the qwen3_next format and loaded by transformers' Qwen3NextForCausalLM give our
    step-0 loss in fp32: what the hybrid suite's loss check relies on."""
    from transformers import Qwen3NextForCausalLM

    import blockzoo
    from benchmarks import hybrid

    model, _ = ours.build(ours.run_config(hybrid.our_model(hybrid.HYBRID_TINY), FP32, rows=1, length=16))
    theirs = Qwen3NextForCausalLM.from_pretrained(blockzoo.save(model, tmp_path / "hf", format="qwen3_next"))
    tokens = ours.random_tokens(3, 40, hybrid.HYBRID_TINY["vocab_size"], torch.device("cpu"))
    with torch.no_grad():
        loss = float(theirs(input_ids=tokens, labels=tokens).loss)
    assert ours.reference_loss(model, tokens, rows_per_call=2) == pytest.approx(loss, rel=1e-5)


def test_llama_weight_map_refuses_unknown_parameters():
    model = shapes.our_model(shapes.llama_model(shapes.LLAMA_TINY))
    weights = {**dict(model.named_parameters()), "decoder.0.mixer.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"decoder\.0\.mixer\.extra\.weight"):
        shapes.llama_to_transformers(weights, shapes.LLAMA_TINY.layers)


def test_mamba2_1b_has_transformers_parameter_count():
    """transformers' Mamba2ForCausalLM at the same shape: an oracle that exists on every machine (mamba_ssm's model,
    the suite's peer, is compared below where it imports)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    shape = shapes.MAMBA2_1B
    config = Mamba2Config(
        num_heads=shape.heads,
        head_dim=shape.head_size,
        hidden_size=shape.hidden,
        state_size=shape.state,
        expand=shape.expand,
        n_groups=shape.groups,
        conv_kernel=4,
        vocab_size=shape.vocab,
        num_hidden_layers=shape.layers,
        tie_word_embeddings=True,
        use_bias=False,
        use_conv_bias=True,
    )
    with torch.device("meta"):
        theirs = Mamba2ForCausalLM(config)
    assert shapes.parameter_count(shapes.our_model(shapes.mamba2_model(shape))) == shapes.parameter_count(theirs)


def test_mamba2_1b_has_mamba_ssm_parameter_count_and_names():
    mamba_ssm_or_skip()
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    shape = shapes.MAMBA2_1B
    theirs = MambaLMHeadModel(shapes.mamba_ssm_config(shape), device="meta")
    model = shapes.our_model(shapes.mamba2_model(shape))
    assert shapes.parameter_count(model) == shapes.parameter_count(theirs)
    mapped = shapes.mamba2_to_mamba_ssm(dict(model.named_parameters()), shape.layers)
    expected = {name: tuple(tensor.shape) for name, tensor in theirs.state_dict().items()}
    assert {name: tuple(tensor.shape) for name, tensor in mapped.items()} == expected


@pytest.mark.parametrize("shape", [shapes.MIXTRAL, shapes.QWEN3_MOE], ids=lambda shape: shape.family)
def test_moe_layers_have_transformers_parameter_counts(shape):
    with torch.device("meta"):
        theirs = shapes.transformers_moe_block(shape)
    layer = shapes.our_layer(shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device="cpu", initialize=False)
    assert shapes.parameter_count(layer) == shapes.parameter_count(theirs)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_weight_map_gives_transformers_outputs(family):
    """Our MoE layer's weights in transformers' block (fp32, eager experts) give our outputs: same routing, same
    experts layout."""
    from blockzoo.layers.base import Batch

    shape = shapes.MoEShape(tokens=40, hidden=16, ffn=8, experts=6, top_k=2, family=family)
    layer = shapes.our_layer(shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device="cpu")
    block = shapes.transformers_moe_block(shape, "eager")
    shapes.load_into(block, shapes.moe_to_transformers({k: v.detach() for k, v in layer.named_parameters()}, shape))
    hidden = torch.randn(shape.tokens, shape.hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = block(hidden[None])
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        torch.testing.assert_close(layer(hidden, Batch([shape.tokens])), expected, rtol=1e-5, atol=1e-6)


def test_moe_flops_count_the_active_experts_as_our_layer_does():
    from blockzoo.layers.base import Batch

    shape = shapes.MIXTRAL
    layer = shapes.our_layer(shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device="cpu", initialize=False)
    assert shapes.moe_layer_flops(shape) == sum(layer.flops(Batch([shape.tokens])))


# -- the harness -------------------------------------------------------------------------------------------------------


def test_time_steps_calls_first_then_warmup_then_timed_steps():
    calls = []

    def step():
        calls.append(len(calls))
        return len(calls)

    timing = harness.time_steps(step, warmup=3, steps=4, device=torch.device("cpu"))
    assert len(calls) == 7 and len(timing.times_s) == 4 and timing.first_value == 1
    with pytest.raises(ValueError, match="at least 1"):
        harness.time_steps(step, warmup=0, steps=4, device=torch.device("cpu"))


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.9, 1.0])
def test_percentile_is_torch_quantile(fraction):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    expected = float(torch.quantile(torch.tensor(values, dtype=torch.float64), fraction))
    assert harness.percentile(values, fraction) == pytest.approx(expected)


def made_case() -> harness.Case:
    case = harness.Case("suite", "case", shape={"rows": 2}, tokens=1000, flops=4e12, mfu=True)
    case.results = [
        harness.Result("ours (a)", ours=True, times_s=[0.5, 0.4, 0.6], first_s=2.0, peak_gib=10.0),
        harness.Result("ours (b)", ours=True, times_s=[0.3, 0.35, 0.32], first_s=0.5, peak_gib=30.0),
        harness.Result("peer", ours=False, times_s=[0.4, 0.42, 0.41], peak_gib=20.0),
        harness.Result("slow peer", ours=False, times_s=[0.9, 1.0, 1.1], peak_gib=15.0),
        harness.Result("broken peer", ours=False, status="out of memory", detail="CUDA out of memory", peak_gib=140.0),
    ]
    return case


def test_ratios_take_our_fastest_setting_against_each_peer_that_ran():
    case = made_case()
    best = case.best_ours()
    assert best.contender == "ours (b)"
    ratios = {ratio["peer"]: ratio for ratio in case.ratios()}
    assert set(ratios) == {"peer", "slow peer"}
    ours_median = statistics.median([0.3, 0.35, 0.32])
    assert ratios["peer"]["speed"] == pytest.approx(statistics.median([0.4, 0.42, 0.41]) / ours_median)
    assert ratios["slow peer"]["memory"] == pytest.approx(30.0 / 15.0)
    assert case.fastest_peer()["peer"] == "peer"
    figures = case.throughput(best)
    assert figures["tokens_per_s"] == pytest.approx(1000 / ours_median)
    assert figures["mfu"] == pytest.approx(4e12 / ours_median / 989e12)
    assert best.first_call_extra_s == pytest.approx(0.5 - ours_median)


def test_table_shows_every_contender_and_the_ratios():
    text = harness.format_case(made_case())
    lines = text.splitlines()
    assert lines[0] == "suite / case (rows 2)"
    for name in ("ours (a)", "ours (b)", "peer", "slow peer", "broken peer"):
        assert any(line.strip().startswith(name) for line in lines[2:7])
    assert "out of memory" in text and "CUDA out of memory" in text
    ratio = 0.41 / statistics.median([0.3, 0.35, 0.32])
    assert f"ours (b) vs peer: speed {ratio:.2f}×, memory {30 / 20:.2f}×" in text
    assert "against the fastest peer (peer)" in text
    assert f"{1000 / 0.32:,.0f}" in text  # tokens/s of ours (b) at its median


def test_runner_keeps_each_failure_to_its_contender_and_writes_json_lines(tmp_path):
    path = tmp_path / "run.jsonl"
    runner = harness.Runner("suite", torch.device("cpu"), path, ["benchmarks/x.py", "--steps", "2"])
    case = harness.Case("suite", "case", tokens=10)

    def absent():
        raise harness.Absent("peer library not installed")

    def out_of_memory():
        raise RuntimeError("CUDA out of memory. Tried to allocate 20 GiB")

    def broken():
        raise ValueError("a bug")

    def fine():
        return harness.time_steps(lambda: None, warmup=1, steps=2, device=torch.device("cpu"))

    for name, body in [("absent", absent), ("oom", out_of_memory), ("bug", broken)]:
        runner.run(case, name, body)
    runner.run(case, "ours", fine, ours=True)
    runner.finish(case)
    statuses = {result.contender: result.status for result in case.results}
    assert statuses == {"absent": "absent", "oom": "out of memory", "bug": "error", "ours": "ok"}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["record"] for record in records] == ["run", "result", "result", "result", "result", "case"]
    header = records[0]
    assert header["command"] == "python benchmarks/x.py --steps 2"
    assert set(header["versions"]) == set(harness.VERSIONED)
    assert header["versions"]["torch"] == torch.__version__
    assert records[2]["detail"].startswith("RuntimeError: CUDA out of memory")
    assert records[3]["detail"] == "ValueError: a bug"
    assert records[-1]["results"][-1]["tokens_per_s"] == pytest.approx(10 / records[-1]["results"][-1]["median_s"])
    assert records[-1]["ratios"] == []  # no peer ran


def test_restored_undoes_patches_of_a_module_and_its_classes():
    module = types.ModuleType("patched")

    class Model:
        def forward(self):
            return "original"

    Model.__module__ = "patched"
    module.Model, module.norm = Model, "original norm"
    with harness.restored(module):
        module.norm = "patched norm"
        module.added = 1
        module.Model.forward = lambda self: "patched"
        module.Model.extra = 2
        assert Model().forward() == "patched"
    assert module.norm == "original norm" and not hasattr(module, "added")
    assert Model().forward() == "original" and not hasattr(Model, "extra")


def test_liger_patches_are_undone_after_their_contender():
    """liger-kernel patches transformers' classes globally: the suites apply it for one contender and undo it, so the
    peers after it run plain transformers."""
    pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed here")
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral

    from benchmarks.llama import liger_patched
    from benchmarks.moe import liger_experts

    before = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaForCausalLM.forward, modeling_mixtral.MixtralExperts)
    with liger_patched(), liger_experts("mixtral"):
        assert modeling_llama.LlamaRMSNorm is not before[0] and modeling_mixtral.MixtralExperts is not before[2]
    after = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaForCausalLM.forward, modeling_mixtral.MixtralExperts)
    assert after == before


# -- ours --------------------------------------------------------------------------------------------------------------


def test_settings_become_run_config_overrides():
    assert ours.overrides("compile=blocks, recompute=selective") == [
        "training.compile=blocks",
        "training.recompute=selective",
    ]
    assert ours.overrides("training.recompute_blocks.attn=full") == ["training.recompute_blocks.attn=full"]
    assert ours.overrides("default") == []
    with pytest.raises(ValueError, match="key=value"):
        ours.overrides("compile")


def test_env_items_set_the_environment_while_the_contender_is_built_and_timed(monkeypatch):
    variable = "BLOCKZOO_CROSS_ENTROPY_KERNEL"
    monkeypatch.delenv(variable, raising=False)
    setting = f"{FP32},env.{variable}=fast"
    assert ours.overrides(setting) == [FP32]
    tokens = ours.random_tokens(2, 8, shapes.LLAMA_TINY.vocab, torch.device("cpu"))

    def time(step):
        return harness.time_steps(step, warmup=1, steps=1, device=torch.device("cpu"))

    with pytest.raises(ValueError, match="kernel 'fast'"):  # the step's loss read the variable
        ours.timed_training(shapes.llama_model(shapes.LLAMA_TINY), setting, tokens, time, None, 1e-3)
    assert variable not in os.environ
    monkeypatch.setenv(variable, "plain")
    with ours.environment(f"env.{variable}=triton"):
        assert os.environ[variable] == "triton"
    assert os.environ[variable] == "plain"


def test_a_setting_this_blockzoo_refuses_makes_the_contender_absent():
    with pytest.raises(harness.Absent, match="no_such_knob"):
        ours.run_config(shapes.llama_model(shapes.LLAMA_TINY), "no_such_knob=1", rows=1, length=8)
    config = ours.run_config(shapes.llama_model(shapes.LLAMA_TINY), "gradient_clipping=2.0", rows=3, length=8)
    assert config.training.gradient_clipping == 2.0 and config.data.micro_batch_size == 3


def test_bare_step_loss_is_the_mean_next_token_loss_and_trains():
    model, optimizer = ours.build(ours.run_config(shapes.llama_model(shapes.LLAMA_TINY), FP32, rows=2, length=8))
    tokens = ours.random_tokens(2, 8, shapes.LLAMA_TINY.vocab, torch.device("cpu"))
    with torch.no_grad():
        logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), tokens[:, 1:].flatten())
    step = ours.bare_step(model, optimizer, tokens)
    first = float(step())
    assert first == pytest.approx(float(expected), rel=1e-5)
    assert float(step()) < first  # the optimizer stepped


def test_trainer_step_times_come_from_consecutive_log_lines():
    from benchmarks.trainer import STEP_LINE, step_times

    assert step_times([(2, 13.0), (1, 10.5), (3, 14.0)], start=10.0) == [0.5, 2.5, 1.0]
    assert step_times([(4, 15.0), (2, 11.0)], start=10.0) == [0.5, 0.5, 2.0, 2.0]  # a line every 2 steps
    assert STEP_LINE.search("[#...] step 3/25 | loss 1.2").group(1) == "3"


def test_profile_step_phases_time_each_part_of_the_trainer_step_on_the_cpu(capsys):
    """`profile_step.py --phases` wraps the parts of the Trainer's step it times (the gradient norm's clipping
    included): each is found, called and reported, here at the trainer suite's tiny shape."""
    from benchmarks import profile_step
    from benchmarks.trainer import CASES, TINY, TINY_COMMON

    tiny = [*TINY_COMMON, *TINY["gpu"], FP32]
    profile_step.main([str(CASES["gpu"]), *tiny, "--phases", "--steps", "2", "--warmup", "1"])
    times = dict(re.findall(r"^  (\S.*?) +([0-9.]+) ms$", capsys.readouterr().out, re.MULTILINE))
    parts = ["forward + backward", "gradient norm, clipping", "optimizer step", "next step's data"]
    assert [part for part in parts if float(times.get(part, 0)) <= 0] == []


def test_fp8_losses_compares_every_step_of_an_fp8_run_with_the_bf16_run(tmp_path, capsys):
    """`fp8_losses.py --tiny`: a bf16 run and an FP8 run (torchao's emulation) of the same batches; every step's loss
    of each is recorded, the FP8 run computes other losses (FP8 was on) close to bf16's, and the largest difference
    reported is that of the recorded losses."""
    pytest.importorskip("torchao.float8", reason="torchao (blockzoo[fp8]) is not installed here")
    from benchmarks import fp8_losses

    output = tmp_path / "losses.json"
    fp8_losses.main(
        ["--tiny", "--rows", "2", "--length", "64", "--steps", "4", "--log-interval", "2", "--json", str(output)]
    )
    record = json.loads(output.read_text())
    bf16, fp8 = record["losses"]["bf16"], record["losses"]["fp8 tensorwise"]
    assert list(bf16) == list(fp8) == ["1", "2", "3", "4"]
    assert fp8 != bf16 and fp8 == pytest.approx(bf16, rel=0.05)
    largest = max(abs(fp8[step] - bf16[step]) / bf16[step] for step in bf16)
    assert record["largest_difference"]["fp8 tensorwise"] == pytest.approx(largest)
    assert f"largest difference of a step's loss from bf16's {largest:.3%}" in capsys.readouterr().out


def test_profile_step_sums_gpu_work_by_kind_of_kernel():
    """The profile's GPU time counts kernels, copies and fills, not the annotations laid over them nor CUPTI's
    overhead; an inductor kernel whose name carries a product's name is Triton's work; overlaps count once."""
    from benchmarks import profile_step

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, activity="kernel", annotation=False):
        interval = types.SimpleNamespace(start=start, end=end)
        return types.SimpleNamespace(
            name=name, device_type=device, time_range=interval, activity_type=activity, is_user_annotation=annotation
        )

    events = [
        event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 3000),
        event("triton_poi_fused__scaled_mm__to_copy_clamp_3", 3000, 4000),
        event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3500, 5500),
        event("Memset (Device)", 6000, 6500, activity="gpu_memset"),
        event("Optimizer.step#AdamW.step", 0, 9000, activity="gpu_user_annotation", annotation=True),
        event("Command Buffer Full", 0, 9000, activity="overhead"),
        event("aten::mm", 0, 9000, device=cpu, activity="cpu_op"),
    ]
    kinds = profile_step.kernel_kinds(events)
    assert kinds == {
        "matrix products": 0.003,
        "Triton (inductor's and ours)": 0.001,
        "attention": 0.002,
        "other": 0.0005,
    }
    assert profile_step.busy_seconds(events) == pytest.approx(0.006)


def test_device_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPOSITORY / "benchmarks/device.sh")], check=True)
    subprocess.run(["bash", "-n", str(REPOSITORY / "benchmarks/make_wheels.sh")], check=True)


# -- torchtitan --------------------------------------------------------------------------------------------------------


def titan_peer():
    """benchmarks.titan_peer, or skip the test where torchtitan is not installed (the nox session that runs these
    tests installs it: noxfile.py BENCHMARK_PEERS)."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed here")
    from benchmarks import titan_peer

    return titan_peer


def test_torchtitan_llama_1b_has_our_parameter_count():
    peer = titan_peer()
    with torch.device("meta"):
        theirs = peer.llama_config(shapes.LLAMA_1B, 4096, attention="flex").build()
    ours_count = shapes.parameter_count(shapes.our_model(shapes.llama_model(shapes.LLAMA_1B)))
    assert shapes.parameter_count(theirs) == ours_count


def test_torchtitan_weight_map_gives_transformers_logits():
    """Our initial weights through the map into torchtitan's Llama 3 (fp32, its causal SDPA) give transformers'
    logits from the same weights, rows of several lengths: the rotary permutation and the fused QKV load are right."""
    from transformers import LlamaForCausalLM

    peer = titan_peer()
    shape = shapes.LLAMA_TINY
    model, _ = ours.build(ours.run_config(shapes.llama_model(shape), FP32, rows=1, length=16))
    weights = {name: tensor.detach() for name, tensor in model.named_parameters()}
    reference = LlamaForCausalLM._from_config(shapes.transformers_llama_config(shape, 16), attn_implementation="sdpa")
    shapes.load_into(reference, shapes.llama_to_transformers(weights, shape.layers))
    theirs = peer.build_llama(peer.llama_config(shape, 16, attention="sdpa"), torch.device("cpu"))
    peer.load(theirs, peer.llama_to_torchtitan(weights, shape))
    assert shapes.parameter_count(theirs) == shapes.parameter_count(model)
    tokens = ours.random_tokens(3, 16, shape.vocab, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(peer.llama_logits(theirs, tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_torchtitan_flex_masks_are_causal_within_each_row():
    """The block masks torchtitan's decoder makes for its FlexAttention (through `_block_masks_of_an_older_torch` on
    a torch without `separate_full_blocks`) are torch's own causal masks of each row, full blocks separated."""
    from torch.nn.attention.flex_attention import create_block_mask

    peer = titan_peer()
    shape, length = shapes.LLAMA_TINY, 512
    with torch.device("meta"):
        model = peer.llama_config(shape, length, attention="flex").build()
    positions = torch.arange(length).expand(2, length)
    theirs = model.get_attention_masks(positions)
    expected = create_block_mask(lambda b, h, q, kv: kv <= q, 2, None, length, length, device="cpu")
    assert torch.equal(theirs.to_dense(), expected.to_dense())
    assert torch.equal(theirs.full_kv_num_blocks, expected.full_kv_num_blocks)
    assert int(theirs.full_kv_num_blocks.sum()) > 0


def test_torchtitan_float8_converts_the_linears_torchao_can_take():
    """torchtitan's converter with torchao's tensorwise recipe swaps every linear (dims divisible by 16) for
    torchao's Float8Linear; its emulated step-0 loss stays near the bf16 one."""
    peer = titan_peer()
    from torchao.float8.float8_linear import Float8Linear

    shape = shapes.LLAMA_TINY
    model = peer.build_llama(peer.llama_config(shape, 16, attention="sdpa", float8="tensorwise", emulate=True), "cpu")
    linears = {name: type(module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert linears and all(issubclass(kind, Float8Linear) for kind in linears.values()), linears
    assert model.lm_head.config.cast_config_weight.scaling_granularity.value == "tensorwise"


def test_torchtitan_moe_weight_map_gives_transformers_outputs():
    """Our MoE weights through the map into torchtitan's MoE give transformers' Qwen3-MoE block's outputs (theirs
    multiplies in bf16 whatever the weights: bf16's precision) and its parameter count at Qwen3-30B-A3B's layer."""
    peer = titan_peer()
    with torch.device("meta"):
        layer = shapes.our_layer(
            shapes.moe_layer(shapes.QWEN3_MOE), kind="mlp", hidden=2048, device="cpu", initialize=False
        )
    full = peer.moe_layer(shapes.QWEN3_MOE, torch.device("meta"))
    assert shapes.parameter_count(full) == shapes.parameter_count(layer)
    shape = shapes.MoEShape(tokens=40, hidden=16, ffn=16, experts=6, top_k=2, family="qwen3_moe")
    layer = shapes.our_layer(shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device="cpu")
    weights = {name: tensor.detach() for name, tensor in layer.named_parameters()}
    block = shapes.transformers_moe_block(shape, "eager")
    shapes.load_into(block, shapes.moe_to_transformers(weights, shape))
    theirs = peer.moe_layer(shape, torch.device("cpu"))
    peer.load(theirs, peer.moe_to_torchtitan(weights, shape))
    hidden = torch.randn(1, shape.tokens, shape.hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = block(hidden)
        expected = expected[0] if isinstance(expected, tuple) else expected
        output = theirs(hidden)
    assert float((output - expected).norm() / expected.norm()) < 1e-2


def test_torchtitan_options_parse_and_refuse_unknown_words():
    from benchmarks.llama import torchtitan_options

    assert torchtitan_options("compile,checkpointing=selective") == {"compile": True, "checkpointing": "selective"}
    assert torchtitan_options("eager") == {"compile": False, "checkpointing": None}
    with pytest.raises(ValueError, match="checkpointing=some"):
        torchtitan_options("checkpointing=some")


# -- the suites at tiny shapes -----------------------------------------------------------------------------------------


def run_suite(tmp_path, suite: str, *arguments: str) -> list[dict]:
    path = tmp_path / f"{suite}.jsonl"
    command = [sys.executable, f"benchmarks/{suite}.py", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"]
    completed = subprocess.run(
        [*command, "--json", str(path), *arguments], cwd=REPOSITORY, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return [json.loads(line) for line in path.read_text().splitlines()]


def statuses(records: list[dict]) -> dict[tuple[str, str], str]:
    return {
        (record["case"], record["contender"]): record["status"] for record in records if record["record"] == "result"
    }


def test_hybrid_suite_runs_ours_and_transformers_with_equal_losses(tmp_path):
    records = run_suite(tmp_path, "hybrid", "--ours", "compile=none")
    assert statuses(records) == {
        ("4x4096", "ours (compile=none)"): "ok",
        ("4x4096", "transformers Qwen3NextForCausalLM"): "ok",
    }
    assert all(record["extra"]["loss0 ok"] for record in records if record["record"] == "result")


@pytest.mark.slow
def test_llama_suite_runs_ours_and_transformers_with_equal_losses(tmp_path):
    records = run_suite(tmp_path, "llama", "--cases", "4x4096", "--ours", "compile=none", "--peers", "transformers")
    found = statuses(records)
    assert found == {("4x4096", "ours (compile=none)"): "ok", ("4x4096", "transformers (sdpa)"): "ok"}
    results = [record for record in records if record["record"] == "result"]
    assert all(result["extra"]["loss0 ok"] for result in results)


@pytest.mark.slow
def test_llama_suite_runs_torchtitan_and_its_float8_with_our_losses(tmp_path):
    titan_peer()
    arguments = ["--cases", "4x4096", "--ours", "compile=none", "--peers", "torchtitan", "torchtitan-float8"]
    records = run_suite(tmp_path, "llama", *arguments)
    assert statuses(records) == {
        ("4x4096", "ours (compile=none)"): "ok",
        ("4x4096", "torchtitan Llama 3 (eager)"): "ok",
        ("4x4096", "torchtitan Llama 3 (eager, float8 tensorwise)"): "ok",
    }
    results = [record for record in records if record["record"] == "result"]
    assert all(result["extra"]["loss0 ok"] for result in results)


@pytest.mark.slow
def test_moe_suite_runs_torchtitan_and_ours_in_bf16_weights(tmp_path):
    titan_peer()
    found = statuses(run_suite(tmp_path, "moe", "--cases", "qwen3-8192"))
    for contender in (
        "ours (blockzoo moe), bf16 weights",
        "torchtitan MoE (grouped GEMMs), fp32 weights",
        "torchtitan MoE (grouped GEMMs), bf16 weights",
    ):
        assert found[("qwen3-8192", contender)] == "ok", found


@pytest.mark.slow
def test_mamba2_suite_runs_ours_and_reports_a_missing_mamba_ssm(tmp_path):
    found = statuses(run_suite(tmp_path, "mamba2", "--cases", "4x4096", "layer", "--ours", "compile=none"))
    assert found[("4x4096", "ours (compile=none)")] == "ok" and found[("layer", "ours (blockzoo mamba_2)")] == "ok"
    if importlib.util.find_spec("mamba_ssm") is None:  # where it is installed, its Triton kernels need a GPU
        assert found[("layer", "mamba_ssm Mamba2 (use_mem_eff_path=False)")] == "absent"
        assert found[("4x4096", "mamba_ssm MambaLMHeadModel (Mamba2)")] == "absent"


@pytest.mark.slow
def test_moe_suite_runs_ours_and_transformers(tmp_path):
    found = statuses(run_suite(tmp_path, "moe", "--cases", "mixtral"))
    assert found[("mixtral", "ours (blockzoo moe)")] == "ok"
    assert found[("mixtral", "transformers Mixtral block, eager, fp32 + autocast")] == "ok"


def test_kernels_suite_sets_up_and_runs_the_rotary_case(tmp_path):
    """The fast sibling of the next test: the case whose set-up calls the attention plugin's API."""
    found = statuses(run_suite(tmp_path, "kernels", "--cases", "rotary-4096x64"))
    assert found[("rotary-4096x64", "ours (blockzoo_attention apply_rotary)")] == "ok", found


@pytest.mark.slow
def test_kernels_suite_runs_a_case_of_each_kind(tmp_path):
    cases = ["rmsnorm-32768x2048", "add-rmsnorm-32768x2048", "rotary-4096x64", "swiglu-16384x8192", "ce-50288"]
    records = run_suite(tmp_path, "kernels", "--cases", *cases, "conv-16384")
    found = statuses(records)
    assert {case for case, _ in found} == {*cases, "conv-16384"}, found  # a case that could not be set up has none
    for record in records:
        if record["record"] == "case" and record["case"] in cases:
            ours_result = next(result for result in record["results"] if result["ours"])
            assert ours_result["status"] == "ok", record["case"]
    assert found[("conv-16384", "ours (blockzoo_ssm.causal_conv1d)")] == "ok"
    assert found[("conv-16384", "plain torch (shifted taps), eager")] == "ok"


@pytest.mark.slow
def test_trainer_suite_times_the_trainer_and_the_bare_step(tmp_path):
    found = statuses(run_suite(tmp_path, "trainer", "--cases", "gpu", "--ours", "compile=none", "--log-interval", "1"))
    assert found == {("gpu", "Trainer (compile=none)"): "ok", ("gpu", "bare step (compile=none)"): "ok"}


def test_memory_step_replays_the_trace_to_its_peak_and_names_who_allocated():
    from benchmarks.memory_step import peak_contents

    def frames(line):
        return [
            {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/repo/mixers/mamba_2.py", "line": line, "name": "forward"},
        ]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames(10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames(20)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 30, "frames": frames(20)},
        {"action": "alloc", "addr": 4, "size": 90, "frames": frames(30)},  # the peak: 50 + 30 + 90
        {"action": "free_completed", "addr": 4, "size": 90},
        {"action": "alloc", "addr": 5, "size": 10, "frames": frames(10)},
    ]
    peak, contents = peak_contents(trace)
    assert peak == 170
    assert contents == [("mixers/mamba_2.py:30 forward", 90, 1), ("mixers/mamba_2.py:20 forward", 80, 2)]


def test_prepare_benchmark_tiny_checks_equal_token_ids_and_reports_both(tmp_path):
    """benchmarks/prepare.py at --tiny: both contenders run, the script's check of equal token ids passes (it raises
    otherwise), and the figures are written."""
    result = subprocess.run(
        [sys.executable, "benchmarks/prepare.py", "--tiny", "--directory", str(tmp_path), "--json",
         str(tmp_path / "prepare.json")],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((tmp_path / "prepare.json").read_text())
    assert figures["tokens"] > 100_000
    for contender in ("ours", "peer"):
        assert figures[contender]["seconds"] > 0 and figures[contender]["peak_mib"] > 0
    assert "the same documents, the same ids" in result.stdout
