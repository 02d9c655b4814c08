"""The DeepSpeed internals RLHF frameworks reach into, tested by what the frameworks do with them (2 ranks).

- TRL's `unwrap_model_for_generation` at ZeRO-3: gather every parameter, clear each one's
  `ds_active_sub_modules`, remove the hooks of `engine.optimizer.parameter_offload` (`forward_hooks`,
  `backward_hooks`), generate on the plain module, invalidate the coordinator's trace and re-register the hooks
  (`_register_deepspeed_module`); training afterwards equals training that never left;
- OpenRLHF's state parking: `engine.optimizer.offload_states(include=[...], device=OffloadDeviceEnum.cpu)`,
  `engine.empty_partition_cache()`, later `engine.reload_states()`;
- the isinstance checks on DeepSpeed's wrapper classes (`DeepSpeedZeroOptimizer_Stage3`, `DeepSpeedZeroOptimizer`,
  `DeepSpeedZeRoOffload`) that ROLL's offload code branches on.
"""

from __future__ import annotations

import pytest
import torch

from harness import error_text, run_ranks
from models import TinyGPT, token_batches

STEPS = 4


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def _engine(config: dict, optimizer: bool = True):
    import shardspeed

    torch.manual_seed(0)
    model = TinyGPT()
    if not optimizer:
        config = {k: v for k, v in config.items() if k != "optimizer"}
    engine, *_ = shardspeed.initialize(model=model, config=config)
    return engine


def _train_step(engine, step: int) -> float:
    import torch.distributed as dist

    tokens = token_batches(STEPS, 4)[step].chunk(2)[dist.get_rank()]
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _module_hooks(module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def _generate_as_trl_does(engine, prompt: torch.Tensor) -> dict:
    """The steps TRL's unwrap_model_for_generation takes at ZeRO-3, through DeepSpeed's names only."""
    import shardspeed as deepspeed

    out = {}
    with deepspeed.zero.GatheredParameters(engine.parameters()):
        offload = (
            engine.optimizer.parameter_offload if hasattr(engine.optimizer, "parameter_offload") else None
        )
        offload = offload if offload is not None else engine.optimizer
        params = [p for _, p in offload.module.named_parameters()]
        params += [p for _, p in offload.module.ds_external_parameters()]
        for param in params:
            param.ds_active_sub_modules.clear()
        out["hooks before"] = len(offload.forward_hooks)
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        out["module hooks while generating"] = _module_hooks(engine.module)
        out["generated"] = _greedy(engine.module, prompt)
        coordinator = offload.param_coordinator
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        out["trace invalid"] = coordinator.is_invalid_trace()
        offload._register_deepspeed_module(offload.module)
        out["hooks after"] = len(offload.forward_hooks)
    out["local numel after"] = sum(p.numel() for p in engine.module.parameters())  # partitioned again
    return out


def _greedy(module, prompt: torch.Tensor, new_tokens: int = 4) -> torch.Tensor:
    """Greedy decoding, one forward of the whole sequence per new token (TinyGPT's forward returns a loss,
    so its layers are called directly)."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            x = module.tok(tokens) + module.pos[: tokens.shape[1]]
            for block in module.blocks:
                x = block(x)
            logits = module.head(module.ln_f(x))
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens


def _trl_generation() -> dict:
    from shardspeed.zero.api import GatheredParameters

    plain = _engine(_config(3))
    reference = [_train_step(plain, s) for s in range(STEPS)]
    engine = _engine(_config(3))
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = {"reference": reference, "losses": [_train_step(engine, 0)]}
    out["generation"] = _generate_as_trl_does(engine, prompt)
    with GatheredParameters(list(engine.module.parameters())):
        plain_model = TinyGPT()
        plain_model.load_state_dict({n: p.detach().clone() for n, p in engine.module.state_dict().items()})
    out["plain generation"] = _greedy(plain_model, prompt)
    with torch.no_grad():
        engine(token_batches(1, 2, seq=8)[0])  # the hooks gather again
    out["losses"] += [_train_step(engine, s) for s in range(1, STEPS)]
    offload = engine.optimizer.parameter_offload  # forgetting hooks still on, or adopting others, is refused
    out["forget live hooks"] = error_text(lambda: setattr(offload, "forward_hooks", []))
    out["adopt hooks"] = error_text(lambda: setattr(offload, "forward_hooks", ["handle"]))
    out["register twice"] = error_text(lambda: offload._register_deepspeed_module(offload.module))
    return out


def test_trl_removes_and_readds_zero3_hooks_around_generation():
    for out in run_ranks(_trl_generation, 2):
        gen = out["generation"]
        assert gen["hooks before"] > 0 and gen["module hooks while generating"] == 0
        assert gen["hooks after"] == gen["hooks before"] and gen["trace invalid"]
        assert gen["local numel after"] == 0
        assert torch.equal(gen["generated"], out["plain generation"])  # generation saw the full weights
        # training after the detour equals training that never took it
        assert out["losses"] == pytest.approx(out["reference"], abs=1e-6)
        assert "still registered" in out["forget live hooks"]
        assert "only []" in out["adopt hooks"]
        assert "already registered" in out["register twice"]


def _openrlhf_offload() -> dict:
    # (as `import shardspeed as deepspeed` makes DeepSpeed's paths importable under shardspeed.*)
    from shardspeed.runtime.zero.offload_config import OffloadDeviceEnum as devices
    from shardspeed.runtime.zero.offload_config import OffloadStateTypeEnum as kinds

    plain = _engine(_config(3))
    reference = [_train_step(plain, s) for s in range(STEPS)]
    engine = _engine(_config(3, offload_optimizer={"device": "none"}))
    out = {"reference": reference, "losses": [_train_step(engine, 0)]}
    # OpenRLHF reads the config as given to decide whether Adam already lives on the host
    out["offload device"] = engine.config["zero_optimization"]["offload_optimizer"]["device"]
    include = [kinds.optim_states, kinds.contiguous_grad_buffer, kinds.hp_params, kinds.lp_grads]
    engine.optimizer.offload_states(include=include, device=devices.cpu, pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()
    out["forward while parked"] = error_text(lambda: engine(token_batches(1, 2)[0]))  # the engine knows
    engine.reload_states(non_blocking=True)
    out["losses"] += [_train_step(engine, s) for s in range(1, STEPS)]
    evaluation = _engine(_config(3), optimizer=False)  # TRL's and OpenRLHF's reference models
    out["offload without optimizer"] = error_text(lambda: evaluation.offload_states())
    out["optimizer offload without optimizer"] = error_text(lambda: evaluation.optimizer.offload_states())
    out["classes"] = _classes(engine, evaluation, _engine(_config(2)))
    return out


def _classes(stage3, evaluation, stage2) -> dict:
    """isinstance answers for the wrappers DeepSpeed 0.19.8 builds in these three cases."""
    import shardspeed as deepspeed
    from shardspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from shardspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from shardspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert deepspeed.zero.DeepSpeedZeRoOffload is DeepSpeedZeRoOffload
    classes = {
        "stage3": DeepSpeedZeroOptimizer_Stage3,
        "stage12": DeepSpeedZeroOptimizer,
        "offload": DeepSpeedZeRoOffload,
    }
    subjects = {
        "stage3 optimizer": stage3.optimizer,
        "stage3 parameter_offload": stage3.optimizer.parameter_offload,
        "evaluation optimizer": evaluation.optimizer,
        "stage2 optimizer": stage2.optimizer,
    }
    answers = {
        name: sorted(k for k, c in classes.items() if isinstance(obj, c)) for name, obj in subjects.items()
    }
    answers["stage2 has parameter_offload"] = hasattr(stage2.optimizer, "parameter_offload")
    answers["evaluation module"] = evaluation.optimizer.parameter_offload.module is evaluation.module
    return answers


def test_openrlhf_parks_states_through_the_optimizer_and_the_classes_answer_as_deepspeed():
    for out in run_ranks(_openrlhf_offload, 2):
        assert out["offload device"] == "none"
        assert "reload_states() first" in out["forward while parked"]
        assert out["losses"] == pytest.approx(out["reference"], abs=1e-6)
        assert "needs an optimizer" in out["offload without optimizer"]
        assert "needs an optimizer" in out["optimizer offload without optimizer"]
        assert out["classes"] == {
            "stage3 optimizer": ["stage3"],
            "stage3 parameter_offload": ["offload"],
            "evaluation optimizer": ["offload"],
            "stage2 optimizer": ["stage12"],
            "stage2 has parameter_offload": False,
            "evaluation module": True,
        }
