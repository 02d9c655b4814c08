"""`CurriculumScheduler` against DeepSpeed 0.19.8's values, and the config blocks that build it.

The expected difficulties are DeepSpeed's: the per-step sequence lengths its own unit tests assert
(`tests/unit/runtime/test_data_efficiency.py`, legacy fixed_discrete and fixed_linear), and values worked out
by hand from its pacing functions (floor, then down to a multiple of difficulty_step, never below the first
multiple at or above min_difficulty, never above max_difficulty).
"""

from __future__ import annotations

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.data_pipeline import CurriculumScheduler

BASE = {"train_batch_size": 2}


def _legacy(**block):
    return load_config(
        {**BASE, "curriculum_learning": {"enabled": True, **block}}, world_size=1
    ).curriculum_learning


def _run(scheduler, steps):
    return [scheduler.update_difficulty(step) for step in steps]


def test_fixed_discrete_matches_deepspeed():
    block = _legacy(min_difficulty=1, max_difficulty=5, schedule_type="fixed_discrete",
                    schedule_config={"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]})  # fmt: skip
    # DeepSpeed's ground truth: step -> difficulty, 5 from step 9 on
    assert _run(CurriculumScheduler(block), range(1, 12)) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5]


def test_fixed_linear_matches_deepspeed():
    block = _legacy(min_difficulty=2, max_difficulty=10, schedule_type="fixed_linear",
                    schedule_config={"total_curriculum_step": 8, "difficulty_step": 2})  # fmt: skip
    assert _run(CurriculumScheduler(block), range(1, 11)) == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]


def test_fixed_root_grows_fast_first():
    # min 8, max 1024, 100 steps, step 8, square root: floor(sqrt(s/100) * 1016 + 8) down to a multiple of 8
    block = _legacy(min_difficulty=8, max_difficulty=1024, schedule_type="fixed_root",
                    schedule_config={"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2})  # fmt: skip
    got = {s: CurriculumScheduler(block).get_difficulty(s) for s in (0, 1, 4, 25, 50, 100, 200)}
    assert got == {0: 8, 1: 104, 4: 208, 25: 512, 50: 720, 100: 1024, 200: 1024}


def test_floor_never_starts_below_min_difficulty():
    # min 8 with difficulty_step 16: flooring gives 0 on the first step; DeepSpeed 0.19.8 raises it to 16
    block = _legacy(min_difficulty=8, max_difficulty=64, schedule_type="fixed_linear",
                    schedule_config={"total_curriculum_step": 10, "difficulty_step": 16})  # fmt: skip
    assert CurriculumScheduler(block).get_difficulty(1) == 16


def test_custom_schedule_and_its_absence():
    block = _legacy(min_difficulty=1, max_difficulty=9, schedule_type="custom")
    scheduler = CurriculumScheduler(block)
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: min(9, 2 * step))
    assert _run(scheduler, range(1, 7)) == [2, 4, 6, 8, 9, 9]


def test_difficulty_stops_at_the_maximum_and_state_round_trips():
    block = _legacy(min_difficulty=1, max_difficulty=3, schedule_type="custom")
    scheduler = CurriculumScheduler(block)
    scheduler.set_custom_get_difficulty(lambda step: [1, 3, 2][min(step, 2)])
    assert _run(scheduler, [0, 1, 2]) == [1, 3, 3]  # once at the maximum the schedule is no longer asked
    other = CurriculumScheduler(block)
    other.load_state_dict(scheduler.state_dict())
    assert other.get_current_difficulty() == 3 and other.state["current_difficulty"] == 3


def test_deepspeed_dict_builds_the_same_scheduler():
    config = {"curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}  # fmt: skip
    assert _run(CurriculumScheduler(config), range(1, 11)) == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
    with pytest.raises(ConfigError, match=r"schedule_config\.difficulty_step: required by schedule_type"):
        CurriculumScheduler({**config, "schedule_config": {"total_curriculum_step": 8}})


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"min_difficulty": 1}, r"^curriculum_learning\.max_difficulty: required when curriculum learning"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1}},
         r"schedule_config\.root_degree: required by schedule_type 'fixed_root'"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_discrete",
          "schedule_config": {"difficulty": [1, 2], "max_step": [1, 2]}}, r"one entry more than max_step"),
        ({"min_difficulty": 5, "max_difficulty": 4, "schedule_type": "custom"}, r"4 is below min_difficulty 5"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "cosine"}, r"schedule_type: must be one of"),
        ({"curriculum_type": "vocab", "min_difficulty": 1}, r"curriculum_type: must be one of 'seqlen'"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "custom", "warmup": 3},
         r"unknown key 'curriculum_learning\.warmup'"),
    ],
)  # fmt: skip
def test_legacy_block_is_checked_when_loaded(block, message):
    with pytest.raises(ConfigError, match=message):
        _legacy(**block)


def test_disabled_legacy_block_needs_nothing():
    assert not load_config(
        {**BASE, "curriculum_learning": {"enabled": False}}, world_size=1
    ).curriculum_learning.enabled
