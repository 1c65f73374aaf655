"""The pipeline fields of `distributed`: stage layout (split or balanced) and the refusals, each naming its field."""

import pytest

from blockzoo import config
from blockzoo.config import ConfigError
from blockzoo.distributed.config import DistributedConfig
from blockzoo.run_config import RunConfig

# Blocks the core alone can build (the default mixer and MLP types come from plugins).
EMPTY_BLOCK = {"mixer": {"type": "none"}, "mlp": {"type": "none"}}


def run(num_blocks: int, micro_batches: int = 8, **distributed) -> dict:
    return {
        "model": {"decoder": {"block": EMPTY_BLOCK, "num_blocks": num_blocks}},
        "distributed": distributed,
        "training": {"gradient_accumulation": micro_batches},
    }


def errors_of(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        config.structure(data, RunConfig)
    return dict(caught.value.errors)


def sizes(num_blocks: int, **distributed) -> list[int]:
    stages = config.structure(distributed, DistributedConfig).stage_blocks(num_blocks)
    assert [block for stage in stages for block in stage] == list(range(num_blocks)), "contiguous, in order"
    return [len(stage) for stage in stages]


def test_balanced_stages_give_the_remainder_to_the_middle_stages_then_the_first():
    assert sizes(8, pipeline_parallel=4) == [2, 2, 2, 2]
    assert sizes(6, pipeline_parallel=4) == [1, 2, 2, 1]  # remainder 2: the two middle stages
    assert sizes(7, pipeline_parallel=4) == [2, 2, 2, 1]  # remainder 3: the middle stages, then the first
    assert sizes(3, pipeline_parallel=2) == [2, 1]  # no middle stage: the first
    interleaved = {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "pipeline_stages_per_rank": 2}
    assert sizes(5, **interleaved) == [1, 2, 1, 1]


def test_a_split_gives_the_stages_where_it_says():
    assert sizes(4, pipeline_parallel=2, pipeline_split=[3]) == [3, 1]
    interleaved = {"pipeline_schedule": "interleaved", "pipeline_stages_per_rank": 2}
    assert sizes(6, pipeline_parallel=2, pipeline_split=[2, 3, 5], **interleaved) == [2, 1, 2, 1]
    config.structure(run(4, pipeline_parallel=2, pipeline_split=[1]), RunConfig)


def test_bad_stage_layouts_are_refused_naming_the_field():
    prefix = "distributed."
    errors = errors_of(run(4, pipeline_parallel=2, pipeline_stages_per_rank=2))
    assert "1f1b schedule runs one stage per rank" in errors[prefix + "pipeline_stages_per_rank"]
    errors = errors_of(run(4, pipeline_parallel=2, pipeline_schedule="interleaved"))
    assert "2 or more stages per rank" in errors[prefix + "pipeline_stages_per_rank"]
    errors = errors_of(run(4, pipeline_schedule="interleaved", pipeline_stages_per_rank=2))
    assert "needs pipeline_parallel > 1" in errors[prefix + "pipeline_schedule"]
    assert "needs pipeline_parallel > 1" in errors_of(run(4, pipeline_split=[2]))[prefix + "pipeline_split"]
    assert (
        "at 1 block indices" in errors_of(run(4, pipeline_parallel=2, pipeline_split=[1, 2]))[prefix + "pipeline_split"]
    )
    errors = errors_of(run(6, pipeline_parallel=4, pipeline_split=[1, 3, 3]))
    assert "stage 3 must begin after block 3" in errors[prefix + "pipeline_split.2"]
    assert (
        "stage 1 must begin after block 0"
        in errors_of(run(4, pipeline_parallel=2, pipeline_split=[0]))[prefix + "pipeline_split.0"]
    )
    errors = errors_of(run(4, pipeline_parallel=2, pipeline_split=[4]))
    assert "beyond the model's 4 blocks" in errors[prefix + "pipeline_split.0"]
    assert "need at least 4 blocks" in errors_of(run(3, pipeline_parallel=4))[prefix + "pipeline_parallel"]


def test_too_few_micro_batches_are_refused_naming_gradient_accumulation():
    errors = errors_of(run(4, micro_batches=1, pipeline_parallel=2))
    assert "1 cannot fill 2 pipeline ranks" in errors["training.gradient_accumulation"]
    interleaved = {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "pipeline_stages_per_rank": 2}
    errors = errors_of(run(4, micro_batches=5, **interleaved))
    assert "give a multiple of 2" in errors["training.gradient_accumulation"]
    config.structure(run(4, micro_batches=6, **interleaved), RunConfig)
    config.structure(run(4, micro_batches=3, pipeline_parallel=2), RunConfig)  # 1f1b: any count from 2
