"""Compression on a CUDA GPU (skipped, with the reason, where none is visible): one rank over NCCL trains
every technique in fp16 and bf16 through the engine, then cleans, packs, exports and reloads on the GPU."""

import pytest
import torch
from compression_common import Bert, batches, ds_config, every_technique

from harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _job(directory: str) -> dict:
    import shardspeed
    from shardspeed.compression import export_packed, load_packed_state
    from shardspeed.compression.compress import init_compression, redundancy_clean
    from shardspeed.compression.packed import PackedLinear

    out = {}
    for precision in ("fp16", "bf16"):
        config = ds_config(
            every_technique(1, wq={"quantization_type": "symmetric"}), **{precision: {"enabled": True}}
        )
        torch.manual_seed(0)
        model = init_compression(Bert(), config)
        engine, *_ = shardspeed.initialize(model=model, config=config)
        losses = []
        for tokens in batches(4):
            loss = engine(tokens.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        query = engine.module.layer[0].attention.self.query
        weight = query.compressed_weight()[0].detach().float()
        model.eval()
        tokens = batches(1, seed=3)[0][:, :-1].cuda()
        with torch.no_grad():
            masked = model.logits(tokens).float()
        redundancy_clean(model, config)
        with torch.no_grad():
            cleaned = model.logits(tokens).float()
        path = f"{directory}/{precision}.safetensors"
        export_packed(model, path)
        reloaded = Bert().to(device="cuda", dtype=next(model.parameters()).dtype)
        for layer in reloaded.layer:  # the cleaned shapes: half the rows, two of four heads
            attention = layer.attention
            for name in ("query", "key", "value"):
                setattr(attention.self, name, torch.nn.Linear(32, 16).cuda())
            attention.output.dense = torch.nn.Linear(16, 32).cuda()
            attention.self.num_attention_heads, attention.self.all_head_size = 2, 16
            layer.intermediate.dense, layer.output.dense = (
                torch.nn.Linear(32, 64).cuda(),
                torch.nn.Linear(64, 32).cuda(),
            )
        load_packed_state(reloaded, path)
        with torch.no_grad():
            loaded = reloaded.logits(tokens).float()
        out[precision] = {
            "losses": losses,
            "distinct": len(torch.unique(weight.reshape(4, -1)[0])),
            "clean_diff": (cleaned - masked).abs().max().item(),
            "reload_diff": (loaded - cleaned).abs().max().item(),
            "packed_on_cuda": all(
                m.packed.qweight.is_cuda for m in model.modules() if isinstance(m, PackedLinear)
            ),
        }
        engine.destroy()
    return out


def test_compression_on_cuda(tmp_path):
    (out,) = run_ranks(_job, 1, str(tmp_path))
    for precision, result in out.items():
        assert all(x == x and x < 10 for x in result["losses"]), result  # finite
        assert result["distinct"] <= 256
        # the masked model ran in fp16/bf16 too: one ulp of the logits' scale
        assert result["clean_diff"] <= (2e-2 if precision == "bf16" else 4e-3), result
        assert result["reload_diff"] == 0.0 and result["packed_on_cuda"], result
