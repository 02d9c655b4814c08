"""Shared pieces of the tensor-parallel training tests: configs, the one-process reference, a TP run."""

from __future__ import annotations

import torch

SEQ_STEPS, MICRO, LR = 3, 2, 1e-3


def config(tp: int, zero: int = 0, clip: float = 0.0, gas: int = 1, dtype: str = "fp32", vocab=False,
           partition_activations=False) -> dict:  # fmt: skip
    extra = {"activation_checkpointing": {"partition_activations": True}} if partition_activations else {}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 2000},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "tensor_parallel": {"autotp_size": tp, "vocab_parallel_lm_head": vocab},
        "steps_per_print": 1000,
    }


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def global_batches(steps: int, dp: int, gas: int, seed: int = 7) -> torch.Tensor:
    import tp_models

    return tp_models.batches(steps, MICRO * gas * dp, seed=seed)


def reference_run(kind: str, steps: int, dp: int, gas: int, clip: float, model_kwargs=None, start=None):
    """One process, the full batch per step: final state dict, per-step losses and pre-clip norms."""
    import tp_models

    model = tp_models.build(kind, **(model_kwargs or {}))
    if start is not None:
        model.load_state_dict(start)
    opt = adamw(model.parameters())
    losses, norms = [], []
    for batch in global_batches(steps, dp, gas):
        opt.zero_grad()
        loss = model(batch)
        loss.backward()
        norms.append(
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")).item()
        )
        losses.append(loss.item())
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, losses, norms


def train(engine, batches: torch.Tensor, gas: int) -> tuple[list[float], list[float]]:
    """Feed this data-parallel rank its micro-batches of each global batch; mean loss and grad norm per step."""
    dp, dp_rank = engine.world_size, engine.dp_rank
    losses, norms = [], []
    for batch in batches:
        step_loss = 0.0
        for k in range(gas):
            row = (k * dp + dp_rank) * MICRO
            loss = engine(batch[row : row + MICRO])
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / gas
        total = torch.tensor([step_loss])
        torch.distributed.all_reduce(total, group=engine.dp_group)
        losses.append(total.item() / dp)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)
