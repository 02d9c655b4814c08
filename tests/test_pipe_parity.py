"""Pipeline parallelism equals one process: 2 stages x 1, 2 x 2 and 4 x 1 replicas, SGD and Adam,
accumulation 4, global-norm clipping and a tied embedding across the first and last stage."""

from pipe_common import BASE_SEED, global_batches, layer_specs, loss_fn, reference_train, replica_iterator

from harness import run_ranks

STEPS, MICRO, GAS = 3, 2, 4
OPTIMIZERS = {
    "SGD": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
    "Adam": {"type": "Adam", "params": {"lr": 0.02}},
}


def config(optimizer: str, clip: float = 0.0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": OPTIMIZERS[optimizer],
        "steps_per_print": 1000,
    }


def pipeline_run(cases):
    """Every (stages, optimizer, clip, partition) case in one process group; each rank's final parameters."""
    import shardspeed
    from shardspeed.pipe import PipelineModule

    shardspeed.init_distributed()
    results = []
    for stages, optimizer, clip, partition in cases:
        model = PipelineModule(
            layer_specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
            partition_method=partition,
        )  # fmt: skip
        engine, *_ = shardspeed.initialize(model=model, config=config(optimizer, clip))
        dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
        inputs, labels = global_batches(STEPS, dp * MICRO * GAS)
        data = replica_iterator(inputs, labels, range(STEPS), dp_rank, dp, MICRO, GAS)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(engine.train_batch(data).item())
            norms.append(engine.get_global_grad_norm())
        results.append(
            {
                "stage": engine.stage_id,
                "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
                "losses": losses,
                "norms": norms,
                "parts": model.parts,
            }
        )
        engine.destroy()
    return results


def check_case(per_rank, optimizer, clip):
    inputs, labels = global_batches(STEPS, len(per_rank) // len({r["stage"] for r in per_rank}) * MICRO * GAS)
    reference = reference_train(layer_specs(), config(optimizer, clip), inputs, labels, STEPS)
    seen = set()
    for result in per_rank:
        for name, value in result["params"].items():
            assert name in reference, name
            diff = (value - reference[name]).abs().max().item()
            assert diff <= 1e-5, f"stage {result['stage']} {name}: max |diff| {diff:.2e}"
            seen.add(name)
    assert seen == set(reference), f"parameters held by no stage: {set(reference) - seen}"
    # Every stage reports the same loss and the same global norm.
    assert len({tuple(r["losses"]) for r in per_rank}) == 1
    assert len({tuple(r["norms"]) for r in per_rank}) == 1
    if clip:
        assert max(per_rank[0]["norms"]) > clip  # clipping was exercised


def test_two_stages_one_replica():
    cases = [(2, "SGD", 0.0, "parameters"), (2, "Adam", 0.3, "uniform")]
    results = run_ranks(pipeline_run, 2, cases)
    for i, (_, optimizer, clip, _) in enumerate(cases):
        check_case([r[i] for r in results], optimizer, clip)


def test_two_stages_two_replicas_and_four_stages():
    cases = [(2, "Adam", 0.3, "parameters"), (2, "SGD", 0.0, "type:block"), (4, "Adam", 0.3, "uniform"),
             (4, "SGD", 0.0, "parameters")]  # fmt: skip
    results = run_ranks(pipeline_run, 4, cases)
    for i, (stages, optimizer, clip, _) in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert {r["stage"] for r in per_rank} == set(range(stages))
        check_case(per_rank, optimizer, clip)
