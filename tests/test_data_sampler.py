"""The curriculum sampler (`DeepSpeedDataSampler`) on one rank: which samples each difficulty allows, the
data analyzer's files it reads, and its state resuming the same batches. Two ranks: test_data_efficiency_engine.py.
"""

from __future__ import annotations

import io

import pytest
import torch

from shardspeed.config import load_config
from shardspeed.data_pipeline import (
    DeepSpeedDataSampler,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    find_fit_int_dtype,
    write_metric_index,
)

SAMPLES = 40


def _block(tmp_path, metrics: dict, seed: int = 1234):
    data_efficiency = {
        "enabled": True, "seed": seed,
        "data_sampling": {"enabled": True, "num_epochs": 5, "curriculum_learning": {
            "enabled": True, "data_cluster_path": str(tmp_path / "clusters"), "curriculum_metrics": metrics}},
    }  # fmt: skip
    return load_config(
        {"train_batch_size": 4, "data_efficiency": data_efficiency}, world_size=1
    ).data_efficiency


def _metric(paths: dict | None, difficulty_type: str, schedule: dict, **extra) -> dict:
    clustering = "single_cluster" if paths is None else "schedule_based"
    files = {} if paths is None else {"index_to_sample_path": paths["index_to_sample"],
                                      "index_to_metric_path": paths["index_to_metric"]}  # fmt: skip
    return {**files, "difficulty_type": difficulty_type, "clustering_type": clustering, **schedule, **extra}


DISCRETE = {"min_difficulty": 2, "max_difficulty": 9, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [2, 5, 9], "max_step": [2, 4]}}  # fmt: skip


def _sampler(block, micro=2, gas=2) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(block, SAMPLES, micro, 0, 1, None, gas, 0)


def _take(sampler, batches: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(batches)]


def test_indexed_dataset_round_trip_and_dtypes(tmp_path):
    assert find_fit_int_dtype(0, 255) == torch.uint8 and find_fit_int_dtype(0, 70000) == torch.uint32
    assert find_fit_int_dtype(-1, 100) == torch.int8 and find_fit_int_dtype(-(2**40), 0) == torch.int64
    builder = MMapIndexedDatasetBuilder(tmp_path / "rows.bin", dtype=torch.uint16)
    for row in ([1, 2, 3], [], [65535], list(range(100))):
        builder.add_item(torch.tensor(row))
    builder.end_document()
    builder.finalize(tmp_path / "rows.idx")
    ds = MMapIndexedDataset(tmp_path / "rows")
    assert len(ds) == 4 and ds.dtype == torch.uint16 and ds.doc_idx.tolist() == [0, 4]
    assert [ds[i].long().tolist() for i in range(4)] == [[1, 2, 3], [], [65535], list(range(100))]
    assert ds.get(3, 10, 3).long().tolist() == [10, 11, 12] and ds[-1].numel() == 100


def test_metric_index_files_are_the_analyzers(tmp_path):
    values = [3, 1, 3, 2, 1, 3]
    paths = write_metric_index(tmp_path, "len", values)
    to_sample, to_metric = (
        MMapIndexedDataset(paths["index_to_sample"]),
        MMapIndexedDataset(paths["index_to_metric"]),
    )
    assert [to_sample[i].tolist() for i in range(len(to_sample))] == [[1, 4], [3], [0, 2, 5]]
    assert [to_metric[i].tolist() for i in range(len(to_metric))] == [[1], [2], [3]]
    assert MMapIndexedDataset(paths["sample_to_metric"])[5].tolist() == [3]


def test_value_curriculum_allows_only_samples_up_to_the_difficulty(tmp_path):
    values = [i % 10 for i in range(SAMPLES)]  # sample i has difficulty i % 10
    paths = write_metric_index(tmp_path / "analysis", "len", values)
    sampler = _sampler(_block(tmp_path, {"len": _metric(paths, "value", DISCRETE)}))
    batches = _take(sampler, 12)  # 2 micro-batches per global batch: curriculum steps 1..6
    for n, batch in enumerate(batches):
        step = n // 2 + 1
        allowed = 2 if step <= 2 else 5 if step <= 4 else 9
        assert len(batch) == 2 and all(values[s] <= allowed for s in batch), (step, batch)
    assert {values[s] for b in batches[8:] for s in b} - set(range(6))  # harder samples do come once allowed
    assert sampler.current_difficulties == {"len": 9}
    # one cluster per rise of the difficulty, in the cluster folder
    assert [name.split(".")[0] for name in sampler.clusters.names] == [
        "cluster_len2",
        "cluster_len5",
        "cluster_len9",
    ]
    assert MMapIndexedDataset(tmp_path / "clusters" / "cluster_len5")[0].numel() == 12  # values 3, 4, 5


def test_percentile_curriculum_takes_the_easiest_share(tmp_path):
    values = list(reversed(range(SAMPLES)))  # sample 39 is the easiest
    paths = write_metric_index(tmp_path / "analysis", "rank", values)
    # percentiles out of max_difficulty 4 (quarters): DeepSpeed needs a dataset of at least max_difficulty samples
    schedule = {"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 4], "max_step": [3]}}  # fmt: skip
    sampler = _sampler(_block(tmp_path, {"rank": _metric(paths, "percentile", schedule)}))
    first = [s for b in _take(sampler, 6) for s in b]  # steps 1-3: the easiest quarter, samples 30..39
    assert set(first) <= set(range(30, 40))
    later = {s for b in _take(sampler, 30) for s in b}
    assert later - set(range(30, 40))  # then the rest of the data


def test_a_curriculum_that_allows_nothing_is_an_error(tmp_path):
    paths = write_metric_index(tmp_path / "analysis", "len", [5] * SAMPLES)
    sampler = _sampler(_block(tmp_path, {"len": _metric(paths, "value", DISCRETE)}))  # difficulty 2 < 5
    with pytest.raises(ValueError, match="no sample is allowed yet"):
        _take(sampler, 1)


def test_single_cluster_reads_every_sample_once_per_pass(tmp_path):
    sampler = _sampler(_block(tmp_path, {"len": _metric(None, "value", DISCRETE)}))
    seen = [s for b in _take(sampler, SAMPLES // 2) for s in b]
    assert sorted(seen) == list(range(SAMPLES))  # one shuffled pass through the only cluster
    assert sampler.current_difficulties == {"len": 9}  # the difficulty is the script's to apply


def test_two_metrics_intersect(tmp_path):
    a = write_metric_index(tmp_path / "analysis", "a", [i % 4 for i in range(SAMPLES)])
    b = write_metric_index(tmp_path / "analysis", "b", [i // 10 for i in range(SAMPLES)])
    low = {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
           "schedule_config": {"difficulty": [1, 3], "max_step": [50]}}  # fmt: skip
    sampler = _sampler(_block(tmp_path, {"a": _metric(a, "value", low), "b": _metric(b, "value", low)}))
    seen = {s for batch in _take(sampler, 20) for s in batch}
    assert seen <= {i for i in range(SAMPLES) if i % 4 <= 1 and i // 10 <= 1}


def test_seed_changes_the_order(tmp_path):
    metrics = {"len": _metric(None, "value", DISCRETE)}
    first = _take(_sampler(_block(tmp_path, metrics, seed=1)), 4)
    assert _take(_sampler(_block(tmp_path, metrics, seed=1)), 4) == first
    assert _take(_sampler(_block(tmp_path, metrics, seed=2)), 4) != first


def _through_a_file(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # what a checkpoint load does


@pytest.mark.parametrize("stop", [1, 5, 11])  # mid global batch, at a difficulty rise, after reshuffles
def test_state_resumes_the_same_batches(tmp_path, stop):
    values = [i % 10 for i in range(SAMPLES)]
    paths = write_metric_index(tmp_path / "analysis", "len", values)
    block = _block(tmp_path, {"len": _metric(paths, "value", DISCRETE)})
    whole = _take(_sampler(block), 40)  # 20 curriculum steps: clusters of 12 samples are reshuffled often
    first = _sampler(block)
    assert _take(first, stop) == whole[:stop]
    state = _through_a_file(first.state_dict())
    assert any(".shuffle" in name for name in first.clusters.names) == (stop == 11)
    _take(first, 20)  # the first run goes on (and reshuffles its clusters again) before the resume
    resumed = _sampler(block)
    resumed.load_state_dict(state)
    assert _take(resumed, 40 - stop) == whole[stop:]
    assert resumed.consumed_samples == 40 * 2


def test_deepspeed_checkpoint_rng_state_is_refused(tmp_path):
    sampler = _sampler(_block(tmp_path, {"len": _metric(None, "value", DISCRETE)}))
    state = {**sampler.state_dict(), "np_rng_state": ("MT19937", [0] * 624, 0, 0, 0.0)}
    with pytest.raises(ValueError, match="global NumPy RNG"):
        sampler.load_state_dict(state)


def test_sampler_needs_a_curriculum(tmp_path):
    block = load_config({"train_batch_size": 4}, world_size=1).data_efficiency
    with pytest.raises(ValueError, match="curriculum_learning enabled"):
        _sampler(block)
