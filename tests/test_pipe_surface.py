"""What Megatron-DeepSpeed's training loop calls on the pipeline engine after each `train_batch`:
`get_additional_losses()`, `get_global_grad_norm()`, `was_step_applied()`, `tput_timer`, and
`reset_activation_shape()` before a batch of another sequence length."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from pipe_common import BASE_SEED, global_batches, layer_specs, loss_fn, replica_iterator

from harness import run_ranks

MICRO, GAS = 2, 2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "steps_per_print": 1000,
}


def _module_with_losses(stages: int):
    """Megatron's GPTModelPipe pattern: the loss function records its parts, `get_additional_losses()` names
    them on every stage (values only where the loss was computed)."""
    from shardspeed.pipe import PipelineModule

    class WithLosses(PipelineModule):
        def __init__(self):
            super().__init__(layer_specs(), num_stages=stages, loss_fn=self.loss_parts, seed_layers=True,
                             base_seed=BASE_SEED)  # fmt: skip
            self.last_lm = self.last_aux = None
            self.seen: list[tuple[float, float]] = []

        def loss_parts(self, logits, labels):
            lm = loss_fn(logits, labels)
            aux = 0.01 * logits.float().pow(2).mean()
            self.last_lm, self.last_aux = lm.detach(), aux.detach()
            self.seen.append((lm.item(), aux.item()))
            return lm + 0.5 * aux

        def get_additional_losses(self):
            return OrderedDict({"lm loss": self.last_lm, "aux loss": self.last_aux})

    return WithLosses()


def _megatron_steps(engine, inputs, labels, dp_rank: int, dp: int) -> dict:
    data = replica_iterator(inputs, labels, range(3), dp_rank, dp, MICRO, GAS)
    steps = []
    for _ in range(3):  # megatron/training.py train_step with ds_pipeline_enabled
        loss = engine.train_batch(data_iter=data)
        additional = engine.get_additional_losses()
        steps.append({
            "loss": loss.item(),
            "names": list(additional) if additional is not None else None,
            "values": [v.item() for v in additional.values()] if additional is not None else None,
            "grad_norm": engine.get_global_grad_norm(),
            "applied": engine.was_step_applied(),
        })  # fmt: skip
    return {"steps": steps, "timer": (engine.tput_timer.global_step_count, engine.global_steps)}


def _surface_jobs() -> dict:
    import torch.distributed as dist

    import shardspeed
    from shardspeed.pipe import PipelineModule

    shardspeed.init_distributed()
    rank = dist.get_rank()
    inputs, labels = global_batches(4, MICRO * GAS * 2)
    out = {}

    # two stages, one replica: values computed on stage 1, named and received on stage 0
    module = _module_with_losses(stages=2)
    engine, *_ = shardspeed.initialize(model=module, config=CONFIG)
    out["two stages"] = _megatron_steps(engine, inputs[:, : MICRO * GAS], labels[:, : MICRO * GAS], 0, 1)
    out["two stages"]["seen"] = module.seen
    # a shorter sequence after reset_activation_shape(), as Megatron's curriculum does
    engine.reset_activation_shape()
    short = replica_iterator(inputs[..., :3], labels[..., :3], range(1), 0, 1, MICRO, GAS)
    out["two stages"]["short"] = engine.train_batch(data_iter=short).item()

    # one stage, two replicas: the values are averaged over the data-parallel ranks
    module = _module_with_losses(stages=1)
    engine, *_ = shardspeed.initialize(model=module, config=CONFIG)
    out["two replicas"] = _megatron_steps(engine, inputs, labels, rank, 2)
    out["two replicas"]["seen"] = module.seen

    # a module without additional losses: None, so Megatron logs 'lm loss'
    plain = PipelineModule(layer_specs(), num_stages=2, loss_fn=loss_fn)
    engine, *_ = shardspeed.initialize(model=plain, config=CONFIG)
    out["plain"] = _megatron_steps(engine, inputs[:, : MICRO * GAS], labels[:, : MICRO * GAS], 0, 1)
    return out


@pytest.fixture(scope="module")
def surface():
    return run_ranks(_surface_jobs, 2)


def _means(seen: list[tuple[float, float]], step: int) -> list[float]:
    batch = seen[step * GAS : (step + 1) * GAS]
    return [sum(part[i] for part in batch) / GAS for i in range(2)]


def test_additional_losses_reach_every_stage_as_means_over_micro_batches(surface):
    seen = surface[1]["two stages"]["seen"]  # the last stage computed the losses
    assert surface[0]["two stages"]["seen"] == []
    for stage in (0, 1):
        steps = surface[stage]["two stages"]["steps"]
        for step, record in enumerate(steps):
            assert record["names"] == ["lm loss", "aux loss"]
            assert record["values"] == pytest.approx(_means(seen, step), rel=1e-6)
            lm, aux = record["values"]
            assert record["loss"] == pytest.approx(lm + 0.5 * aux, rel=1e-6)
            assert record["applied"] and record["grad_norm"] > 0
        assert steps == surface[1]["two stages"]["steps"]  # the same numbers on both stages


def test_additional_losses_are_averaged_over_replicas(surface):
    for step in range(3):
        per_rank = [_means(surface[r]["two replicas"]["seen"], step) for r in (0, 1)]
        expected = [(a + b) / 2 for a, b in zip(*per_rank)]
        assert per_rank[0] != per_rank[1]  # the replicas saw different samples
        for rank in (0, 1):
            assert surface[rank]["two replicas"]["steps"][step]["values"] == pytest.approx(expected, rel=1e-6)


def test_without_additional_losses_the_engine_answers_none(surface):
    for rank in (0, 1):
        assert all(step["names"] is None for step in surface[rank]["plain"]["steps"])


def test_throughput_timer_counts_each_train_batch_as_a_global_step(surface):
    for rank in (0, 1):
        for case in ("two stages", "two replicas", "plain"):
            assert surface[rank][case]["timer"] == (3, 3)


def test_a_batch_of_another_sequence_length_after_reset_activation_shape(surface):
    assert surface[0]["two stages"]["short"] == surface[1]["two stages"]["short"] > 0
