"""Activation checkpointing (`shardspeed.checkpointing`): gradients bit-identical to the plain run, dropout
recomputed identically, odd arguments and results, nested blocks, half precision, and every option
(`cpu_checkpointing`, `contiguous_memory_optimization`, `partition_activations` over a real 2-rank group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed import checkpointing
from shardspeed.checkpointing import state

from harness import run_ranks


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        return x + self.net(x)


def make_blocks(dim=16, n=4, dropout=0.3, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.ModuleList(Block(dim, dropout) for _ in range(n)).to(dtype)


def grads_of(blocks, x, wrap, seed=123):
    """Loss gradient w.r.t. every parameter and the input, running each block through `wrap`."""
    for p in blocks.parameters():
        p.grad = None
    torch.manual_seed(seed)
    h = x
    for block in blocks:
        h = wrap(block, h)
    h.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    return grads + ([x.grad.clone()] if x.grad is not None else [])


def plain(block, h):
    return block(h)


@pytest.fixture(autouse=True)
def fresh_settings():
    yield
    state.configure(None)  # back to "not configured" for the next test
    checkpointing.reset()


@pytest.mark.parametrize("api", ["checkpoint", "non_reentrant_checkpoint"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_bit_identical_with_dropout(api, dtype):
    blocks = make_blocks(dtype=dtype)
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    reference = grads_of(blocks, x, plain)
    x.grad = None
    fn = getattr(checkpointing, api)
    got = grads_of(blocks, x, lambda b, h: fn(b, h))
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        assert g.dtype == dtype
        assert torch.equal(g, r)  # bit-identical, dropout masks included


def test_dropout_mask_recomputed_identically():
    masks = []

    def block(x):
        y = nn.functional.dropout(x, 0.5, training=True)
        masks.append((y == 0).clone())
        return y * 2

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(5)
    y = checkpointing.checkpoint(block, x)
    torch.rand(100)  # the global stream moves on between forward and backward
    y.sum().backward()
    assert len(masks) == 2  # forward + recompute
    assert torch.equal(masks[0], masks[1])
    assert masks[0].any() and not masks[0].all()
    assert torch.equal(x.grad, (~masks[0]).float() * 4)  # dropout scale 2 times the block's 2


def test_non_tensor_and_none_arguments_and_results():
    lin = nn.Linear(4, 4)

    def block(x, nothing, scale, label):
        assert nothing is None and label == "tag"
        return lin(x) * scale, None, scale + 1, label

    x = torch.randn(3, 4, requires_grad=True)
    out, none, number, label = checkpointing.checkpoint(block, x, None, 2.0, "tag")
    assert none is None and number == 3.0 and label == "tag"
    out.sum().backward()
    expected_x = lin.weight.sum(0).expand(3, 4) * 2.0
    assert torch.allclose(x.grad, expected_x)
    assert torch.allclose(lin.weight.grad, 2.0 * x.detach().sum(0).expand(4, 4))


@pytest.mark.parametrize("api", ["checkpoint", "non_reentrant_checkpoint"])
def test_keyword_arguments_reach_the_function_and_keyword_tensors_get_gradients(api):
    # DeepSpeed's checkpoint(fn, *args, **kwargs): a tensor passed by keyword takes part in autograd.
    lin = nn.Linear(4, 4)

    def block(x, *, bias, scale=1.0):
        return lin(x) * scale + bias

    x, bias = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    getattr(checkpointing, api)(block, x, bias=bias, scale=3.0).sum().backward()
    got = (x.grad.clone(), bias.grad.clone(), lin.weight.grad.clone())
    x.grad = bias.grad = lin.weight.grad = lin.bias.grad = None
    block(x, bias=bias, scale=3.0).sum().backward()
    assert all(torch.equal(g, r) for g, r in zip(got, (x.grad, bias.grad, lin.weight.grad)))
    assert torch.equal(bias.grad, torch.full((4,), 3.0))


def test_inputs_that_do_not_require_grad_still_train_parameters():
    blocks = make_blocks(dropout=0.0)
    x = torch.randn(8, 16)  # e.g. embeddings of a frozen layer
    reference = grads_of(blocks, x, plain)
    for api in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint):
        got = grads_of(blocks, x, lambda b, h, api=api: api(b, h))
        assert all(torch.equal(g, r) for g, r in zip(got, reference))


def test_integer_results_are_not_differentiable_and_single_tensor_stays_a_tensor():
    def block(x):
        return x * 2, torch.argmax(x, dim=-1)

    x = torch.randn(2, 5, requires_grad=True)
    y, idx = checkpointing.checkpoint(block, x)
    assert idx.dtype == torch.int64 and not idx.requires_grad
    single = checkpointing.checkpoint(lambda t: t * 3, x)
    assert torch.is_tensor(single)
    (y.sum() + single.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 5.0))


def test_nested_checkpoints():
    blocks = make_blocks(n=4)
    x = torch.randn(8, 16, requires_grad=True)
    reference = grads_of(blocks, x, plain)

    def pair(first, second):
        return lambda h: checkpointing.checkpoint(second, checkpointing.checkpoint(first, h))

    def nested(h):
        h = checkpointing.checkpoint(pair(blocks[0], blocks[1]), h)
        return checkpointing.non_reentrant_checkpoint(pair(blocks[2], blocks[3]), h)

    for p in blocks.parameters():
        p.grad = None
    x.grad = None
    torch.manual_seed(123)
    nested(x).pow(2).mean().backward()
    got = [p.grad for p in blocks.parameters()] + [x.grad]
    assert all(torch.equal(g, r) for g, r in zip(got, reference))


def test_model_parallel_rng_tracker_forked_and_restored():
    checkpointing.model_parallel_cuda_manual_seed(42)
    tracker = checkpointing.get_cuda_rng_tracker()

    def block(x):
        with tracker.fork():
            return nn.functional.dropout(x, 0.5, training=True)

    x = torch.randn(256, requires_grad=True)
    before = tracker.get_states()
    y = checkpointing.checkpoint(block, x)
    mask = y.detach() != 0
    with tracker.fork():
        torch.rand(10)  # the tracked stream advances before backward
    y.sum().backward()
    assert torch.equal(x.grad != 0, mask)  # recompute drew the forward's mask from the tracked stream
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], before["model-parallel-rng"])
    with pytest.raises(ValueError, match="already used"):
        tracker.add("other", 42 + 2718)
    with (
        pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"),
        checkpointing.CudaRNGStatesTracker().fork(),
    ):
        pass


def test_configure_from_config_block_and_explicit_overrides(tmp_path):
    assert not checkpointing.is_configured()
    block = {"activation_checkpointing": {"cpu_checkpointing": True, "contiguous_memory_optimization": True,
                                          "number_checkpoints": 3, "profile": True}}  # fmt: skip
    checkpointing.configure(None, deepspeed_config=block, checkpoint_in_cpu=False)
    assert checkpointing.is_configured()
    s = state.current()
    assert (s.cpu_checkpointing, s.contiguous_memory_optimization, s.number_checkpoints, s.profile) == (
        False, True, 3, True,
    )  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text('{"activation_checkpointing": {"synchronize_checkpoint_boundary": true}}')
    checkpointing.configure(None, deepspeed_config=str(path))
    assert state.current().synchronize_checkpoint_boundary
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    from shardspeed.config import ConfigError

    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpoint"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})


def test_contiguous_buffers_cpu_checkpointing_and_profile_keep_gradients_exact():
    blocks = make_blocks(n=3)
    x = torch.randn(8, 16, requires_grad=True)
    reference = grads_of(blocks, x, plain)
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=3, checkpoint_in_cpu=True,
                            synchronize=True, profile=True)  # fmt: skip
    for _ in range(2):  # the second step reuses the buffers of the first
        x.grad = None
        got = grads_of(blocks, x, lambda b, h: checkpointing.checkpoint(b, h))
        assert all(torch.equal(g, r) for g, r in zip(got, reference))
    timings = state.current().timings
    assert timings["forward"] > 0 and timings["recompute_and_backward"] > 0
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    h = x
    with pytest.raises(RuntimeError, match="number_checkpoints is 2"):
        for block in blocks:
            h = checkpointing.checkpoint(block, h)


def _partitioned(world):
    import torch.distributed as dist

    from shardspeed import checkpointing
    from shardspeed.comm import init_distributed

    init_distributed()

    class MPU:
        def get_model_parallel_group(self):
            return dist.group.WORLD

    blocks = make_blocks(dim=10, n=3)  # 10*8 elements: not a multiple of the world size, padding is exercised
    x = torch.randn(8, 10, requires_grad=True)
    reference = grads_of(blocks, x, plain)
    checkpointing.configure(MPU(), partition_activations=True)
    kept = []
    original = checkpointing.core.store

    def spy(tensor, **kw):
        stored = original(tensor, **kw)
        kept.append(stored.data.numel())
        return stored

    checkpointing.core.store = spy
    x.grad = None
    got = grads_of(blocks, x, lambda b, h: checkpointing.checkpoint(b, h))
    checkpointing.core.store = original
    checkpointing.model_parallel_cuda_manual_seed(7)
    state.configure(None)
    return (
        all(torch.equal(g, r) for g, r in zip(got, reference)),
        kept,
        checkpointing.get_cuda_rng_tracker().get_states()["model-parallel-rng"],
    )


class DropoutNet(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.wrap = wrap
        self.blocks = make_blocks(dim=8, n=3, dropout=0.2)

    def forward(self, x):
        for block in self.blocks:
            x = self.wrap(block, x) if self.wrap is not None else block(x)
        return x.pow(2).mean()


def _engine_losses() -> dict:
    """Three training steps of a dropout MLP under every ZeRO stage, plain and checkpointed per block."""
    import shardspeed

    losses = {}
    for name, wrap in [("plain", None), ("checkpoint", checkpointing.checkpoint),
                       ("non_reentrant", checkpointing.non_reentrant_checkpoint)]:  # fmt: skip
        for stage in (0, 2, 3):
            config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
            engine, *_ = shardspeed.initialize(model=DropoutNet(wrap), config=config)
            torch.manual_seed(1)
            run = []
            for _ in range(3):
                loss = engine(torch.randn(2, 8))
                engine.backward(loss)
                engine.step()
                run.append(loss.item())
            engine.destroy()
            losses[(name, stage)] = run
    return losses


def _two_rank_cases(world):
    return {"partition": _partitioned(world), "engine": _engine_losses()}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_two_rank_cases, 2, 2)


def test_checkpointed_training_equals_plain_under_every_zero_stage(two_rank_results):
    for rank in two_rank_results:
        losses = rank["engine"]
        reference = losses[("plain", 0)]
        assert len(set(reference)) == 3  # it trains
        for (name, stage), run in losses.items():
            # checkpointing changes nothing: bit-identical to plain training at the same stage, dropout included
            assert run == losses[("plain", stage)], (name, stage, losses)
            # across stages only up to rounding: stage 0 reduces and steps whole buckets, stages 2-3 shards, and
            # on some CPUs (seen on an AMD EPYC) their losses part in the last bits after the first step
            assert run == pytest.approx(reference, rel=1e-6, abs=0), (name, stage, losses)


def test_partition_activations_over_a_two_rank_group(two_rank_results):
    results = [r["partition"] for r in two_rank_results]
    for exact, kept, _ in results:
        assert exact
        assert kept == [40, 40, 40]  # half of each 8x10 input per rank
    # each tensor-parallel rank gets its own model-parallel stream (seed + 2718 + rank)
    assert not torch.equal(results[0][2], results[1][2])


def test_deepspeed_module_globals_read_and_write_the_settings():
    checkpointing.reset()
    state.configure(None)
    try:
        assert checkpointing.deepspeed_checkpointing_enabled is False and checkpointing.num_layers is None
        checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True, num_checkpoints=3)
        assert (checkpointing.PARTITION_ACTIVATIONS, checkpointing.CPU_CHECKPOINT) == (True, True)
        assert checkpointing.num_layers == 3 and checkpointing.deepspeed_checkpointing_enabled is True
        checkpointing.PARTITION_ACTIVATIONS = False  # DeepSpeed code assigns the globals: the option changes
        assert state.current().partition_activations is False
        checkpointing.deepspeed_checkpointing_enabled = False
        assert not checkpointing.is_configured()
        with pytest.raises(AssertionError, match="number of layers"):  # DeepSpeed asserts; also a ValueError
            checkpointing.configure(None, contiguous_checkpointing=True)
    finally:
        checkpointing.reset()
        state.configure(None)
