"""FairScale's OSS and ShardedDataParallel (shardspeed/fairscale/) on 2 Gloo ranks against single-process
training: the parameters they reach, the consolidated state dict, clipping, accumulation and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.fairscale import OSS, ShardedDataParallel
from tests import fairscale_common as fc
from tests.harness import error_text, run_ranks

STEPS = 4


def _params(net) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(net, opt, rank, world, steps=STEPS, clip=None, micro=1):
    for step in range(steps):
        opt.zero_grad()
        x, y = fc.batch(step)
        x, y = fc.local(x, rank, world), fc.local(y, rank, world)
        for m in range(micro):
            xs, ys = fc.local(x, m, micro), fc.local(y, m, micro)
            context = net.no_sync() if m < micro - 1 else torch.enable_grad()
            with context:
                (fc.loss_of(net, xs, ys) / micro).backward()
        if clip is not None:
            opt.clip_grad_norm(clip)
        opt.step()


def _ranks_body() -> dict:
    rank, world = fc.init_gloo()
    out = {}
    # ShardedDDP + OSS(Adam): the example
    net = fc.model()
    opt = OSS(params=net.parameters(), optim=torch.optim.Adam, lr=0.01)
    ddp = ShardedDataParallel(net, opt)
    _train(ddp, opt, rank, world)
    out["sdp_adam"] = _params(net)
    opt.consolidate_state_dict(recipient_rank=0)
    out["state"] = opt.state_dict() if rank == 0 else None
    out["no_state_elsewhere"] = error_text(opt.state_dict) if rank == 1 else None
    # the consolidated state loads into a fresh OSS (all ranks) and training continues as the reference does
    saved = opt.state_dict(all_ranks=True)
    net2 = fc.model()
    net2.load_state_dict(out["sdp_adam"])
    opt2 = OSS(net2.parameters(), optim=torch.optim.Adam, lr=0.01)
    opt2.load_state_dict(saved)
    ddp2 = ShardedDataParallel(net2, opt2)
    for step in range(STEPS, STEPS + 2):
        opt2.zero_grad()
        x, y = fc.batch(step)
        fc.loss_of(ddp2, fc.local(x, rank, world), fc.local(y, rank, world)).backward()
        opt2.step()
    out["resumed"] = _params(net2)
    # OSS alone behind torch's DDP, SGD with momentum, clipping, an LR schedule on OSS's param_groups
    net = fc.model()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = fc.batch(step)
        fc.loss_of(ddp, fc.local(x, rank, world), fc.local(y, rank, world)).backward()
        out.setdefault("norms", []).append(opt.clip_grad_norm(0.05).item())
        opt.step()
        schedule.step()
    out["oss_ddp_sgd"] = _params(net)
    # gradient accumulation with no_sync, clipping through the OSS
    net = fc.model()
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=0.01)
    ddp = ShardedDataParallel(net, opt, reduce_buffer_size=0)
    _train(ddp, opt, rank, world, clip=0.05, micro=2)
    out["accumulated_clipped"] = _params(net)
    # broadcast_fp16: every rank holds the same (fp16-rounded) parameters
    net = fc.model()
    opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1, broadcast_fp16=True)
    _train(ShardedDataParallel(net, opt), opt, rank, world)
    out["fp16_broadcast"] = _params(net)
    # refusals name what they refuse
    out["lbfgs"] = error_text(lambda: OSS(fc.model().parameters(), optim=torch.optim.LBFGS, lr=1))
    out["object"] = error_text(lambda: OSS(fc.model().parameters(), lr=1, force_broadcast_object=True))
    net = fc.model()
    sdp = ShardedDataParallel(net, OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1))
    net[0].weight.grad = torch.zeros_like(net[0].weight, requires_grad=True)  # a gradient with a graph
    out["grad_grad"] = error_text(lambda: sdp(torch.randn(2, 6)))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_ranks_body, fc.WORLD)


def _reference_with_schedule():
    net = fc.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        fc.loss_of(net, *fc.batch(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item())
        opt.step()
        schedule.step()
    return _params(net), norms


def test_sharded_ddp_with_oss_reaches_single_process_parameters(results):
    expected = fc.reference(torch.optim.Adam, STEPS, lr=0.01)
    for rank in results:
        assert fc.max_diff(rank["sdp_adam"], expected) < 1e-5


def test_oss_behind_ddp_with_clipping_and_lr_schedule(results):
    expected, norms = _reference_with_schedule()
    for rank in results:
        assert fc.max_diff(rank["oss_ddp_sgd"], expected) < 1e-5
        assert rank["norms"] == pytest.approx(norms, rel=1e-5)


def test_no_sync_accumulation_and_clipping_match_the_reference(results):
    expected = fc.reference(torch.optim.AdamW, STEPS, clip=0.05, lr=0.01)
    for rank in results:
        assert fc.max_diff(rank["accumulated_clipped"], expected) < 1e-5


def test_consolidated_state_dict_is_the_torch_optimizers(results):
    net = fc.model()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        fc.loss_of(net, *fc.batch(step)).backward()
        opt.step()
    torch_state = opt.state_dict()
    ours = results[0]["state"]
    assert ours["param_groups"][0]["params"] == torch_state["param_groups"][0]["params"]
    assert ours["param_groups"][0]["lr"] == 0.01
    assert ours["state"].keys() == torch_state["state"].keys()
    for index, entry in torch_state["state"].items():
        assert ours["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.allclose(ours["state"][index][key].float(), value.float(), atol=1e-6), (index, key)
    assert "has not been consolidated" in results[1]["no_state_elsewhere"]
    # resumed from it for two more steps: the same as six uninterrupted steps
    for step in range(STEPS, STEPS + 2):
        opt.zero_grad()
        fc.loss_of(net, *fc.batch(step)).backward()
        opt.step()
    for rank in results:
        assert fc.max_diff(rank["resumed"], _params(net)) < 1e-5


def test_broadcast_fp16_keeps_ranks_identical_and_close(results):
    assert fc.max_diff(results[0]["fp16_broadcast"], results[1]["fp16_broadcast"]) == 0.0
    expected = fc.reference(torch.optim.SGD, STEPS, lr=0.1)
    assert fc.max_diff(results[0]["fp16_broadcast"], expected) < 2e-3


def test_refusals_name_the_argument(results):
    assert "LBFGS" in results[0]["lbfgs"] and "elementwise" in results[0]["lbfgs"]
    assert "force_broadcast_object" in results[0]["object"]
    assert "gradients that don't require grad" in results[0]["grad_grad"]
