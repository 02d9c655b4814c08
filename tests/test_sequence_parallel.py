"""Ulysses sequence parallelism: parity with one process, activation memory, resume, and bad inputs.

One spawned job per world size; each runs several engines (ZeRO stages, both tensor layouts) in turn.
"""

from __future__ import annotations

import copy

import pytest
import torch

from common import base_config, full_params, max_diff
from harness import run_ranks
from sp_common import (
    DIM,
    LAYERS,
    SEQ,
    UlyssesGPT,
    full_micro_batch,
    reference_run,
    saved_activation_bytes,
    token_data,
)

STEPS = 3


def _engine(stage: int, sp: int, batch_dim_idx: int = 0, mesh_param=None):
    """An engine at sequence degree `sp`, from the config key, or from DeepSpeed's `mesh_param` if given."""
    import shardspeed

    torch.manual_seed(0)
    model = UlyssesGPT()
    config = base_config(zero_optimization={"stage": stage})
    if mesh_param is None:
        config["sequence_parallel_size"] = sp
    engine, *_ = shardspeed.initialize(model=model, config=copy.deepcopy(config), mesh_param=mesh_param)
    model.use_sequence_group(engine.get_sequence_parallel_group(), batch_dim_idx)
    return engine


def _train(engine, steps: range, total_steps: int) -> None:
    from shardspeed.sequence import shard_sequence
    from shardspeed.utils import groups

    dp, dp_rank = groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = token_data(total_steps, micro * gas * dp)
    for step in steps:
        for m in range(gas):
            batch = full_micro_batch(data, step, m, dp_rank, dp, micro)
            loss = engine(*shard_sequence(batch, engine.get_sequence_parallel_group()))
            engine.backward(loss)
            engine.step()


def _parity_job(stages: list[int], sp: int, mesh_param=None) -> dict:
    """Train one engine per ZeRO stage (layouts alternating); return each one's full parameters. With
    `mesh_param`, the last stage's engine gets its groups from it instead of the config key."""
    results = {}
    for stage in stages:
        mesh = mesh_param if stage == stages[-1] else None
        engine = _engine(stage, sp, batch_dim_idx=stage % 2, mesh_param=mesh)
        _train(engine, range(STEPS), STEPS)
        results[stage] = full_params(engine)
        engine.destroy()
    return results


def _two_rank_job(checkpoint_dir: str) -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.sequence import DistributedAttention, sequence_parallel_mean, shard_sequence
    from shardspeed.sequence.layer import _HEAD_DIM
    from shardspeed.utils import groups

    out = {"params": _parity_job([0, 1, 2, 3], sp=2)}
    group = groups._get_sequence_parallel_group()

    # resume: 2 steps, save, 2 more; a fresh engine loading the checkpoint must make the same 2 steps
    engine = _engine(2, 2)
    _train(engine, range(2), 4)
    engine.save_checkpoint(checkpoint_dir, tag="two")
    _train(engine, range(2, 4), 4)
    continued = full_params(engine)
    resumed = _engine(2, 2)
    resumed.load_checkpoint(checkpoint_dir, tag="two")
    _train(resumed, range(2, 4), 4)
    out["resume"] = (continued, full_params(resumed), resumed.global_steps)

    # activation bytes saved for backward: the whole sequence in one process vs this rank's slice at sp 2
    torch.manual_seed(0)
    whole, sharded = UlyssesGPT(), UlyssesGPT()
    sharded.load_state_dict(whole.state_dict())
    sharded.use_sequence_group(group)
    batch = full_micro_batch(token_data(1, 2), 0, 0, 0, 1, 2)
    out["activation_bytes"] = (saved_activation_bytes(whole, *batch),
                               saved_activation_bytes(sharded, *shard_sequence(batch, group)))  # fmt: skip

    # masked tokens: sequence_parallel_mean's gradients, averaged over the group as the engine does, are those
    # of one process's mean over the unmasked tokens of the whole sequence
    ids, pos, labels = batch
    labels = labels.clone()
    labels[:, : SEQ // 2 + 5] = -100  # rank 0's slice loses every token, rank 1's only some
    whole(ids, pos, labels).backward()
    mine = shard_sequence((ids, pos, labels), group)
    loss = sequence_parallel_mean(sharded(*mine, reduction="sum"), (mine[2] != -100).sum(), group)
    loss.backward()
    grads = []
    for p, ref in zip(sharded.parameters(), whole.parameters()):
        dist.all_reduce(p.grad, group=group)
        grads.append((p.grad / 2 - ref.grad).abs().max().item())
    out["masked"] = (max(grads), loss.item(), whole(ids, pos, labels).item())

    # bad inputs, each must name the numbers
    errors = {}
    q = torch.zeros(8, 2, 3, 4)  # [s, b, h=3, d]: 3 heads over 2 ranks
    with pytest.raises(ValueError) as heads:
        DistributedAttention(torch.nn.Identity(), group)(q, q, q, 1)
    errors["heads"] = str(heads.value)
    with pytest.raises(ValueError) as seq:
        shard_sequence((torch.zeros(2, SEQ - 1, dtype=torch.long),), group)
    errors["sequence"] = str(seq.value)
    with pytest.raises(shardspeed.ConfigError) as world:
        _engine(0, 3)
    errors["world"] = str(world.value)
    out["errors"] = errors
    out["head_dim"] = _HEAD_DIM
    dist.barrier()
    return out


def test_sp2_on_two_ranks_matches_one_process(tmp_path):
    """sp 2: ZeRO 0-3 (both layouts) equal the one-process run; resume is bit-exact; memory; errors."""
    results = run_ranks(_two_rank_job, 2, str(tmp_path / "ckpt"))
    reference = reference_run(STEPS, dp=1)
    for rank, result in enumerate(results):
        for stage, params in result["params"].items():
            assert max_diff(params, reference) <= 1e-5, f"rank {rank} stage {stage}"
        continued, resumed, global_steps = result["resume"]
        assert global_steps == 4
        assert max_diff(continued, resumed) == 0.0, f"rank {rank}: resume is not bit-exact"
        whole, sharded = result["activation_bytes"]
        assert sharded <= 0.6 * whole, f"rank {rank}: sp 2 saves {sharded} bytes vs {whole} for one process"
        grad_error, sp_loss, whole_loss = result["masked"]
        assert grad_error <= 1e-6 and abs(sp_loss - whole_loss) <= 1e-6, f"rank {rank}: masked mean"
    errors = results[0]["errors"]
    assert "query heads (3)" in errors["heads"] and "sequence-parallel size (2)" in errors["heads"]
    assert "sequence length" in errors["sequence"] and f"({SEQ - 1})" in errors["sequence"]
    assert "sequence_parallel_size: 3" in errors["world"] and "world size (2)" in errors["world"]
    # the model really was trained (parity is not trivially met by untouched weights)
    torch.manual_seed(0)
    initial = {n: p.detach() for n, p in UlyssesGPT().named_parameters()}
    assert max_diff(reference, initial) > 1e-3


def _four_rank_job() -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.runtime.data import ShardedDataLoader
    from shardspeed.utils import groups

    out = {"params": _parity_job([0, 2, 3], sp=2, mesh_param=(2, 2))}
    seq_group = groups._get_sequence_parallel_group()
    out["layout"] = {
        "sequence_ranks": dist.get_process_group_ranks(seq_group),
        "data_ranks": dist.get_process_group_ranks(groups._get_data_parallel_group()),
        "sequence_data_size": groups._get_sequence_data_parallel_world_size(),
        "sequence_rank": groups._get_sequence_parallel_rank(),
    }

    # the engine's data loader: the data axis splits samples, the sequence group splits each sequence
    micro, dp_rank = 2, groups._get_data_parallel_rank()
    tokens = token_data(1, 16)[0]
    dataset = [(t[:-1], torch.arange(SEQ), t[1:]) for t in tokens]
    torch.manual_seed(0)
    model = UlyssesGPT()
    config = base_config(sequence_parallel_size=2, comms_logger={"enabled": True})
    engine, _, loader, _ = shardspeed.initialize(model=model, training_data=dataset, config=config)
    model.use_sequence_group(engine.get_sequence_parallel_group())
    mine = next(iter(loader))
    # the comms logger sees Ulysses' exchanges: 4 per block forward (q, k, v, output) and 4 backward
    from shardspeed.comm import logger

    logger.active().reset()
    engine.backward(engine(*mine))
    out["all_to_all_bytes"] = logger.active().bytes_by_op().get("all_to_all_single")
    pieces = [torch.empty_like(mine[0]) for _ in range(2)]
    dist.all_gather(pieces, mine[0].contiguous(), group=seq_group)
    expected = next(iter(ShardedDataLoader(dataset, batch_size=micro, num_replicas=2, rank=dp_rank)))
    out["loader"] = (torch.cat(pieces, dim=1), expected[0], tuple(mine[1].shape))
    return out


def test_sp2_dp2_on_four_ranks_matches_one_process():
    """sp 2 x dp 2: groups laid out as DeepSpeed's, ZeRO 0/2/3 parity, and the loader's slicing."""
    results = run_ranks(_four_rank_job, 4)
    reference = reference_run(STEPS, dp=2)
    for rank, result in enumerate(results):
        for stage, params in result["params"].items():
            assert max_diff(params, reference) <= 1e-5, f"rank {rank} stage {stage}"
        layout = result["layout"]
        assert layout["sequence_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]  # consecutive ranks
        assert layout["data_ranks"] == [rank % 2, rank % 2 + 2]
        assert layout["sequence_data_size"] == 4 and layout["sequence_rank"] == rank % 2
        gathered, expected, local_shape = result["loader"]
        assert torch.equal(gathered, expected), f"rank {rank}: sequence slices do not rebuild the batch"
        assert local_shape == (2, SEQ // 2)
        assert result["all_to_all_bytes"] == LAYERS * 8 * 2 * (SEQ // 2) * DIM * 4, f"rank {rank}"
    # the two data-parallel replicas drew different samples
    assert not torch.equal(results[0]["loader"][1], results[2]["loader"][1])
