"""Tensor-parallel checkpoints: each tensor rank writes its mp_rank_XX files; resume at tp 2 is bit-exact;
a tp 2 checkpoint (ZeRO 0 and 1) loads at tp 1 (data parallel, ZeRO 0 and 2) and continues equal to the run
that never stopped, and a tp 1 checkpoint loads at tp 2; save_16bit_model and the fp32 consolidation write the whole weights."""

from harness import run_ranks

STEPS_BEFORE, STEPS_AFTER = 2, 2


def checkpoint_job(tmp):
    import os

    import torch
    import tp_common

    import shardspeed
    from shardspeed.module_inject.tp_state import tp_full_state_dict

    import tp_models

    shardspeed.init_distributed()
    out = {}
    for kind, zero_before, zero_after in (("llama", 0, 0), ("gpt2", 1, 2)):
        save_dir = os.path.join(tmp, f"{kind}{zero_before}")
        batches = tp_common.global_batches(STEPS_BEFORE + STEPS_AFTER, 1, 2)

        def engine_at(tp, zero, gas, kind=kind):
            engine, *_ = shardspeed.initialize(model=tp_models.build(kind, seed=3), optimizer=tp_common.adamw,
                                               config=tp_common.config(tp, zero, 0.5, gas))  # fmt: skip
            return engine

        engine = engine_at(2, zero_before, 2)
        tp_common.train(engine, batches[:STEPS_BEFORE], 2)
        engine.save_checkpoint(save_dir, tag="t")
        engine.save_16bit_model(save_dir, "full.bin")
        saved_full = {
            k: v.clone() for k, v in tp_full_state_dict(engine.module, engine.tensor_parallel.group).items()
        }
        tp_common.train(engine, batches[STEPS_BEFORE:], 2)
        never_stopped = tp_full_state_dict(engine.module, engine.tensor_parallel.group)
        engine.destroy()

        resumed = engine_at(2, zero_before, 2)
        resumed.load_checkpoint(save_dir, tag="t")
        tp_common.train(resumed, batches[STEPS_BEFORE:], 2)
        resumed_state = tp_full_state_dict(resumed.module, resumed.tensor_parallel.group)
        resumed.destroy()

        at_tp1 = engine_at(1, zero_after, 1)  # tp 1 on 2 ranks: data parallel, the same global batches
        at_tp1.load_checkpoint(save_dir, tag="t")
        loaded = {k: v.clone() for k, v in at_tp1.module.state_dict().items()}
        steps_at_load = at_tp1.global_steps
        tp_common.train(at_tp1, batches[STEPS_BEFORE:], 1)
        tp1_state = {k: v.clone() for k, v in at_tp1.module.state_dict().items()}
        at_tp1.save_checkpoint(save_dir, tag="tp1")
        at_tp1.destroy()

        back_to_tp2 = engine_at(2, zero_before, 2)  # and the other way: a tp 1 checkpoint split at load
        back_to_tp2.load_checkpoint(save_dir, tag="tp1")
        split = tp_full_state_dict(back_to_tp2.module, back_to_tp2.tensor_parallel.group)
        back_to_tp2.destroy()

        exported = torch.load(os.path.join(save_dir, "full.bin"), weights_only=True)
        from shardspeed.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
        out[kind] = dict(
            files=sorted(os.listdir(os.path.join(save_dir, "t"))),
            resume_exact=all(torch.equal(resumed_state[k], never_stopped[k]) for k in never_stopped),
            tp1_loaded=tp_common.max_diff(loaded, saved_full),
            tp1_continued=tp_common.max_diff(tp1_state, never_stopped),
            moved=tp_common.max_diff(saved_full, never_stopped),
            steps_at_load=steps_at_load,
            exported=tp_common.max_diff(exported, saved_full),
            consolidated=tp_common.max_diff(consolidated, saved_full),
            tp1_to_tp2=tp_common.max_diff(split, tp1_state),
        )
    return out


def test_tensor_parallel_checkpoints(tmp_path):
    results = run_ranks(checkpoint_job, 2, str(tmp_path))
    for res in results:
        llama, gpt2 = res["llama"], res["gpt2"]
        assert (
            "mp_rank_00_model_states.pt" in llama["files"] and "mp_rank_01_model_states.pt" in llama["files"]
        )
        assert "zero_pp_rank_0_mp_rank_01_optim_states.pt" in gpt2["files"], gpt2["files"]
        for r in (llama, gpt2):
            assert r["resume_exact"], r
            assert r["tp1_loaded"] == 0.0 and r["exported"] == 0.0 and r["consolidated"] == 0.0, r
            assert r["tp1_continued"] < 1e-5 and r["moved"] > 1e-3, r
            assert r["steps_at_load"] == STEPS_BEFORE
            assert r["tp1_to_tp2"] == 0.0, r
