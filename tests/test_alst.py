"""ALST (DeepSpeed's `runtime.sequence_parallel`): tiled compute, the sequence-parallel groups, the data
loader adapter and Ulysses attention in Hugging Face's calling convention.

- Tiled compute equals the untiled computation, forward and backward, alone and under the engine at every
  ZeRO stage on 2 ranks (small gradient buckets, so a bucket would be reduced after a parameter's first
  tile if the engine ignored `ds_grad_is_ready`), and saves only its input for backward.
- `UlyssesSPDataLoaderAdapter` shards as DeepSpeed's does (its own test's expected batches), also with
  different lengths on the two ranks.
- `UlyssesSPAttentionHF` at sp 2, trained through the engine with `parallel_state_sp` as its mpu and the
  adapter's batches, gives the loss and gradients of one process on whole sequences (GQA, and fewer key/value
  heads than ranks). With Transformers itself: tests/integrations/test_alst_hf.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from alst_common import (
    HEADS,
    SEQ,
    VOCAB,
    HFStyleLlama,
    TileModel,
    head_loss,
    sdpa_attention,
    shifted_loss_sum,
)

from common import base_config, full_params, max_diff
from harness import run_ranks

# -- tiled compute, one process -------------------------------------------------------------------------------


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_tile_model(model, tokens, labels, scale: float):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    (loss * scale).backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize("batch", [1, 3])
def test_tiled_compute_equals_untiled_forward_and_backward(batch):
    torch.manual_seed(0)
    # 13 positions: the tiles are uneven (4 MLP tiles of 4,4,4,1 positions; 3 loss tiles)
    tokens, labels = torch.randint(0, VOCAB, (batch, 13)), torch.randint(0, VOCAB, (batch, 13))
    torch.manual_seed(1)
    reference = TileModel().double()
    # backward with a scale other than 1 (as gradient accumulation gives): every gradient must carry it
    want_loss, want_grads = _run_tile_model(reference, tokens, labels, 0.25)
    for mlp_mode, tiled_loss in [("tiled", False), ("sequence", False), ("autograd", False), ("plain", True),
                                 ("tiled", True)]:  # fmt: skip
        model = TileModel(mlp_mode, tiled_loss).double()
        model.load_state_dict(reference.state_dict())
        loss, grads = _run_tile_model(model, tokens, labels, 0.25)
        # the loss tiles average their means: equal to the token mean only when the tiles are equal
        if not tiled_loss or (batch * 13) % 3 == 0:
            assert torch.allclose(loss, want_loss, atol=1e-12), (mlp_mode, tiled_loss)
        if not tiled_loss or (batch * 13) % 3 == 0:
            assert grads.keys() == want_grads.keys()
            assert max((grads[n] - want_grads[n]).abs().max().item() for n in grads) < 1e-12, (
                mlp_mode,
                tiled_loss,
            )


def test_tiled_fused_logits_loss_with_a_mask_and_sum_reduction():
    from shardspeed.sequence import TiledFusedLogitsLoss

    torch.manual_seed(0)
    head = torch.nn.Linear(8, VOCAB, bias=False).double()
    x = torch.randn(2, 12, 8, dtype=torch.double)
    y, mask = torch.randint(0, VOCAB, (2, 12)), (torch.rand(2, 12) > 0.3).double()

    def tile_loss_sum(module, xs, ys, ms):  # a sum per tile: tiles then add up to the whole sum
        logits = module(xs).float()
        return (torch.nn.functional.cross_entropy(logits, ys, reduction="none") * ms).sum()

    x_ref = x.clone().requires_grad_(True)
    ref = tile_loss_sum(head, x_ref.reshape(-1, 8), y.reshape(-1), mask.reshape(-1))
    (ref * 3).backward()
    want_head = head.weight.grad.clone()
    head.weight.grad = None
    x_tiled = x.clone().requires_grad_(True)
    loss = TiledFusedLogitsLoss.apply(tile_loss_sum, head, x_tiled, y, mask, 4, [head.weight], "sum")
    (loss * 3).backward()
    assert torch.allclose(loss, ref, atol=1e-10)
    assert torch.allclose(x_tiled.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(head.weight.grad, want_head, atol=1e-12)
    # the last tile tells the engine the parameter's gradient is complete
    assert head.weight.ds_grad_is_ready is True


class _Summed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum()


def test_tiled_mlp_saves_only_its_input():
    from sp_common import saved_activation_bytes

    torch.manual_seed(0)
    x = torch.randn(1, 256, 16, requires_grad=True)
    plain, tiled = TileModel("plain").mlp1, TileModel("tiled").mlp1
    tiled.load_state_dict(plain.state_dict())
    plain_bytes = saved_activation_bytes(_Summed(plain), x)  # the sum saves nothing (its gradient is ones)
    tiled_bytes = saved_activation_bytes(_Summed(tiled), x)
    # untiled: the input, up's output (3 x wider) and gelu's; tiled: only the input (1 x 256 x 16 floats)
    assert tiled_bytes == x.numel() * 4, tiled_bytes
    assert plain_bytes >= 7 * x.numel() * 4, plain_bytes


def test_tiled_compute_refuses_bad_arguments():
    from shardspeed.sequence import TiledFusedLogitsLoss, sequence_tiled_compute

    x, y = torch.randn(2, 6, 4), torch.randint(0, 3, (2, 6))
    with pytest.raises(ValueError, match="unknown reduction max"):
        TiledFusedLogitsLoss.apply(head_loss, None, x, y, None, 2, [], "max")
    with pytest.raises(ValueError, match="batch/seq dims must match"):
        TiledFusedLogitsLoss.apply(head_loss, None, x, y[:, :5], None, 2, [], "mean")
    with pytest.raises(ValueError, match="unknown value max"):
        sequence_tiled_compute(lambda x: x, 6, 2, {"x": x}, {}, "x", [], 1, "max")
    with pytest.raises(ValueError, match="'z' is not one of the sharded keys"):
        sequence_tiled_compute(lambda x: x, 6, 2, {"x": x}, {}, "z", [], 1, None)


def test_sequence_groups_of_a_destroyed_world_count_as_released(monkeypatch):
    from shardspeed.sequence import parallel_state

    # a grid left from a process group that no longer exists (here: none is initialized)
    monkeypatch.setitem(parallel_state._STATE, "grid", object())
    monkeypatch.setitem(parallel_state._STATE, "world", object())
    with pytest.raises(RuntimeError, match="sequence parallel group is not initialized"):
        parallel_state.get_sequence_parallel_group()
    assert parallel_state._STATE["grid"] is None


# -- tiled compute under the engine, 2 ranks ------------------------------------------------------------------


def _tiled_engine_job(stages: list[int]) -> dict:
    import shardspeed

    torch.manual_seed(5)
    # [steps, gas x ranks micro-batches, micro-batch size, (tokens, labels), positions]
    data = torch.randint(0, VOCAB, (2, 4, 2, 2, 12))
    results = {}
    for stage in stages:
        for variant in [("plain", False), ("tiled", True), ("sequence", False)]:
            torch.manual_seed(0)
            model = TileModel(*variant, loss_shards=4)
            config = base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 200})
            engine, *_ = shardspeed.initialize(model=model, config=copy.deepcopy(config))
            rank = torch.distributed.get_rank()
            for step in range(2 if stage == 0 else 1):
                for micro in range(2):
                    tokens, labels = data[step, micro * 2 + rank].unbind(1)
                    engine.backward(engine(tokens, labels))
                    engine.step()
            results[(stage, variant)] = full_params(engine)
            engine.destroy()
    return results


def test_tiled_compute_under_the_engine_at_every_zero_stage():
    results = run_ranks(_tiled_engine_job, 2, [0, 1, 2, 3], timeout=300)[0]
    for (stage, variant), params in results.items():
        reference = results[(stage, ("plain", False))]
        assert max_diff(params, reference) < 1e-6, (stage, variant, max_diff(params, reference))
    before = TileModel().state_dict()  # it trained: parameters moved
    assert (
        max_diff(results[(0, ("plain", False))], {k: before[k] for k in results[(0, ("plain", False))]})
        > 1e-4
    )


# -- sequence-parallel groups, the data loader adapter and Ulysses attention, 2 ranks -------------------------


def _collate(batch):
    input_ids, position_ids = batch[0]
    return {"input_ids": input_ids.unsqueeze(0), "position_ids": position_ids.unsqueeze(0),
            "labels": input_ids.unsqueeze(0), "tag": "sample"}  # fmt: skip


def _groups_and_adapter(out: dict) -> None:
    import torch.distributed as dist

    from shardspeed.sequence import UlyssesSPDataLoaderAdapter
    from shardspeed.sequence import parallel_state as mpu

    with pytest.raises(ValueError, match="must be greater than 1"):
        mpu.initialize_sequence_parallel(1)
    mpu.initialize_sequence_parallel(2)
    out["groups"] = (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
                     mpu.get_sequence_data_parallel_world_size(), mpu.get_data_parallel_world_size(),
                     mpu.get_model_parallel_world_size())  # fmt: skip
    with pytest.raises(RuntimeError, match="already initialized"):
        mpu.initialize_sequence_parallel(2)
    rank = dist.get_rank()
    # DeepSpeed's own test data: each rank draws the same two samples
    input_ids = torch.tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    positions = torch.arange(6).expand(2, 6)
    dataset = torch.utils.data.TensorDataset(input_ids, positions)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=_collate)
    adapter = UlyssesSPDataLoaderAdapter(
        loader, rank, mpu.get_sequence_parallel_group(), 2, torch.device("cpu")
    )
    out["len"] = len(adapter)
    out["batches"] = list(adapter)  # 2 samples per rank, 2 ranks: 4 sliced micro-batches
    out["second_epoch"] = len(list(adapter))
    # different lengths on the two ranks: rank 0 draws 8 tokens, rank 1 draws 4
    mine = torch.arange(8 if rank == 0 else 4).unsqueeze(0)
    uneven = [{"input_ids": mine + 50, "position_ids": mine, "labels": mine + 50}]
    out["uneven"] = list(
        UlyssesSPDataLoaderAdapter(uneven, rank, mpu.get_sequence_parallel_group(), 2, "cpu")
    )
    no_positions = [{"input_ids": mine, "labels": mine}]
    with pytest.raises(ValueError, match=r"requires \['position_ids'\]"):
        next(UlyssesSPDataLoaderAdapter(no_positions, rank, mpu.get_sequence_parallel_group(), 2, "cpu"))


def _ulysses_loss(engine, batch, group):
    """The Trainer's loss under ALST: every rank's token-loss sum and count, gathered differentiably."""
    import torch.distributed.nn.functional as dist_nn

    logits = engine(batch["input_ids"], batch["position_ids"])
    loss_sum, tokens = shifted_loss_sum(logits, batch["shift_labels"])
    sums, counts = dist_nn.all_gather(loss_sum, group=group), dist_nn.all_gather(tokens.float(), group=group)
    return torch.stack(sums).sum() / torch.stack(counts).sum()


def _reference(kv_heads: int, sample: torch.Tensor) -> tuple[float, dict]:
    """One process, whole sequence, plain attention: the loss and gradients the sp 2 run must give."""
    import alst_common

    alst_common.ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention
    torch.manual_seed(0)
    model = HFStyleLlama(kv_heads)
    labels = torch.nn.functional.pad(sample, (0, 1), value=-100)[:, 1:]
    loss_sum, tokens = shifted_loss_sum(model(sample, torch.arange(SEQ).unsqueeze(0)), labels)
    (loss_sum / tokens).backward()
    return (loss_sum / tokens).item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ulysses_engine(stage: int, kv_heads: int, mpu):
    import alst_common

    import shardspeed
    from shardspeed.sequence import UlyssesSPAttentionHF

    ulysses = UlyssesSPAttentionHF(sdpa_attention, batch_size=1, attn_head_count=HEADS, attn_head_size=8,
                                   kv_head_count=kv_heads, num_hidden_layers=2,
                                   process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=True)  # fmt: skip
    alst_common.ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, **kw: ulysses(
        module, q, k, v, None, **kw
    )
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}  # fmt: skip
    if stage == 3:  # DeepSpeed's ALST tutorial also sets the key beside the mpu: it must agree with it
        config["sequence_parallel_size"] = 2
    engine, *_ = shardspeed.initialize(model=HFStyleLlama(kv_heads), config=config, mpu=mpu)
    return engine


def _ulysses_job(cases: list[tuple[int, int]]) -> dict:
    import torch.distributed as dist

    from shardspeed.sequence import UlyssesSPDataLoaderAdapter
    from shardspeed.sequence import parallel_state as mpu
    from shardspeed.utils import safe_get_full_grad

    dist.init_process_group("gloo")
    out: dict = {}
    _groups_and_adapter(out)
    group, rank = mpu.get_sequence_parallel_group(), dist.get_rank()
    samples = torch.randint(0, VOCAB, (2, 1, SEQ), generator=torch.Generator().manual_seed(3))
    loader = [
        {"input_ids": samples[rank], "position_ids": torch.arange(SEQ).unsqueeze(0), "labels": samples[rank]}
    ]
    for stage, kv_heads in cases:
        references = [_reference(kv_heads, samples[k]) for k in range(2)]  # before Ulysses is installed
        engine = _ulysses_engine(stage, kv_heads, mpu)
        out["engine_groups"] = (engine.world_size, engine.sequence.degree)
        # lr 0: both micro-batches of the round are computed at the initial parameters, as the
        # references are
        for k, batch in enumerate(UlyssesSPDataLoaderAdapter(loader, rank, group, 2, "cpu")):
            loss = _ulysses_loss(engine, batch, group)
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            engine.step()
            want_loss, want_grads = references[k]
            out[(stage, kv_heads, k)] = (loss.item(), want_loss, max_diff(grads, want_grads))
        engine.destroy()
    return out


def test_ulysses_attention_data_adapter_and_groups_on_two_ranks():
    cases = [(0, 2), (2, 1), (3, 2)]  # (ZeRO stage, key/value heads: GQA 4:2, and 1 < sp replicated)
    ranks = run_ranks(_ulysses_job, 2, cases, timeout=300)
    for rank, out in enumerate(ranks):
        assert out["groups"] == (2, rank, 2, 1, 2)
        assert out["engine_groups"] == (2, 2)  # gradients averaged over both ranks; sequence degree 2
        assert out["len"] == 4 and out["second_epoch"] == 4
        for stage, kv_heads in cases:
            for k in range(2):
                loss, want_loss, grad_diff = out[(stage, kv_heads, k)]
                assert abs(loss - want_loss) < 1e-5, (stage, kv_heads, k, loss, want_loss)
                assert grad_diff < 1e-5, (stage, kv_heads, k, grad_diff)
    # DeepSpeed's test: sample 0 split in halves, labels shifted before the split
    first = [ranks[r]["batches"][0] for r in range(2)]
    assert first[0]["input_ids"].tolist() == [[1, 10, 10]] and first[1]["input_ids"].tolist() == [[10, 2, 2]]
    assert first[0]["position_ids"].tolist() == [[0, 1, 2]] and first[1]["position_ids"].tolist() == [
        [3, 4, 5]
    ]
    assert first[0]["shift_labels"].tolist() == [[10, 10, 10]]
    assert first[1]["shift_labels"].tolist() == [[2, 2, -100]]
    assert "labels" not in first[0] and first[0]["tag"] == "sample"
    # the second micro-batch of the round is rank 1's draw (the same sample 0 here), then sample 1 follows
    assert ranks[0]["batches"][2]["input_ids"].tolist() == [[1, 20, 20]]
    # uneven lengths: rank 0's 8 tokens, then rank 1's 4, each halved
    assert [b["position_ids"].tolist() for b in ranks[1]["uneven"]] == [[[4, 5, 6, 7]], [[2, 3]]]
    assert ranks[0]["uneven"][0]["shift_labels"].tolist() == [[51, 52, 53, 54]]
