"""Which samples a curriculum allows: the data clusters of DeepSpeed's curriculum sampler (leader rank only).

A cluster is the set of samples that became allowed when the difficulty rose (value-based: metric values in
(previous, current]; percentile-based: the samples from the previous to the current percentile of the
metric order). Each cluster is shuffled once and written to `data_cluster_path` as an indexed dataset of one
row; batches draw from the clusters in proportion to their sizes, and a cluster drawn to its end is
reshuffled. Draws use the sampler's `torch.Generator` (DeepSpeed uses a NumPy one; the library needs no
NumPy): the same rules and distribution as DeepSpeed, not the same random stream.

Difference from DeepSpeed: DeepSpeed rewrites a reshuffled cluster in place, so a checkpoint saved before the
reshuffle no longer finds the order it was reading. Here each reshuffle is a new file (`<cluster>.shuffle<n>`) and
the checkpoint names the file it read from, so a resumed run reads exactly what the uninterrupted one read
(the cost: one more file of the cluster's size per pass through it).
"""

from __future__ import annotations

import os

import torch

from shardspeed.config.data_efficiency import CurriculumLearningConfig

from .indexed_dataset import MMapIndexedDataset, write_rows

__all__ = ["ClusterStore"]


class ClusterStore:
    """The clusters of one curriculum sampler and the metric indices they are cut from."""

    def __init__(self, config: CurriculumLearningConfig, one_epoch_samples: int, index_dtype, generator):
        self.folder = config.data_cluster_path
        self.metrics = config.curriculum_metrics
        self.one_epoch_samples = one_epoch_samples
        self.index_dtype = index_dtype
        self.generator = generator  # the sampler's: every shuffle and draw is one stream, as in DeepSpeed
        os.makedirs(self.folder, exist_ok=True)
        self.index_to_sample = {}
        self.index_to_metric = {}
        for name, metric in self.metrics.items():
            if metric.clustering_type == "single_cluster":
                continue
            self.index_to_sample[name] = MMapIndexedDataset(metric.index_to_sample_path)
            if metric.difficulty_type == "value":
                self.index_to_metric[name] = MMapIndexedDataset(metric.index_to_metric_path)
        self.names: list[str] = []  # cluster file names (DeepSpeed's data_cluster_paths)
        self.positions: list[int] = []  # next unread place in each (data_cluster_current_position)
        self.clusters: list[torch.Tensor] = []

    # -- making a cluster when the difficulty rises --------------------------------------------------------

    def add_cluster(self, previous: dict, current: dict) -> None:
        """Cut the cluster of the samples allowed between `previous` and `current` difficulties; write it."""
        samples = self._new_samples(previous, current)
        if samples is None or len(samples) == 0:
            return  # nothing newly allowed (DeepSpeed logs and skips too)
        samples = self._shuffled(samples.long())
        name = "cluster" + "".join(f"_{metric}{current[metric]}" for metric in self.metrics)
        self._write(name, samples)
        self.names.append(name)
        self.positions.append(0)
        self.clusters.append(samples)

    def _new_samples(self, previous: dict, current: dict):
        clustered = [name for name, m in self.metrics.items() if m.clustering_type != "single_cluster"]
        if len(clustered) > 1:
            # several metrics: the samples every metric allows so far, less those already in a cluster
            allowed = None
            for name in self.metrics:
                if name in clustered:
                    upto = self._cut(name, self._lowest(name), current[name])
                else:
                    upto = torch.arange(self.one_epoch_samples)
                if upto is None:
                    return None
                allowed = upto if allowed is None else allowed[torch.isin(allowed, upto)]
            for cluster in self.clusters:
                allowed = allowed[~torch.isin(allowed, cluster)]
            return torch.sort(allowed.long()).values  # sorted, as NumPy's set operations leave it
        samples = torch.arange(self.one_epoch_samples) if not self.clusters else None
        for name in clustered:
            samples = self._cut(name, previous[name], current[name])
        return samples

    def _lowest(self, name: str):
        return float("-inf") if self.metrics[name].difficulty_type == "value" else 0

    def _cut(self, name: str, start, end):
        if self.metrics[name].difficulty_type == "value":
            return self._by_value(name, start, end)
        return self._by_percentile(name, start, end)

    def _by_value(self, name: str, start, end):
        """Samples whose metric value v has start < v <= end."""
        samples, values = self.index_to_sample[name], self.index_to_metric[name]
        rows = [samples[row].long() for row in range(len(samples)) if start < int(values[row][0]) <= end]
        return torch.cat(rows) if rows else None

    def _by_percentile(self, name: str, start: int, end: int):
        """Samples from the `start`-th to the `end`-th percentile of the metric order (max_difficulty is 100%)."""
        rows = self.index_to_sample[name]
        flat = torch.cat([rows[row].long() for row in range(len(rows))])
        top = self.metrics[name].max_difficulty
        per_percentile = len(flat) // top
        last = len(flat) if end == top else per_percentile * end
        picked = flat[per_percentile * start : last]
        return picked if len(picked) else None

    # -- drawing -------------------------------------------------------------------------------------------

    def _shuffled(self, samples: torch.Tensor) -> torch.Tensor:
        return samples[torch.randperm(len(samples), generator=self.generator)]

    def draw_counts(self, batch_size: int) -> list[int]:
        """How many samples of a global batch come from each cluster (chosen in proportion to their sizes)."""
        if not self.clusters:
            raise ValueError(
                f"curriculum sampling: no sample is allowed yet (the difficulties so far allow none of the "
                f"{self.one_epoch_samples} samples); lower min_difficulty or check the metric files"
            )
        sizes = torch.tensor([float(len(c)) for c in self.clusters])
        choice = torch.multinomial(sizes, batch_size, replacement=True, generator=self.generator)
        return torch.bincount(choice, minlength=len(self.clusters)).tolist()

    def take(self, cidx: int, count: int) -> list[int]:
        """The next `count` samples of cluster `cidx`; at its end it is reshuffled and reading starts over."""
        start = self.positions[cidx]
        samples = self.clusters[cidx][start : start + count].tolist()
        self.positions[cidx] += count
        if len(samples) < count:
            rest = count - len(samples)
            reshuffled = self._shuffled(self.clusters[cidx])
            base, generation = _split_generation(self.names[cidx])
            self.names[cidx] = f"{base}.shuffle{generation + 1}"
            self._write(self.names[cidx], reshuffled)
            self.clusters[cidx] = reshuffled
            samples += reshuffled[:rest].tolist()
            self.positions[cidx] = rest
        return samples

    def shuffle_list(self, items: list) -> list:
        return [items[i] for i in torch.randperm(len(items), generator=self.generator).tolist()]

    # -- files ---------------------------------------------------------------------------------------------

    def _write(self, name: str, samples: torch.Tensor) -> None:
        write_rows(os.path.join(self.folder, name), [samples], self.index_dtype)

    def reopen(self, names: list[str], positions: list[int]) -> None:
        """Read back the clusters a checkpoint names (a path from an older DeepSpeed checkpoint: its name)."""
        self.names = [name.rsplit("/", 1)[-1] for name in names]
        self.positions = list(positions)
        self.clusters = [MMapIndexedDataset(os.path.join(self.folder, n))[0].long() for n in self.names]


def _split_generation(name: str) -> tuple[str, int]:
    """A cluster file name's first name and how often it was reshuffled: `cluster_seqlen64.shuffle3` ->
    (`cluster_seqlen64`, 3)."""
    head, sep, tail = name.rpartition(".shuffle")
    return (head, int(tail)) if sep and tail.isdigit() else (name, 0)
