"""AutoEP folded onto AutoTP: the rank layout when expert parallelism reuses the tensor-parallel ranks
(DeepSpeed 0.19.8's `module_inject.auto_ep_folding`), and the checks a folded configuration must pass.

With `tensor_parallel.autotp_size` = t > 1 and `expert_parallel.autoep_size` = e, one pipeline stage of S
ranks holds S/t dense data-parallel replicas of t tensor ranks (tensor ranks neighbours, as the AutoTP grid
lays them out). Expert parallelism does not take its groups from the data axis alone: its groups are runs
of e consecutive stage ranks, so an expert group may span tensor lanes (the ranks of one tensor group see
the same tokens and split the routed assignments between them, ep_tp_dispatch.py). For world 8, t 2, e 4:

    tensor groups     (0,1) (2,3) (4,5) (6,7)      dense data-parallel groups (0,2,4,6) (1,3,5,7)
    expert groups     (0,1,2,3) (4,5,6,7)          expert-data-parallel groups (0,4) (1,5) (2,6) (3,7)

Consecutive expert groups keep an expert group inside one node when ranks are numbered node by node.
Everything here is arithmetic on sizes: nothing needs a process group, except what a caller puts in
`FoldingGroupHandles`. How folded gradients are corrected lives in folding_grads.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "FoldingGroupHandles",
    "FoldingGroupTables",
    "ParallelFoldingSpec",
    "assert_group_matches_spec",
    "build_folding_spec",
    "expected_folding_group_tables",
    "local_folding_ranks",
    "validate_folding_global",
]


@dataclass(frozen=True)
class ParallelFoldingSpec:
    """The sizes of one folded layout; `stage_size` = world / pp, `dp_size` = stage / tp, `edp_size` =
    stage / (ep * etp). `mp_mode` "tp": tensor lanes share tokens; "sp": no tensor folding (tp 1)."""

    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    """Every group of each kind, as tuples of global ranks (in the order groups are created)."""

    tp_groups: tuple[tuple[int, ...], ...]
    dense_dp_groups: tuple[tuple[int, ...], ...]
    ep_groups: tuple[tuple[int, ...], ...]
    edp_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FoldingGroupHandles:
    """This rank's four groups (process-group handles) and their rank lists, for one folded layout."""

    spec: ParallelFoldingSpec
    tp_group: object
    dense_dp_group: object
    ep_group: object
    edp_group: object
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def build_folding_spec(
    *, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1, mp_mode: str = "tp"
) -> ParallelFoldingSpec:
    """The folded layout of these sizes; a size that does not tile the world is refused, naming the valid
    values."""
    for name, value in (
        ("world_size", world_size),
        ("pp_size", pp_size),
        ("tensor_parallel.autotp_size", tp_size),
        ("expert_parallel.autoep_size", ep_size),
        ("expert_parallel.expert_tensor_parallel_size", etp_size),
    ):
        _check_positive(name, value)
    if mp_mode not in ("tp", "sp"):
        raise ValueError(f"mp_mode must be 'tp' or 'sp', got {mp_mode!r}")
    if world_size % pp_size:
        raise ValueError(
            f"pp_size={pp_size} must divide world_size={world_size}. Valid pp_size values: {_divisors(world_size)}"
        )
    stage = world_size // pp_size
    if stage % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp_size} must divide the stage size (world_size={world_size} / "
            f"pp_size={pp_size} = {stage}); the data-parallel size would not be whole. Valid autotp_size "
            f"values: {_divisors(stage)}"
        )
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(
            f"expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size ({ep_size} * {etp_size} "
            f"= {width}) must divide the stage size (world_size={world_size} / pp_size={pp_size} = {stage}); "
            f"the expert-data-parallel size would not be whole. Valid expert-width values: {_divisors(stage)}"
        )
    return ParallelFoldingSpec(
        world_size=world_size,
        pp_size=pp_size,
        stage_size=stage,
        tp_size=tp_size,
        dp_size=stage // tp_size,
        ep_size=ep_size,
        etp_size=etp_size,
        edp_size=stage // width,
        mp_mode=mp_mode,
    )


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """The four kinds of groups of `spec`, stage by stage (the layout in the module docstring)."""
    tp, dense, ep, edp = [], [], [], []
    for first in range(0, spec.world_size, spec.stage_size):
        stage = tuple(range(first, first + spec.stage_size))
        tp += [stage[i : i + spec.tp_size] for i in range(0, spec.stage_size, spec.tp_size)]
        dense += [stage[lane :: spec.tp_size] for lane in range(spec.tp_size)]
        expert_groups = [stage[i : i + spec.ep_size] for i in range(0, spec.stage_size, spec.ep_size)]
        ep += expert_groups
        # the ranks holding the same experts: the same position in every expert group of the stage
        edp += [tuple(group[position] for group in expert_groups) for position in range(spec.ep_size)]
    return FoldingGroupTables(tuple(tp), tuple(dense), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The groups `global_rank` belongs to: {"tp", "dense_dp", "ep", "edp"} -> its group's ranks."""
    if not 0 <= global_rank < spec.world_size:
        raise ValueError(f"global_rank={global_rank} is outside world_size={spec.world_size}")
    tables = expected_folding_group_tables(spec)
    kinds = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups}
    kinds["edp"] = tables.edp_groups
    return {kind: next(g for g in groups if global_rank in g) for kind, groups in kinds.items()}


def _mpu_size(mpu, *getters: str) -> int | None:
    for name in getters:
        getter = getattr(mpu, name, None) if mpu is not None else None
        if getter is not None:
            return getter()
    return None


def validate_folding_global(
    spec: ParallelFoldingSpec,
    *,
    zero_stage: int = 0,
    sp_size: int = 1,
    deepcompile_enabled: bool = False,
    use_data_before_expert_parallel: bool = False,
    mpu=None,
    autoep_enabled: bool = True,
    tp_preset: str | None = None,
    ep_preset: str | None = None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """Refuse what a folded layout cannot run, before any group exists (ValueError naming the setting).

    `zero_stage` is DeepSpeed's argument; stage 3 with AutoEP is refused where AutoEP is applied, folded
    or not (apply.py), so it is not checked again here."""
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if deepcompile_enabled and folded:
        raise ValueError(
            "DeepCompile with AutoEP+AutoTP folding is not supported: disable compile.deepcompile or use "
            "tensor_parallel.autotp_size=1"
        )
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding supports pp_size=1 only; got pp_size={spec.pp_size}")
    if folded and sp_size > 1:
        raise ValueError(
            "tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive for AutoEP "
            f"folding (autotp_size={spec.tp_size}, sp_size={sp_size})"
        )
    if spec.etp_size != 1:
        raise ValueError(
            f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved for tensor parallelism "
            "inside each expert, which is not built; use expert_tensor_parallel_size=1"
        )
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError(
            "tensor_parallel.preset_model and expert_parallel.preset_model must match when both are set "
            f"(tensor_parallel.preset_model={tp_preset!r}, expert_parallel.preset_model={ep_preset!r})"
        )
    if folded and spec.ep_size == 1:
        # every tensor lane would run every expert on the same tokens: each routed gradient counted t times
        raise ValueError(
            "AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1 (with autoep_size=1 every tensor "
            "lane would compute every routed token)"
        )
    if folded and use_data_before_expert_parallel:
        raise ValueError(
            "use_data_before_expert_parallel_ is not supported with AutoEP+AutoTP folding; disable it"
        )
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError(
            "ZeRO optimizer/parameter offload with AutoEP+AutoTP folding is not supported; disable offload "
            "or use tensor_parallel.autotp_size=1"
        )
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(
            f"mpu tensor/model parallel world size ({mpu_tp}) conflicts with "
            f"tensor_parallel.autotp_size={spec.tp_size}"
        )
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}")


def _as_rank_tuples(groups: Iterable[Iterable[int]]) -> set[tuple[int, ...]]:
    return {tuple(int(r) for r in group) for group in groups}


def assert_group_matches_spec(
    existing_rank_lists, spec: ParallelFoldingSpec, *, group_kind: str = "ep_edp"
) -> None:
    """Raise RuntimeError when already-built expert / expert-data-parallel rank lists (a pair, or a dict with
    "ep" and "edp") are not groups of `spec`: a group registered for another layout must not be reused."""
    if group_kind != "ep_edp":
        raise ValueError(f"group_kind must be 'ep_edp', got {group_kind!r}")
    tables = expected_folding_group_tables(spec)
    if isinstance(existing_rank_lists, dict):
        observed_ep, observed_edp = existing_rank_lists.get("ep", ()), existing_rank_lists.get("edp", ())
    else:
        observed_ep, observed_edp = existing_rank_lists
    for kind, observed, expected in (
        ("expert-parallel", observed_ep, tables.ep_groups),
        ("expert-data-parallel", observed_edp, tables.edp_groups),
    ):
        stale = sorted(_as_rank_tuples(observed) - _as_rank_tuples(expected))
        if stale:
            raise RuntimeError(f"Cached {kind} group {stale[0]} does not match folding spec {spec}")
