"""The order in which the engines read `training_data`, against DeepSpeed 0.19's rule, on 2 ranks.

DeepSpeed's rule: a `DistributedSampler` over the data-parallel ranks with seed 0 — shuffled for the
ordinary engine (`deepspeed_io`), in order for the pipeline engine (`_build_data_iter` passes
`shuffle=False`) — that pads the last round with the first samples and never drops any; the loader's
`dataloader_drop_last` drops the last incomplete batch; the pipeline engine's loader repeats. The rule is
written out below from that description, not by calling the sampler.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_ranks

MICRO, GAS = 2, 2


def deepspeed_order(samples: int, replicas: int, rank: int, shuffle: bool, epoch: int = 0) -> list[int]:
    if shuffle:
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(0 + epoch)).tolist()
    else:
        order = list(range(samples))
    total = math.ceil(samples / replicas) * replicas
    order += order[: total - samples]
    return order[rank::replicas]


def batches_of(order: list[int], drop_last: bool = False) -> list[list[int]]:
    out = [order[i : i + MICRO] for i in range(0, len(order), MICRO)]
    return [b for b in out if len(b) == MICRO] if drop_last else out


class IndexData(torch.utils.data.Dataset):
    """Sample i is (i, i): the index travels as the input and as the label."""

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i)])


def _pipeline_reads(stages: int, samples: int, batches: int) -> list[list[int]]:
    """Train `batches` batches from `training_data`; the indices of each micro-batch this rank read."""
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(torch.nn.Linear, 1, 1), LayerSpec(torch.nn.Linear, 1, 1)]
    model = PipelineModule(specs, num_stages=stages, loss_fn=torch.nn.functional.mse_loss)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "steps_per_print": 1000}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=config, training_data=IndexData(samples))
    read: list[list[int]] = []

    def record(batch):
        inputs, labels = batch
        # the first stage uses the inputs, the last the labels: both are the sample's index
        read.append([int(v) for v in (inputs if engine.is_first_stage() else labels).view(-1)])
        return batch

    engine.set_batch_fn(record)
    for _ in range(batches):
        engine.train_batch()
    return read


def _engine_reads(samples: int, drop_last: bool) -> list[list[list[int]]]:
    """The ordinary engine's `training_data` loader, two epochs: the indices of each batch."""
    import shardspeed

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "dataloader_drop_last": drop_last}  # fmt: skip
    _, _, loader, _ = shardspeed.initialize(
        model=torch.nn.Linear(1, 1), config=config, training_data=IndexData(samples)
    )
    return [[[int(v) for v in x.view(-1)] for x, _ in loader] for _ in range(2)]


def _orders() -> dict:
    import torch.distributed as dist

    import shardspeed

    shardspeed.init_distributed()
    return {
        "two stages": _pipeline_reads(stages=2, samples=10, batches=3),
        "two replicas": _pipeline_reads(stages=1, samples=11, batches=3),
        "engine": _engine_reads(samples=11, drop_last=False),
        "engine drop_last": _engine_reads(samples=11, drop_last=True),
        "rank": dist.get_rank(),
    }


@pytest.fixture(scope="module")
def orders():
    return run_ranks(_orders, 2)


def test_pipeline_stages_read_the_samples_in_order(orders):
    # one replica: both stages read 0, 1, 2, ... and the loader starts over after the last sample
    expected = batches_of(deepspeed_order(10, 1, 0, shuffle=False))
    expected = (expected * 2)[: 3 * GAS]
    assert expected[0] == [0, 1] and expected[-1] == [0, 1]
    for out in orders:
        assert out["two stages"] == expected


def test_pipeline_replicas_read_their_share_in_order(orders):
    for out in orders:
        rank = out["rank"]
        expected = (batches_of(deepspeed_order(11, 2, rank, shuffle=False)) * 2)[: 3 * GAS]
        assert out["two replicas"] == expected
    assert orders[1]["two replicas"][2] == [9, 0]  # 11 samples over 2 ranks: the last round is padded


def test_engine_reads_deepspeeds_permutation_in_the_first_epoch(orders):
    for out in orders:
        rank = out["rank"]
        first, second = out["engine"]
        assert first == batches_of(deepspeed_order(11, 2, rank, shuffle=True))
        # DeepSpeed repeats the first permutation every epoch; here epoch e is seed 0 + e (compatibility.md)
        assert second == batches_of(deepspeed_order(11, 2, rank, shuffle=True, epoch=1))
        # dataloader_drop_last drops the incomplete batch; the sampler still pads (every rank 6 samples)
        first, _ = out["engine drop_last"]
        assert first == batches_of(deepspeed_order(11, 2, rank, shuffle=True), drop_last=True)
        assert len(first) == 3
