"""DeepSpeed's ZeRO tuning keys change how ZeRO communicates and what it keeps, never what it computes.

Every case trains the tiny GPT (tied weights, a frozen parameter, two parameter groups) and must match the
single-process reference; each also records what the key is meant to change — collectives issued, elements
in flight, units gathered per step, peak gathered elements — so that an ignored key fails the test.
One spawn per world size runs all cases.
"""

import pytest

from common import base_config, engine_run, max_diff, reference_run
from harness import run_ranks

STEPS = 4
OPTIONS = {"frozen": True, "groups": True}
STAGE3 = {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}

# Stages 1/2: all-reduce instead of reduce-scatter, no overlap, all-gathers of at most ~1000 elements in
# flight, no more than 500 elements per rank in any bucket of several parameters.
KNOBS_1_2 = {
    "reduce_bucket_size": 20000,
    "reduce_scatter": False,
    "overlap_comm": False,
    "allgather_bucket_size": 1000,
    "sub_group_size": 500,
}
CASES = {
    "s1 knobs": {"stage": 1, **KNOBS_1_2},
    "s2 knobs": {"stage": 2, **KNOBS_1_2},
    "s2 default": {"stage": 2, "reduce_bucket_size": 20000},
    # Stage 3: DeepSpeed's defaults keep every unit from its forward to its backward (one gather per step)...
    "s3 keep all": {**STAGE3, "stage3_prefetch_bucket_size": 10**9},
    # ... a reuse distance of 0 keeps only the last unit, so the others are gathered again in backward ...
    "s3 no reuse": {**STAGE3, "stage3_prefetch_bucket_size": 3000, "stage3_max_reuse_distance": 0},
    # ... and a live budget of 10000 elements bounds what prefetching and keeping may hold.
    "s3 live budget": {**STAGE3, "stage3_prefetch_bucket_size": 10**9, "stage3_max_live_parameters": 10000},
    "s3 no prefetch": {**STAGE3, "stage3_prefetch_bucket_size": 0, "overlap_comm": False},
    # Units up to 1100 elements are persistent, but only 2200 elements of them in total.
    "s3 persistence cap": {
        **STAGE3,
        "stage3_param_persistence_threshold": 1100,
        "stage3_model_persistence_threshold": 2200,
    },
}


def _instrument():
    """Count the collectives ZeRO issues, and the all-gather elements in flight at once (stage 1/2)."""
    import shardspeed.core.grad_buckets as grad_buckets
    import shardspeed.zero.optimizer as zero_optimizer
    import shardspeed.zero.param_units as param_units
    import shardspeed.zero.sharded_grads as sharded_grads

    stats = {"all_reduce": 0, "reduce_scatter": 0, "gathers": 0, "in_flight": 0, "max_in_flight": 0}
    all_reduce = grad_buckets.dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        if tensor.numel() > 1:  # not the one-number global norm
            stats["all_reduce"] += 1
        return all_reduce(tensor, *args, **kwargs)

    def counting_reduce_scatter(original):
        def reduce_scatter(*args, **kwargs):
            stats["reduce_scatter"] += 1
            return original(*args, **kwargs)

        return reduce_scatter

    class InFlight:
        def __init__(self, work, numel):
            self.work, self.numel = work, numel

        def wait(self):
            stats["in_flight"] -= self.numel
            return self.work.wait()

    step_all_gather = zero_optimizer.all_gather_flat

    def tracking_all_gather(output, input, *args, **kwargs):
        stats["in_flight"] += output.numel()
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        return InFlight(step_all_gather(output, input, *args, **kwargs), output.numel())

    unit_all_gather = param_units.all_gather_flat

    def counting_unit_gather(*args, **kwargs):
        stats["gathers"] += 1
        return unit_all_gather(*args, **kwargs)

    grad_buckets.dist.all_reduce = counting_all_reduce  # the same torch.distributed module everywhere
    grad_buckets.reduce_scatter_flat = counting_reduce_scatter(grad_buckets.reduce_scatter_flat)
    sharded_grads.reduce_scatter_flat = counting_reduce_scatter(sharded_grads.reduce_scatter_flat)
    zero_optimizer.all_gather_flat = tracking_all_gather
    param_units.all_gather_flat = counting_unit_gather
    return stats


def _track_peak_live(engine, peak: dict) -> None:
    """Record in `peak["live"]` the most gathered (non-persistent) stage 3 elements at any hook."""
    coordinator = engine.optimizer.coordinator
    peak["live"] = 0

    def record(*_):
        peak["live"] = max(peak["live"], coordinator.live.numel)

    for module in engine.module.modules():
        module.register_forward_hook(record)
    for param in engine.module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(record)


def _run_cases(world: int, dynamic: bool) -> dict:
    import torch.distributed as dist

    import shardspeed

    stats = _instrument()
    results = {}
    original_initialize = shardspeed.initialize
    for name, zero in CASES.items():
        for key in stats:
            stats[key] = 0
        peak = {}

        def initialize(*args, name=name, peak=peak, **kwargs):
            engine, *rest = original_initialize(*args, **kwargs)
            if engine.zero_optimization_stage() == 3:
                _track_peak_live(engine, peak)
            results[name + " engine"] = _layout(engine)
            return (engine, *rest)

        shardspeed.initialize = initialize
        try:
            out = engine_run(
                base_config(zero_optimization=zero), world, STEPS, 0, {**OPTIONS, "dynamic": dynamic}
            )
        finally:
            shardspeed.initialize = original_initialize
        results[name] = {**out, **stats, "peak_live": peak.get("live")}
        dist.barrier()
    return results


def _layout(engine) -> dict:
    opt = engine.optimizer
    layout = {
        "shard_numels": [b.shard_numel for b in opt.buckets],
        "shared_shard_numels": [b.shard_numel for b in opt.buckets if len(b.params) > 1],
    }
    if opt.coordinator is not None:
        units = opt.coordinator.units
        layout["unit_numels"] = sorted(u.padded_numel for u in units if not u.persistent)
        layout["persistent_numel"] = sum(u.numel for u in units if u.persistent)
        layout["non_persistent_units"] = sum(1 for u in units if not u.persistent)
    layout["reducer_in_flight"] = getattr(opt.grads, "max_in_flight", None)
    return layout


@pytest.mark.parametrize("world,dynamic", [(2, False), (2, True), (4, True)])
def test_zero_keys_keep_parity_and_take_effect(world, dynamic):
    ranks = run_ranks(_run_cases, world, world, dynamic, timeout=600)
    reference = reference_run(STEPS, world, options={**OPTIONS, "dynamic": dynamic})
    for name in CASES:
        for rank, results in enumerate(ranks):
            assert max_diff(results[name]["params"], reference) <= 1e-5, f"{name} rank {rank}"
    r = ranks[0]
    # reduce_scatter: false -> all-reduces only; the default reduce-scatters.
    for name in ("s1 knobs", "s2 knobs"):
        assert r[name]["reduce_scatter"] == 0 and r[name]["all_reduce"] > 0, name
    assert r["s2 default"]["reduce_scatter"] > 0 and r["s2 default"]["all_reduce"] == 0
    # allgather_bucket_size 1000: never more than one bucket beyond 1000 elements in flight (one bucket is
    # always allowed); sub_group_size 500: no rank steps more than 500 elements of a bucket shared by several
    # parameters (a larger parameter is never split: it gets a bucket of its own).
    for name in ("s1 knobs", "s2 knobs"):
        largest = max(r[name + " engine"]["shard_numels"]) * world
        assert 0 < r[name]["max_in_flight"] <= max(1000, largest), name
        assert max(r[name + " engine"]["shared_shard_numels"]) <= 500, name
    assert r["s2 default"]["max_in_flight"] > 1000  # every bucket at once: the key above did something
    assert max(r["s2 default engine"]["shared_shard_numels"]) > 500
    # overlap_comm: false -> stage 2/3 wait for each reduction before backward goes on.
    assert r["s2 knobs engine"]["reducer_in_flight"] == 0 and r["s2 default engine"]["reducer_in_flight"] > 0
    assert r["s3 no prefetch engine"]["reducer_in_flight"] == 0
    if not dynamic:
        # Reuse: with the defaults each unit is gathered once per step after the first; with distance 0
        # nearly all are gathered twice (forward and backward). One micro-batch per step is not the case
        # here (accumulation 2), so compare the two rather than count exactly.
        assert r["s3 keep all"]["gathers"] < r["s3 no reuse"]["gathers"]
    units = r["s3 keep all engine"]["unit_numels"]
    assert r["s3 keep all"]["peak_live"] > 10000 >= 2 * max(units)  # keeping everything exceeds the budget,
    assert r["s3 live budget"]["peak_live"] <= 10000 + max(units)  # which bounds it (but one forced gather)
    # Persistence: units up to 1100 elements, 2200 elements in all at most, so a small unit stays sharded.
    capped = r["s3 persistence cap engine"]
    assert 0 < capped["persistent_numel"] <= 2200
    assert min(capped["unit_numels"]) <= 1100
