"""The `data_efficiency` block: what loads, what is refused and how the refusal names the key."""

from __future__ import annotations

import copy

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.data_pipeline.engine_part import refuse_for_pipeline

METRIC = {"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 2,
          "max_difficulty": 10, "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2, "root_degree": 1}}  # fmt: skip
BLOCK = {"enabled": True, "seed": 1234, "data_sampling": {"enabled": True, "num_workers": 0, "curriculum_learning": {
    "enabled": True, "data_cluster_path": "/tmp/clusters", "curriculum_metrics": {"seqlen": METRIC}}}}  # fmt: skip


def _load(block):
    return load_config({"train_batch_size": 2, "data_efficiency": block}, world_size=1)


def _changed(path: str, value):
    block = copy.deepcopy(BLOCK)
    *parents, key = path.split(".")
    where = block
    for parent in parents:
        where = where.setdefault(parent, {})
    where[key] = value
    return block


def test_deepspeeds_own_example_loads():
    config = _load(BLOCK).data_efficiency
    assert config.curriculum_enabled and not config.random_ltd_enabled
    metric = config.data_sampling.curriculum_learning.curriculum_metrics["seqlen"]
    assert metric.schedule_config.root_degree == 1 and config.data_sampling.num_epochs == 1000


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("enabled", False, r"curriculum_learning\.enabled: true while data_efficiency\.enabled is false"),
        ("data_sampling.enabled", False, r"while data_efficiency\.data_sampling\.enabled is false"),
        ("data_sampling.dynamic_batching", {"enabled": True, "max_tokens": 512},
         r"dynamic_batching: this block is not supported by shardspeed \(dynamic batching"),
        ("data_sampling.curriculum_learning.data_cluster_path", None, r"data_cluster_path: required when"),
        ("data_sampling.curriculum_learning.curriculum_metrics", {}, r"curriculum_metrics: curriculum learning is"),
        ("data_sampling.curriculum_learning.curriculum_metrics.seqlen.clustering_type", "schedule_based",
         r"seqlen\.index_to_sample_path: required with schedule_based clustering"),
        ("data_sampling.curriculum_learning.curriculum_metrics.seqlen.difficulty_type", "rank",
         r"seqlen\.difficulty_type: must be one of 'value', 'percentile'"),
        ("data_sampling.num_epochs", 0, r"data_sampling\.num_epochs: must be > 0"),
        ("data_sampling.shuffle", True, r"unknown key 'data_efficiency\.data_sampling\.shuffle'"),
        ("data_routing", {"enabled": True, "random_ltd": {"enabled": True}},
         r"random_ltd\.total_layer_num: required when random_ltd is enabled"),
    ],
)  # fmt: skip
def test_refused_naming_the_key(path, value, message):
    with pytest.raises(ConfigError, match=message):
        _load(_changed(path, value))


def test_switched_off_blocks_need_nothing():
    assert not _load({"enabled": False, "data_sampling": {"curriculum_learning": {"enabled": False}}}).data_efficiency.curriculum_enabled  # fmt: skip


def test_the_pipeline_engine_refuses_what_it_cannot_apply():
    with pytest.raises(ConfigError, match=r"data_efficiency\.data_sampling\.curriculum_learning: not supported with a PipelineModule"):  # fmt: skip
        refuse_for_pipeline(_load(BLOCK))
    refuse_for_pipeline(_load({"enabled": False}))  # nothing on: nothing to refuse
