"""A false capability claim cannot pass the kit's default checks: for each capability check, a deliberately wrong layer
fails it with the kit's defaults, and the right one passes.

- sequence_data_parallel: a gated linear recurrence (`kitrec.decaying_sum`, plugins/kit_layers.py) right, with the
  decay between ranks replaced by its square root, dropping the state it receives, or handing the next step its own
  state; all three are right in one process, slice after slice, so only the ranks' check can see them. It sees them
  because its batches are generated (`blockzoo_testing.layouts`): every slice continues a document, one lies wholly
  inside a continued document, over 2 and 4 ranks, with and without micro-sequences. The generator's properties are
  checked by hypothesis against an independent reading of the lengths; the fixed layout the kit used before is shown
  to let the square-root decay through.
- sequence_tensor_parallel: a replicated input scale made without `token_sharded_input=True` (`kittp`).
- a plugin declaring plugin API 1.0 while claiming sequence_data_parallel (1.1) fails at registration, in strict mode
  and in the kit, with the capability and the version it needs.
- tensor_parallel, generation_cache, padded batches: test_conformance_kit.py's `false_tensor_parallel`, `forgetful`
  and `length_bound` fail the default checks there.
"""

import json
import os
import re
import subprocess
import sys
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockzoo.api import MixerConfig, PluginInfo
from blockzoo.errors import PluginError
from blockzoo.plugins import capability_api_problem, get_registry
from blockzoo_testing import ConformanceError, MixerConformance, check_sequence_data_parallel
from blockzoo_testing.layouts import layout_problems, straddling_lengths

sys.path.insert(0, str(Path(__file__).parent / "plugins"))
import kit_layers


@pytest.fixture
def kit_plugins(blockzoo_registry):
    kit_layers.register()


def kit(type_name: str, **options) -> MixerConformance:
    class Kit(MixerConformance):
        def config_factory(self):
            return {"type": type_name, **options}

    return Kit()


# ---------------------------------------------------------------------------------------------------------------------
# The generated layouts


def _slices_continuing(lengths, ranks, micro):
    """An independent reading of `lengths`: per slice, (continues a document, holds a start, goes on after it)."""
    tokens = sum(lengths)
    size = micro or tokens // ranks
    starts = set(accumulate(lengths[:-1], initial=0))
    return [
        (
            start not in starts,
            any(token in starts for token in range(start + 1, start + size)),
            start + size < tokens and start + size not in starts,
        )
        for start in range(0, tokens, size)
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.sampled_from([None, 2, 3, 4, 5]), st.integers(0, 2**31))
def test_generated_layouts_straddle_every_boundary(ranks, micro, seed):
    lengths = straddling_lengths(ranks, micro, seed=seed)
    assert all(length >= 1 for length in lengths)
    assert layout_problems(lengths, ranks, micro) == []
    slices = _slices_continuing(lengths, ranks, micro)
    assert len(slices) == ranks * (2 if micro else 1)
    assert all(continues for continues, _, _ in slices[1:])  # every boundary inside a document
    # A slice wholly inside a document continued from before it and going on after it ...
    whole = [index for index, (continues, cut, goes_on) in enumerate(slices) if continues and goes_on and not cut]
    if ranks >= 3:  # ... between two ranks of a step
        assert any(0 < index % ranks < ranks - 1 for index in whole)
    if micro:  # ... at the end of the first step, so the carry passes through it
        assert ranks - 1 in whole
    if len(slices) > 3:  # and a slice inside the batch holding a document start
        assert any(cut for _, cut, _ in slices[1:-1])


def test_layout_problems_name_what_a_fixed_layout_lacks():
    # The kit's former batch: over 2 ranks its boundary (token 6) is a document start.
    assert layout_problems((5, 1, 6), 2) == ["the boundary at token 6 (before slice 1) is a document start"]
    # Over 3 ranks (slices of 8) the second slice starts a document (token 8) and holds another (11).
    assert layout_problems((7, 1, 3, 9, 4), 3) == [
        "the boundary at token 8 (before slice 1) is a document start",
        "no slice between two ranks of a step lies wholly inside a continued document",
    ]
    assert layout_problems((7, 1, 3, 9, 4), 4) == []  # Slice [12, 18) lies inside tokens 11:20, between ranks 1 and 3.


# ---------------------------------------------------------------------------------------------------------------------
# sequence_data_parallel

WRONG_STATE_PASSING = ["sqrt_decay", "drops_received_state", "own_state_as_carry"]


@pytest.mark.parametrize("type_name", ["decaying_sum", *WRONG_STATE_PASSING])
def test_every_recurrence_is_right_one_slice_after_another(kit_plugins, type_name):
    conformance = kit(f"kitrec.{type_name}")
    conformance.test_packed_documents_equal_separate_runs()
    conformance.test_forward_slices_equal_the_whole_forward()


@pytest.mark.distributed
def test_the_default_check_fails_every_wrong_state_passing(kit_plugins):
    """One set of 4 processes: the right recurrence and the three wrong ones, over 2 and 4 ranks, with and without
    micro-sequences (the kit's defaults)."""
    cases = {name: {"type": f"kitrec.{name}"} for name in ["decaying_sum", *WRONG_STATE_PASSING]}
    with pytest.raises(ConformanceError) as raised:
        check_sequence_data_parallel(MixerConfig, cases)
    lines = str(raised.value).split("\nWhat to fix:")[0].splitlines()
    failing = {line.split(":")[0] for line in lines}
    assert failing == set(WRONG_STATE_PASSING)
    layouts = {
        name: {line.split(", rank")[0].split(": ", 1)[1] for line in lines if line.startswith(name)} for name in failing
    }
    generated = {size: {micro: straddling_lengths(size, micro, seed=1234) for micro in (None, 3)} for size in (2, 4)}
    plain, micro4 = (
        f"sequence_data_parallel=4, documents {list(generated[4][None])}",
        f"sequence_data_parallel=4, micro_sequence_length=3, documents {list(generated[4][3])}",
    )
    micro2 = f"sequence_data_parallel=2, micro_sequence_length=3, documents {list(generated[2][3])}"
    # Through a slice inside a continued document: between ranks 1 and 2 of 4, and into the next step.
    assert {plain, micro2, micro4} <= layouts["sqrt_decay"]
    # Every rank after the first receives a state, in every layout.
    assert layouts["drops_received_state"] == {
        f"sequence_data_parallel=2, documents {list(generated[2][None])}",
        plain,
        micro2,
        micro4,
    }
    # The carry matters only between steps.
    assert layouts["own_state_as_carry"] == {micro2, micro4}


@pytest.mark.distributed
def test_a_fixed_layout_with_boundaries_on_document_starts_lets_the_wrong_decay_through(kit_plugins):
    """Why the layouts are generated: the kit's former batch (5, 1, 6) over 2 ranks puts the ranks' boundary on a
    document start, and its micro-sequences of 3 pass no state through a whole slice."""
    check_sequence_data_parallel(
        MixerConfig, {"sqrt": {"type": "kitrec.sqrt_decay"}}, lengths=(5, 1, 6), sequence_data_parallel=2
    )


@pytest.mark.distributed
def test_the_kit_test_fails_the_wrong_decay(kit_plugins):
    """The check an author's test class inherits (the right recurrence passes the same defaults above)."""
    with pytest.raises(ConformanceError, match=r"^config_factory\(\): sequence_data_parallel=\d.* the output differs"):
        kit("kitrec.sqrt_decay").test_sequence_data_parallel_matches_one_process()


# ---------------------------------------------------------------------------------------------------------------------
# sequence_tensor_parallel


@pytest.mark.distributed
def test_the_default_check_fails_a_gradient_not_summed_over_token_shards(kit_plugins):
    kit("kittp.input_scale").test_tensor_parallel_matches_one_process()
    with pytest.raises(ConformanceError) as raised:
        kit("kittp.scale_gradient_not_summed").test_tensor_parallel_matches_one_process()
    message = str(raised.value)
    # Plain tensor parallelism is right; with the tokens split, the scale's gradient covers one rank's tokens.
    assert message.startswith(
        "config_factory(): tensor_parallel=2 with sequence_tensor_parallel: the gradient of 'scale' differs"
    )
    assert "tensor_parallel=2: the" not in message
    assert "create_parameter(..., token_sharded_input=True or partial_gradient=True)" in message


# ---------------------------------------------------------------------------------------------------------------------
# A capability newer than the plugin API the plugin declares

OLD_API = (
    "declares plugin API 1.0 (plugin_info's api_version) but claims capabilities a 1.0 core does not have: "
    "sequence_data_parallel (plugin API 1.1; claimed by {claimers}). Declare PluginInfo(api_version=(1, 1), ...)"
)


@pytest.mark.parametrize(
    ("capabilities", "claimers"),
    [(("sequence_data_parallel",), "plugin_info, kitold.decaying_sum"), ((), "kitold.decaying_sum")],
    ids=["in-plugin-info-and-config", "on-the-config-only"],
)
def test_a_capability_newer_than_the_declared_api_fails_the_plugin(blockzoo_registry, capabilities, claimers):
    kit_layers.register_written_for_old_api(capabilities)
    record = blockzoo_registry.plugins["kitold"]
    assert record.status == "failed"
    assert record.error.startswith(OLD_API.format(claimers=claimers))
    assert not record.types  # none of its types is registered
    with pytest.raises(PluginError, match=re.escape("plugin 'kitold' failed to load: declares plugin API 1.0")):
        get_registry(strict=True)


def test_the_kit_names_the_capability_and_the_api_it_needs(blockzoo_registry):
    kit_layers.register_written_for_old_api()
    with pytest.raises(ConformanceError, match=re.escape(OLD_API.format(claimers="plugin_info, kitold.decaying_sum"))):
        kit("kitold.decaying_sum").test_discovered_through_its_entry_point()


def test_a_plugin_declaring_the_api_of_its_capabilities_loads(blockzoo_registry):
    kit_layers.register()
    assert blockzoo_registry.plugins["kitrec"].status == "loaded"
    assert capability_api_problem(PluginInfo(api_version=(1, 0), capabilities=("tensor_parallel",))) is None


# ---------------------------------------------------------------------------------------------------------------------
# Module transforms: copy, cast, move, state_dict


def test_a_layer_survives_copy_cast_move_and_state_dict(kit_plugins):
    kit("kitrec.decaying_sum").test_survives_module_transforms()


def test_a_layer_hiding_module_apply_fails_the_transforms_check(kit_plugins):
    with pytest.raises(ConformanceError, match=r"^\.to\(torch\.float64\) raised TypeError: .*a helper named `_apply`"):
        kit("kitrec.hides_apply").test_survives_module_transforms()


@pytest.fixture(scope="module")
def outdated_site(tmp_path_factory) -> Path:
    """The outdated plugin installed with pip into a directory of its own (only the CLI below sees it)."""
    target = tmp_path_factory.mktemp("site")
    plugin = Path(__file__).parent / "plugins" / "outdated"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            target,
            plugin,
        ],
        check=True,
        capture_output=True,
    )
    return target


def test_blockzoo_plugins_reports_the_outdated_claim_as_failed(outdated_site):
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(outdated_site), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "blockzoo", "plugins"]
    listed = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env, timeout=120)
    record = next(plugin for plugin in json.loads(listed.stdout)["plugins"] if plugin["name"] == "outdated")
    assert record["status"] == "failed" and record["api_version"] == "1.0"
    assert record["error"].startswith(OLD_API.format(claimers="plugin_info, outdated.retention"))
    # Listed as failed (not loaded, not incompatible), with the reason; strict mode makes it an error.
    checked = subprocess.run([*command, "--check"], capture_output=True, text=True, env=env, timeout=120)
    assert "outdated  [failed]  blockzoo-test-outdated 0.1.0" in checked.stdout
    assert "sequence_data_parallel (plugin API 1.1; claimed by plugin_info, outdated.retention)" in checked.stdout
    strict = subprocess.run(command, capture_output=True, text=True, env={**env, "BLOCKZOO_STRICT_PLUGINS": "1"})
    assert strict.returncode == 1
