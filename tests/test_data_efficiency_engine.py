"""The data-efficiency library in the engine on 2 Gloo ranks: the legacy curriculum's `curriculum_seqlen`, the
curriculum sampler as `training_data`'s loader, random-LTD layers; and each resuming exactly from a checkpoint.

Each rank trains every case uninterrupted, saving a checkpoint midway, then builds new engines (new models,
loaders and samplers), loads those checkpoints and trains on. The resumed run must see the same difficulties, read the same samples on each rank
and compute the same losses (bit for bit) as the uninterrupted one from the checkpoint on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import error_text, run_ranks

STEPS, SAVE_AT = 8, 3
SAMPLES, WIDTH = 64, 8
LEGACY = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": 10,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}  # fmt: skip
DEEPSPEED_LINEAR = [2, 4, 4, 6, 6, 8, 8, 10]  # DeepSpeed's own test: difficulty per step of this schedule


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}  # fmt: skip


class IndexData(torch.utils.data.Dataset):
    """Sample i is WIDTH copies of i, and a label: the index travels through the loader."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.full((WIDTH,), float(i)), torch.tensor(i % 3)


class SeqlenModel(nn.Module):
    """Cuts its input to `curriculum_seqlen` columns, as a language model cuts its sequences; records what it got."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, 3)
        self.seen: list = []

    def forward(self, x, y, curriculum_seqlen=None):
        self.seen.append((curriculum_seqlen, x[:, 0].long().tolist()))
        if curriculum_seqlen is not None:
            x = torch.cat([x[:, :curriculum_seqlen], torch.zeros_like(x[:, curriculum_seqlen:])], dim=1)
        return nn.functional.cross_entropy(self.linear(x / SAMPLES), y)


class Layer(nn.Module):
    """A residual layer over [batch, seq, hidden] that records the sequence length it ran on."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.lengths: list[int] = []

    def forward(self, hidden, attention_mask=None):
        self.lengths.append(hidden.shape[1])
        return hidden + torch.tanh(self.linear(hidden))


class Stack(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, attention_mask=None)
        return x.pow(2).mean()


RANDOM_LTD = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
              "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
              "random_ltd_schedule": {"min_value": 4, "max_value": 16, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}  # fmt: skip


def _sampling(cluster_dir: str, metric_paths: dict) -> dict:
    metric = {"index_to_sample_path": metric_paths["index_to_sample"],
              "index_to_metric_path": metric_paths["index_to_metric"], "difficulty_type": "value",
              "clustering_type": "schedule_based", "min_difficulty": 3, "max_difficulty": 7,
              "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [3, 5, 7], "max_step": [2, 4]}}  # fmt: skip
    return {"enabled": True, "seed": 7, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "data_cluster_path": cluster_dir, "curriculum_metrics": {"mod8": metric}}}}  # fmt: skip


def _engines(root: str, metric_paths: dict):
    import shardspeed
    from shardspeed.data_pipeline import convert_to_random_ltd

    torch.manual_seed(0)
    legacy, *_ = shardspeed.initialize(model=SeqlenModel(), config=_config(curriculum_learning=LEGACY))
    torch.manual_seed(0)
    sampling, _, loader, _ = shardspeed.initialize(
        model=SeqlenModel(), training_data=IndexData(),
        config=_config(data_efficiency=_sampling(f"{root}/clusters", metric_paths)),
    )  # fmt: skip
    posted = []
    sampling.set_data_post_process_func(
        lambda batch, state: posted.append(dict(state["current_difficulties"])) or batch
    )
    ltd_config = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": RANDOM_LTD}}
    torch.manual_seed(0)
    ltd, *_ = shardspeed.initialize(model=Stack(), config=_config(data_efficiency=ltd_config))
    convert_to_random_ltd(ltd, Layer)  # DeepSpeed's way: convert the engine's model
    torch.manual_seed(0)
    model = convert_to_random_ltd(
        Stack(), Layer
    )  # ZeRO-1/2 record parameter names: convert before initialize
    ltd_zero1, *_ = shardspeed.initialize(
        model=model, config=_config(data_efficiency=ltd_config, zero_optimization={"stage": 1})
    )  # fmt: skip
    return legacy, (sampling, loader, posted), (ltd, ltd_zero1)


def _train(engines, steps: range, rank: int) -> dict:
    legacy, (sampling, loader, posted), (ltd, ltd_zero1) = engines
    out = {"legacy": [], "sampling": [], "ltd": [], "ltd_zero1": []}
    batches = iter(loader)
    for step in steps:
        for micro in range(2):
            x = torch.full((2, WIDTH), float(10 * step + micro))
            legacy.backward(legacy(x, torch.tensor([0, 1])))
            legacy.step()
            x, y = next(batches)
            loss = sampling(x, y)
            sampling.backward(loss)
            sampling.step()
            out["sampling"].append((x[:, 0].long().tolist(), loss.item()))
            for name, engine in (("ltd", ltd), ("ltd_zero1", ltd_zero1)):
                gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                loss_ltd = engine(torch.randn(2, 16, 8, generator=gen))
                engine.backward(loss_ltd)
                engine.step()
                out[name].append(loss_ltd.item())
        out["legacy"].append(legacy.module.seen[-1][0])
    out["posted"] = posted[-2 * len(steps) :]
    out["ltd_lengths"] = [layer.random_ltd_layer.lengths[-1] for layer in ltd.module.layers[1:3]]
    out["ltd_state"] = ltd.random_ltd_scheduler.state_dict()
    return out


def _named(engines):
    legacy, (sampling, _, _), (ltd, ltd_zero1) = engines
    return (("legacy", legacy), ("sampling", sampling), ("ltd", ltd), ("ltd_zero1", ltd_zero1))


def _late_conversion_error() -> str:
    """Converting the engine's model at ZeRO stage 2 (names already recorded by the optimizer): refused."""
    import shardspeed
    from shardspeed.data_pipeline import convert_to_random_ltd

    ltd_config = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": RANDOM_LTD}}
    engine, *_ = shardspeed.initialize(
        model=Stack(), config=_config(data_efficiency=ltd_config, zero_optimization={"stage": 2})
    )  # fmt: skip
    return error_text(lambda: convert_to_random_ltd(engine, Layer))


def _run_and_resume(root: str, metric_paths: dict) -> tuple[dict, dict]:
    """Train every case uninterrupted (saving midway), then build fresh engines, load and train on."""
    import torch.distributed as dist

    engines = _engines(root, metric_paths)
    rank = dist.get_rank()
    before = _train(engines, range(SAVE_AT), rank)
    for name, engine in _named(engines):
        engine.save_checkpoint(f"{root}/{name}")
    after = _train(engines, range(SAVE_AT, STEPS), rank)
    engines[0].module.eval()
    engines[0](torch.zeros(2, WIDTH), torch.tensor([0, 1]))
    first = {"before": before, "after": after, "eval_seqlen": engines[0].module.seen[-1][0]}
    first["late_conversion"] = _late_conversion_error()

    engines = _engines(root, metric_paths)  # new engines, models and loaders: all they know comes from disk
    for name, engine in _named(engines):
        engine.load_checkpoint(f"{root}/{name}")
    return first, _train(engines, range(SAVE_AT, STEPS), rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from shardspeed.data_pipeline import write_metric_index

    root = tmp_path_factory.mktemp("data_efficiency")
    metric_paths = write_metric_index(root / "analysis", "mod8", [i % 8 for i in range(SAMPLES)])
    results = run_ranks(_run_and_resume, 2, str(root), metric_paths)
    return [first for first, _ in results], [resumed for _, resumed in results]


def test_legacy_curriculum_passes_seqlen_each_step(runs):
    first, _ = runs
    for rank in first:
        assert rank["before"]["legacy"] + rank["after"]["legacy"] == DEEPSPEED_LINEAR
        assert rank["eval_seqlen"] is None  # only training forwards get it, as in DeepSpeed


def test_curriculum_sampler_splits_global_batches_over_ranks(runs):
    first, _ = runs
    for step in range(STEPS):
        allowed = 3 if step < 2 else 5 if step < 4 else 7  # curriculum steps 1-2, 3-4, 5-
        global_batch = []
        for rank in first:
            micro = (rank["before"]["sampling"] + rank["after"]["sampling"])[2 * step : 2 * step + 2]
            global_batch += [s for samples, _ in micro for s in samples]
        assert len(global_batch) == 8 and all(s % 8 <= allowed for s in global_batch), (step, global_batch)
    # the post-process function saw the sampler's state with every batch
    assert first[0]["after"]["posted"][-1] == {"mod8": 7}


def test_random_ltd_layers_run_on_the_kept_tokens(runs):
    first, _ = runs
    state = first[0]["after"]["ltd_state"]
    # kept length at the last step (7): floor(7/6 * 12 + 4) = 18 -> capped at max_value 16: full length
    assert state["current_value"] == 16 and first[0]["before"]["ltd_lengths"] == [8, 8]  # step 2: 4 + 4 = 8
    # consumed layer-tokens: sum over steps 0..7 of the global batch 8 x (kept x 2 layers + 16 x 2 layers)
    kept = [4, 6, 8, 10, 12, 14, 16, 16]
    assert state["consumed_layer_tokens"] == sum(8 * (k * 2 + 16 * 2) for k in kept)


def test_random_ltd_conversion_after_zero12_initialize_is_refused(runs):
    first, _ = runs
    assert first[0]["late_conversion"].startswith(
        "ValueError: convert_to_random_ltd after initialize at ZeRO stage 2"
    )


@pytest.mark.parametrize("case", ["legacy", "sampling", "ltd", "ltd_zero1", "posted", "ltd_state"])
def test_resume_continues_exactly(runs, case):
    first, resumed = runs
    for rank_first, rank_resumed in zip(first, resumed):
        assert rank_resumed[case] == rank_first["after"][case]
