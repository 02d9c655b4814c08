"""ZeRO++ on a GPU (skipped, with the reason, on CPU-only machines): the quantizer gives the same bytes on
CUDA as on the CPU, and a one-rank NCCL engine trains with qwZ and int8 frozen weights (their records on the
GPU) within tolerance of plain stage 3. One rank: NCCL refuses two ranks on one GPU, so the node groups
(hpZ, qgZ's all-to-alls) are covered on Gloo (test_zeropp.py)."""

import copy

import pytest
import torch

from shardspeed.zero.zeropp.quantize import BlockLayout, dequantize, quantize

from common import base_config, build_model, train_engine
from harness import run_ranks
from models import token_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_records_on_cuda_equal_the_cpu_ones(dtype):
    torch.manual_seed(0)
    for numels in ([7], [4096, 64], [100_003, 128, 128]):
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        slice_numel = -(-sum(numels) // 3)
        values = (torch.randn(3, slice_numel) * torch.logspace(-3, 3, slice_numel)).to(dtype)
        values[1, 5] = float("inf")
        for bits, block in ((8, 8000), (4, 512)):
            layout = BlockLayout.for_buffer(offsets, numels, slice_numel, 3, bits=bits, max_block=block)
            cpu, gpu = quantize(values, layout, range(3)), quantize(values.cuda(), layout, range(3))
            assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
            back_gpu = dequantize(gpu, layout, range(3), dtype).cpu()
            back_cpu = dequantize(cpu, layout, range(3), dtype)
            assert torch.equal(back_gpu.isnan(), back_cpu.isnan())
            assert torch.equal(back_gpu.nan_to_num(), back_cpu.nan_to_num())


def _run(steps: int) -> dict:
    import torch.distributed as dist

    import shardspeed

    out = {}
    for name, switches in (("plain", {}), ("zeropp", {"zero_quantized_weights": True,
                                                      "zero_quantized_nontrainable_weights": True,
                                                      "zero_quantized_gradients": True})):  # fmt: skip
        zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 3000, **switches}
        config = base_config(zero_optimization=zero, bf16={"enabled": True})
        torch.manual_seed(0)
        model = build_model(frozen=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = shardspeed.initialize(
            model=model, model_parameters=trainable, config=copy.deepcopy(config)
        )
        data = token_batches(steps, engine.train_batch_size()).to(engine.device)
        out[name] = train_engine(engine, data, range(steps), dist.get_rank(), 1)
        if name == "zeropp":
            homes = [u.home for u in engine.optimizer.coordinator.units if u.home is not None]
            out["records on cuda"] = bool(homes) and all(h.records.is_cuda for h in homes)
        engine.destroy()
    return out


def test_zeropp_trains_on_one_gpu_within_tolerance_of_plain_stage_3():
    result = run_ranks(_run, 1, 4)[0]
    assert result["records on cuda"]
    gaps = [abs(a - b) / abs(b) for a, b in zip(result["zeropp"], result["plain"])]
    assert max(gaps) < 0.03 and result["zeropp"] != result["plain"], result
