"""`DeepSpeedDataSampler`: curriculum batches over metric-indexed data (DeepSpeed's data-efficiency sampler).

A batch sampler for `DataLoader(batch_sampler=...)`. Every global batch (micro batch x data-parallel ranks x
accumulation steps) the curriculum advances one step; when a metric's difficulty rises, the samples it newly
allows become a cluster (clusters.py). The leader (data-parallel rank 0) draws the global batch from the
clusters, shuffles it, and broadcasts it to the data-parallel group; each rank then yields its slice of each
micro batch, in turn. Only the leader reads the metric indices and writes cluster files.

Draws follow DeepSpeed's rules with one random generator seeded with `data_efficiency.seed`, used in
DeepSpeed's order (shuffle a new cluster, choose clusters for the batch, shuffle the batch). It is a
`torch.Generator` where DeepSpeed's is NumPy's (the library needs no NumPy), so the batches have DeepSpeed's
distribution but not its exact random stream.

State (`state_dict`, saved by the engine as `data_sampler`): the rest of the current global batch, samples
consumed, the curriculum step and difficulties, the cluster files and read positions, and the generator's
state. Difference from DeepSpeed: DeepSpeed saves the *global* numpy RNG (`np.random.get_state()`), not the
sampler's generator, so a resumed run draws different batches; here the sampler's own generator is saved and
a resumed run draws the same batches as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardspeed.config.data_efficiency import DataEfficiencyConfig

from .clusters import ClusterStore
from .curriculum_scheduler import CurriculumScheduler
from .indexed_dataset import find_fit_int_dtype

__all__ = ["DeepSpeedDataSampler"]


class DeepSpeedDataSampler:
    """DeepSpeed's constructor arguments; `data_efficiency_config` is the typed block or DeepSpeed's dict."""

    def __init__(
        self,
        data_efficiency_config: DataEfficiencyConfig | dict[str, Any],
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group,
        gradient_accumulation_steps: int,
        global_rank: int,
        drop_last: bool = True,
    ):
        config = _as_config(data_efficiency_config)
        curriculum = config.data_sampling.curriculum_learning
        if not curriculum.enabled:
            raise ValueError(
                "DeepSpeedDataSampler needs data_efficiency.data_sampling.curriculum_learning enabled (without a "
                "curriculum the engine's ordinary sampler is used)"
            )
        if (
            micro_batch_size <= 0
            or data_parallel_size <= 0
            or not 0 <= data_parallel_rank < data_parallel_size
        ):
            raise ValueError(
                f"DeepSpeedDataSampler: micro_batch_size {micro_batch_size}, data-parallel rank "
                f"{data_parallel_rank} of {data_parallel_size}"
            )
        self.data_efficiency_config = config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * config.data_sampling.num_epochs
        if self.total_samples <= 0:
            raise ValueError(f"DeepSpeedDataSampler: no sample to draw ({self.total_samples})")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.curriculum_schedulers = {
            name: CurriculumScheduler(metric) for name, metric in curriculum.curriculum_metrics.items()
        }
        self.is_leader = data_parallel_rank == 0
        self.clusters = None  # only the leader reads the metric indices and writes clusters
        if self.is_leader:
            self.clusters = ClusterStore(
                curriculum, one_epoch_total_samples, self.index_dtype, self.generator
            )

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict) -> None:
        for metric, scheduler in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[metric])

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice of a micro batch of `batch_len` samples (all ranks' micro batches together)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        start = round(self.data_parallel_rank * batch_len / self.data_parallel_size)
        end = round((self.data_parallel_rank + 1) * batch_len / self.data_parallel_size)
        return start, end

    # -- one global batch ----------------------------------------------------------------------------------

    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and fill `self.batch` with the next global batch (collective)."""
        self.curriculum_step += 1
        previous, rose = {}, False
        for name, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            if self.current_difficulties.get(name) != difficulty:
                rose = True
            metric = self.data_efficiency_config.data_sampling.curriculum_learning.curriculum_metrics[name]
            lowest = float("-inf") if metric.difficulty_type == "value" else 0
            previous[name] = self.current_difficulties.get(name, lowest)
            self.current_difficulties[name] = difficulty
        batch = torch.full((self.global_batch_size,), -1, dtype=torch.long)
        if self.is_leader:
            if rose:
                self.clusters.add_cluster(previous, self.current_difficulties)
            drawn: list[int] = []
            for cidx, count in enumerate(self.clusters.draw_counts(self.global_batch_size)):
                drawn += self.clusters.take(cidx, count)
            drawn = self.clusters.shuffle_list(drawn)
            batch[: len(drawn)] = torch.tensor(drawn, dtype=torch.long)
        if self.data_parallel_size > 1:  # the leader's batch to every rank; -1 pads a batch it could not fill
            batch = _from_leader(batch, self.data_parallel_group)
        self.batch = batch[batch != -1].tolist()

    def __iter__(self):
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current = self.batch[: self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size :]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                # counted before the yield (DeepSpeed counts after): a checkpoint taken while this batch
                # trains holds the true count
                self.consumed_samples += len(current)
                yield current[start:end]

    # -- checkpoint state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        store = self.clusters
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "data_cluster_paths": list(store.names) if store is not None else [],
            "data_cluster_current_position": list(store.positions) if store is not None else [],
            "np_rng_state": self.generator.get_state(),  # DeepSpeed's key; the sampler's generator here
            "scheduler_difficulties": {
                n: s.current_difficulty for n, s in self.curriculum_schedulers.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = list(state["batch"])
        self.consumed_samples = state["consumed_samples"]
        self.curriculum_step = state["curriculum_step"]
        self.current_difficulties = dict(state["current_difficulties"])
        rng_state = state["np_rng_state"]
        if not isinstance(rng_state, torch.Tensor):
            raise ValueError(
                "data_sampler: np_rng_state is not the sampler's generator state (a DeepSpeed checkpoint saves the "
                "global NumPy RNG instead, from which the sampler's draws cannot be resumed)"
            )
        self.generator.set_state(rng_state)
        for name, difficulty in state.get("scheduler_difficulties", self.current_difficulties).items():
            self.curriculum_schedulers[name].current_difficulty = difficulty
        if self.clusters is not None:
            self.clusters.reopen(state["data_cluster_paths"], state["data_cluster_current_position"])


def _as_config(config) -> DataEfficiencyConfig:
    if isinstance(config, DataEfficiencyConfig):
        return config
    from shardspeed.config.build import BuildContext, build_block

    return build_block(DataEfficiencyConfig, config, "data_efficiency", BuildContext())


def _from_leader(batch: torch.Tensor, group) -> torch.Tensor:
    """`batch` as data-parallel rank 0 of `group` (None: the world) holds it, on every rank of the group (one
    broadcast of global-batch-size int64s per global batch; on the GPU when the group is NCCL's)."""
    on_gpu = dist.get_backend(group) == "nccl"
    batch = batch.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))
    dist.broadcast(batch, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return batch.cpu()
