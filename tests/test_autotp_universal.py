"""Universal checkpoints of AutoTP runs: a tp 2 run (ZeRO 1, fp32) is saved, converted with ds_to_universal
(no --inject_missing_state: the engine writes the AutoTP layout's `universal_checkpoint_info`), and loaded
with `checkpoint.load_universal` at tp 1 (2 data-parallel ranks) and at tp 2; both continue equal (1e-6) to
the run that never stopped; the loaded shards agree with what DeepSpeed's readers make of the layers'
per-parameter metadata and the info (cut and merge). The info names the row-parallel, replicated and fused (sub-parameter) entries;
a checkpoint whose info lists layouts that cannot be merged is refused before anything is written."""

from harness import run_ranks

STEPS_BEFORE, STEPS_AFTER = 2, 2


def universal_job(tmp):
    import os

    import tp_common

    import shardspeed
    from shardspeed.checkpoint import to_universal
    from shardspeed.module_inject.tp_state import tp_full_state_dict

    import tp_models

    shardspeed.init_distributed()
    save_dir = os.path.join(tmp, "ckpt")
    batches = tp_common.global_batches(STEPS_BEFORE + STEPS_AFTER, 1, 2)

    def engine_at(tp, zero, gas, universal=False):
        config = tp_common.config(tp, zero, 0.5, gas)
        config["checkpoint"] = {"load_universal": universal}
        engine, *_ = shardspeed.initialize(model=tp_models.build("gpt2", seed=3), optimizer=tp_common.adamw,
                                           config=config)  # fmt: skip
        return engine

    engine = engine_at(2, 1, 2)
    tp_common.train(engine, batches[:STEPS_BEFORE], 2)
    engine.save_checkpoint(save_dir, tag="t")
    info = engine.module.universal_checkpoint_info
    tp_common.train(engine, batches[STEPS_BEFORE:], 2)
    never_stopped = tp_full_state_dict(engine.module, engine.tensor_parallel.group)
    engine.destroy()

    if shardspeed.comm.get_rank() == 0:
        to_universal.main(["--input_folder", os.path.join(save_dir, "t"),
                           "--output_folder", os.path.join(save_dir, "t_universal")])  # fmt: skip
    shardspeed.comm.barrier()

    at_tp1 = engine_at(1, 2, 1, universal=True)
    at_tp1.load_checkpoint(save_dir, tag="t_universal")
    tp_common.train(at_tp1, batches[STEPS_BEFORE:], 1)
    tp1_state = {k: v.clone() for k, v in at_tp1.module.state_dict().items()}
    at_tp1.destroy()

    at_tp2 = engine_at(2, 1, 2, universal=True)
    at_tp2.load_checkpoint(save_dir, tag="t_universal")
    metadata_checked = check_layer_metadata(at_tp2, os.path.join(save_dir, "t_universal", "zero"), info)
    tp_common.train(at_tp2, batches[STEPS_BEFORE:], 2)
    tp2_state = tp_full_state_dict(at_tp2.module, at_tp2.tensor_parallel.group)
    at_tp2.destroy()
    return dict(
        tp1=tp_common.max_diff(tp1_state, never_stopped),
        tp2=tp_common.max_diff(tp2_state, never_stopped),
        info=info,
        metadata_checked=metadata_checked,
    )


def check_layer_metadata(engine, zero_dir, info) -> int:
    """The loaded tp 2 engine against DeepSpeed's two readers of the AutoTP layout: each parameter's
    metadata cuts exactly this rank's loaded shard out of the universal value (its restore), and the info
    merges the ranks' shards back into that value (its converter). Returns the parameters checked."""
    import os

    import torch
    import torch.distributed as dist

    from shardspeed.checkpoint.tp_restore import param_uc_restore_meta, resolve_autotp_partition
    from shardspeed.checkpoint.tp_slices import merge_rank_slices

    group, rank = engine.tensor_parallel.group, dist.get_rank(engine.tensor_parallel.group)
    checked = 0
    for name, param in engine.module.named_parameters():
        if param_uc_restore_meta(param) is None:
            continue
        whole = torch.load(os.path.join(zero_dir, name, "fp32.pt"))["param"]
        cut = resolve_autotp_partition(param, {}, whole, rank, 2)
        assert torch.equal(cut, param.detach().flatten()), name
        shards = [torch.empty_like(param) for _ in range(2)]
        dist.all_gather(shards, param.detach().contiguous(), group=group)
        assert torch.equal(merge_rank_slices(info, name, shards, 2)[0], whole), name
        checked += 1
    return checked


def test_autotp_universal_checkpoint_loads_at_tp1_and_tp2(tmp_path):
    from shardspeed.compat.mirrors import checkpoint_constants as c

    results = run_ranks(universal_job, 2, str(tmp_path))
    for out in results:
        assert out["tp1"] < 1e-6 and out["tp2"] < 1e-6, out
        assert out["metadata_checked"] >= 8, out[
            "metadata_checked"
        ]  # c_attn, c_proj, c_fc, mlp c_proj (+ biases)
        info = out["info"]
        # the list DeepSpeed's converter joins along dim 1: in Conv1D's [in, out] orientation that is the
        # column-parallel c_fc, not the row-parallel c_proj (split along its input features, dim 0)
        row_list = info[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS]
        assert r"^h\.0\.mlp\.c_fc\.weight$" in row_list and r"^h\.0\.attn\.c_proj\.weight$" not in row_list
        assert r"^h\.0\.attn\.c_proj\.bias$" in info[c.TP_REPLICATED_PARAMETER_PATTERNS]
        assert r"^h\.0\.attn\.c_attn\.weight$" not in info[c.TP_REPLICATED_PARAMETER_PATTERNS]
        fused = {tuple(e["patterns"]): e for e in info[c.PARAMETER_WITH_SUB_PARAMS]}
        assert fused[(r"^h\.0\.attn\.c_attn\.weight$",)]["partition_dim"] == 1  # Conv1D: [in, 3*hidden]


def test_conversion_refuses_layouts_listed_as_unsupported(tmp_path):
    import pytest

    from shardspeed.checkpoint.to_universal import validate_autotp_conversion_support, write_universal

    validate_autotp_conversion_support({})  # older info without the key: nothing to refuse
    info = {"autotp_unsupported_parameter_patterns": {r"^qkv\.weight$": "interleaved fused heads"}}
    with pytest.raises(ValueError, match="interleaved fused heads"):
        write_universal(None, {"universal_checkpoint_info": info}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_files_without_recorded_partitions_are_refused():
    import pytest

    from shardspeed.checkpoint.files import CheckpointError
    from shardspeed.checkpoint.tensor_parallel import whole_model_states

    deepspeed_autotp = {
        "mp_world_size": 2,
        "param_shapes": [{"w": (4, 2)}],
    }  # DeepSpeed's layout, no partitions
    with pytest.raises(CheckpointError, match="tp_partitions"):
        whole_model_states(deepspeed_autotp)
    ours = {"mp_world_size": 2, "mp_rank": 1, "param_shapes": {"w": (4, 2), "b": (4,)},
            "tp_partitions": {"w": {"dim": 1, "segments": [4], "tp_size": 2}}}  # fmt: skip
    whole = whole_model_states(ours)
    assert whole["param_shapes"] == {"w": (4, 4), "b": (4,)} and whole["mp_world_size"] == 1
    assert "tp_partitions" not in whole and "mp_rank" not in whole
