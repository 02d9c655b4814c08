"""Shared pieces of the engine tests: the base config, per-rank training loops and the reference run."""

from __future__ import annotations

import copy

import torch

from models import DynamicGPT, TinyGPT, token_batches

LR, MIN_LR, WARMUP = 1e-2, 1e-3, 4


def base_config(**overrides) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": MIN_LR,
                "warmup_max_lr": LR,
                "warmup_num_steps": WARMUP,
                "warmup_type": "linear",
            },
        },
        # Small buckets so the model spans several of them and their launch order is exercised.
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def micro_batch(
    data: torch.Tensor, step: int, micro_index: int, rank: int, world: int, micro: int
) -> torch.Tensor:
    """The slice of global batch `step` that `rank` trains on at micro-step `micro_index`."""
    start = (micro_index * world + rank) * micro
    return data[step, start : start + micro]


def params_of(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def train_engine(engine, data: torch.Tensor, steps: range, rank: int, world: int) -> list[float]:
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in steps:
        if hasattr(engine.module, "set_step"):  # DynamicGPT
            engine.module.set_step(step)
        for m in range(gas):
            loss = engine(micro_batch(data, step, m, rank, world, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def build_model(frozen: bool = False, dynamic: bool = False, **model_kwargs) -> TinyGPT:
    model = (DynamicGPT if dynamic else TinyGPT)(**model_kwargs)
    if frozen:
        model.pos.requires_grad_(False)  # a frozen parameter: never updated, never reduced
    return model


def param_groups(model, two_groups: bool):
    """One group, or two with different weight decay (matrices decay, vectors don't) — as GPT trainers do."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not two_groups:
        return trainable
    return [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.01},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]


def engine_run(config: dict, world: int, steps: int, seed: int = 0, options=None) -> dict:
    """Per-rank body: build the tiny GPT and an engine, train `steps` optimizer steps, return parameters."""
    import torch.distributed as dist

    import shardspeed

    options = options or {}
    torch.manual_seed(seed)
    model = build_model(options.get("frozen", False), options.get("dynamic", False))
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=param_groups(model, options.get("groups", False)),
        config=copy.deepcopy(config),
    )
    data = token_batches(steps, engine.train_batch_size())
    train_engine(engine, data, range(steps), dist.get_rank(), world)
    return summarize(engine)


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full value, gathering ZeRO-3 shards (collective)."""
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return params_of(engine.module)


def summarize(engine) -> dict:
    masters = {}
    if engine.optimizer.plan.mixed and engine.zero_optimization_stage() == 0:
        names = {p: n for n, p in engine.module.named_parameters()}
        masters = {names[p]: m.clone() for p, m in engine.optimizer.masters.items()}
    return {
        "params": full_params(engine),
        "masters": masters,
        "lr": engine.get_lr(),
        "global_steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "norm": engine.get_global_grad_norm(),
    }


def warmup_lr(step: int) -> float:
    """WarmupLR (linear) as DeepSpeed defines it, for optimizer step `step` (0-based)."""
    if step == 0:
        return MIN_LR
    t, w = step - 1, max(2, WARMUP)
    return MIN_LR + (LR - MIN_LR) * min(1.0, t / w)


def reference_run(steps: int, world: int, micro: int = 2, gas: int = 2, clip: float = 0.5, seed: int = 0,
                  options=None):  # fmt: skip
    """Single-process reference: the same global batches, plain torch AdamW, torch's clip_grad_norm_."""
    options = options or {}
    torch.manual_seed(seed)
    model = build_model(options.get("frozen", False), options.get("dynamic", False))
    groups = param_groups(model, options.get("groups", False))
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    data = token_batches(steps, micro * gas * world)
    for step in range(steps):
        if hasattr(model, "set_step"):
            model.set_step(step)
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step)
        for m in range(gas):
            for r in range(world):
                (model(micro_batch(data, step, m, r, world, micro)) / (gas * world)).backward()
        for p in model.parameters():
            # A trainable parameter unused this step is stepped with a zero gradient (moments decay, weight
            # decay applies), as DeepSpeed and DDP's bucketed gradients do; torch would skip it.
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return params_of(model)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
