"""AutoTP sharding (`shard_model`) at tp 2: forward loss and every gradient (gathered whole) equal the
unsharded model's, for a LLaMA-style model (GQA, rotary, SwiGLU; with and without q/k/v bias) and a GPT-2
style one (fused `c_attn` in HF's Conv1D, tied embeddings), with and without the vocabulary-parallel
embedding/LM head/cross-entropy. Also: the report, layer_specs overrides, meta-device models, and the errors
for heads / kv heads / intermediate sizes that do not divide and for layers it cannot place."""

import torch

from harness import run_ranks

CASES = [("llama", {}, False), ("llama", {"bias": True}, True), ("gpt2", {}, False), ("gpt2", {}, True)]


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def autotp_job():
    import torch.distributed as dist
    from torch import nn

    from shardspeed.module_inject import shard_model
    from shardspeed.module_inject.tp_state import tp_full_state_dict

    import tp_models

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    out = {"parity": {}}
    for kind, kwargs, vocab_parallel in CASES:
        ref, model = tp_models.build(kind, **kwargs), tp_models.build(kind, **kwargs)
        data = tp_models.batches(1, 4)[0]
        ref_loss = ref(data)
        ref_loss.backward()
        report = shard_model(model, group, vocab_parallel=vocab_parallel)
        model.vocab_parallel = vocab_parallel
        loss = model(data)
        calls = []
        all_reduce = dist.all_reduce
        dist.all_reduce = lambda *a, _calls=calls, _real=all_reduce, **k: _calls.append(1) or _real(*a, **k)
        loss.backward()
        dist.all_reduce = all_reduce
        grads = tp_full_state_dict(model, group, {n: p.grad for n, p in model.named_parameters()})
        weights = tp_full_state_dict(model, group)
        ref_state = ref.state_dict()
        out["parity"][f"{kind}{kwargs}{vocab_parallel}"] = dict(
            loss=abs(loss.item() - ref_loss.item()),
            grad=max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()),
            weight=max((weights[n] - ref_state[n]).abs().max().item() for n in ref_state),
            report=report,
            backward_all_reduces=len(calls),
            local_numel=sum(p.numel() for p in model.parameters()),
            ref_numel=sum(p.numel() for p in ref.parameters()),
            heads=(model.h[0].attn.num_heads, model.h[0].attn.split_size) if kind == "gpt2" else
            (model.layers[0].self_attn.num_heads, model.layers[0].self_attn.num_key_value_heads),
        )  # fmt: skip

    with torch.device("meta"):
        meta = tp_models.build("llama")
    shard_model(meta, group)
    out["meta_q_shape"] = tuple(meta.layers[0].self_attn.q_proj.weight.shape)

    out["heads"] = _error(lambda: shard_model(tp_models.build("llama", dim=30, heads=3, kv_heads=3), group))
    out["kv_heads"] = _error(lambda: shard_model(tp_models.build("llama", heads=4, kv_heads=1), group))
    out["intermediate"] = _error(lambda: shard_model(tp_models.build("llama", hidden=49), group))
    odd = tp_models.build("llama")
    odd.layers[1].mlp.router = nn.Linear(32, 4)
    out["unplaced"] = _error(lambda: shard_model(odd, group))
    skip = [{"patterns": [r".*\.mlp\.router$"], "partition_type": "skip"},
            {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "skip"}]  # fmt: skip
    report = shard_model(odd, group, layer_specs=skip)
    out["skip"] = (report.replicated, type(odd.layers[1].self_attn.o_proj).__name__)
    # explicit fused shape from layer_specs (overrides the built-in c_attn rule): same loss as unsharded
    spec = [{"patterns": [r".*\.c_attn\.weight$"], "partition_type": "column", "shape": [[32, 32, 32], -1]}]
    ref, fused = tp_models.build("gpt2"), tp_models.build("gpt2")
    shard_model(fused, group, layer_specs=spec)
    data = tp_models.batches(1, 2)[0]
    out["spec_shape"] = abs(fused(data).item() - ref(data).item())
    bad_shape = [{"patterns": [r".*c_attn$"], "partition_type": "column", "shape": [[32, 32], -1]}]
    out["bad_shape"] = _error(lambda: shard_model(tp_models.build("gpt2"), group, layer_specs=bad_shape))
    out["bad_spec"] = _error(lambda: shard_model(tp_models.build("llama"), group, layer_specs=[{"patterns": ["x"],
                                                                       "partition_type": "diagonal"}]))  # fmt: skip
    return out


def test_autotp_sharding_equals_unsharded_model():
    results = run_ranks(autotp_job, 2)
    for rank, res in enumerate(results):
        for case, r in res["parity"].items():
            assert r["loss"] < 1e-5 and r["grad"] < 1e-5, (rank, case, r)
            assert r["weight"] == 0.0, (rank, case)  # gathering the shards gives the original weights back
            assert r["local_numel"] < r["ref_numel"], case
        llama = res["parity"]["llama{}False"]
        report = llama["report"]
        assert sorted(report.row) == sorted(f"layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.o_proj",
                                                                                          "mlp.down_proj"))  # fmt: skip
        assert len(report.column) == 10 and report.replicated == ["lm_head"]
        assert llama["heads"] == (2, 1)
        # one all-reduce per block input in backward (q/k/v share one, gate/up another): 2 layers x 2
        assert llama["backward_all_reduces"] == 4, llama[
            "backward_all_reduces"
        ]  # 4 heads, 2 kv heads -> 2 and 1 per rank
        gpt2 = res["parity"]["gpt2{}False"]
        assert gpt2["report"].column == ["h.0.attn.c_attn", "h.0.mlp.c_fc", "h.1.attn.c_attn", "h.1.mlp.c_fc"]
        assert gpt2["heads"] == (2, 16)
        assert res["parity"]["gpt2{}True"]["report"].vocab_parallel == ["wte", "lm_head"]
        assert res["meta_q_shape"] == (16, 32)
        assert "self_attn.num_heads = 3" in res["heads"] and "size 2" in res["heads"], res["heads"]
        assert "num_key_value_heads = 1" in res["kv_heads"], res["kv_heads"]
        assert "layers.0.mlp.gate_proj" in res["intermediate"] and "49" in res["intermediate"], res[
            "intermediate"
        ]
        assert "layers.1.mlp.router" in res["unplaced"] and "layer_specs" in res["unplaced"], res["unplaced"]
        assert res["skip"] == (["layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.router",
                                "lm_head"], "Linear")  # fmt: skip
        assert res["spec_shape"] < 1e-5
        assert "h.0.attn.c_attn" in res["bad_shape"] and "[32, 32]" in res["bad_shape"], res["bad_shape"]
        assert "partition_type" in res["bad_spec"] and "diagonal" in res["bad_spec"], res["bad_spec"]
