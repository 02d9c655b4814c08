"""Hugging Face `tp_plan`s as AutoTP layer rules (DeepSpeed's `TPPlanConverter` and `_get_hf_tp_plan`).

A Transformers model states its own tensor-parallel layout: `config.base_model_tp_plan` for the base model
(`{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise", ...}`) and the model
class's `_tp_plan` for what sits around it (`{"lm_head": "colwise_gather_output"}`). `hf_tp_plan(model)`
merges them; `TPPlanConverter.convert(plan)` turns them into `TPLayerSpec`s, which `initialize` uses to shard
the model when the config names no `partition_config` — so a model AutoTP's names do not know (an encoder
with `attention.output`) is placed by its own plan.

Styles: colwise -> column; colwise_rep / colwise_gather_output -> column with the output gathered; rowwise
-> row; embedding_rowwise -> skip (the embedding stays whole); replicated_with_grad_allreduce -> skip with
the gradient summed over the tensor group. Any other style refuses the whole plan: applying only part of it
could shard one half of a column/row pair.
"""

from __future__ import annotations

from shardspeed.module_inject.autotp_config import PartitionType, TPLayerSpec

__all__ = ["SUPPORTED_STYLES", "TPPlanConverter", "hf_tp_plan"]

SUPPORTED_STYLES = {
    "colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
    "embedding_rowwise",
}  # fmt: skip


def hf_tp_plan(model) -> dict[str, str] | None:
    """The model's merged tp_plan (config's base-model plan, then the class's, then the instance's), or None.

    Transformers may set an instance `_tp_plan` that repeats the base plan with a `model.` prefix; such an
    entry is dropped when its unprefixed pattern is already there, so no layer gets two rules.
    """
    config = getattr(model, "config", None)
    sources = (
        getattr(config, "base_model_tp_plan", None) if config is not None else None,
        getattr(type(model), "_tp_plan", None),
        getattr(model, "__dict__", {}).get("_tp_plan"),  # the instance's own, not the class attribute again
    )
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in sources:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            unprefixed = pattern.removeprefix("model.")
            if pattern.startswith("model.") and unprefixed in seen:
                continue
            merged[pattern] = style
            seen.add(unprefixed)
    return merged or None


class TPPlanConverter:
    """Hugging Face tp_plan -> `TPLayerSpec` list."""

    @staticmethod
    def convert(plan: dict[str, str]) -> list[TPLayerSpec] | None:
        """One spec per plan entry, in order; None for an empty plan (nothing to place by)."""
        if not plan:
            return None
        unsupported = sorted({style for style in plan.values() if str(style).lower() not in SUPPORTED_STYLES})
        if unsupported:
            raise ValueError(
                f"Hugging Face tp_plan contains unsupported partition style(s): {unsupported}. The plan is refused "
                "as a whole (applying part of it could shard one half of a column/row pair); give "
                "tensor_parallel.partition_config for this model instead"
            )
        specs = []
        for pattern, style in plan.items():
            style = style.lower()
            regex = TPPlanConverter._wildcard_to_regex(pattern)
            regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
            if style.startswith("colwise"):
                spec = TPLayerSpec([regex], PartitionType.COLUMN, gather_output=style != "colwise")
            elif style == "rowwise":
                spec = TPLayerSpec([regex], PartitionType.ROW)
            else:  # embedding_rowwise keeps the embedding whole; the replicated style sums its gradient
                spec = TPLayerSpec([regex], PartitionType.SKIP, grad_allreduce=style != "embedding_rowwise")
            specs.append(spec)
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        """`layers.*.q_proj` -> `.*layers\\..*\\.q_proj` (dots literal, `*` any run, matched anywhere)."""
        return ".*" + pattern.replace(".", r"\.").replace("*", ".*")
