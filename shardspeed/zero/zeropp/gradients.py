"""qgZ: ZeRO-3's gradient reduce-scatter done as a quantized, hierarchical all-to-all (ZeRO++).

A bucket's gradient buffer holds N slices of S elements, slice r for data-parallel rank r; the plain path
reduce-scatters it so that rank r receives the sum of every rank's slice r. With N = M nodes x L ranks
per node and rank r = m·L + l (node m, local index l):

1. inside the node: each rank quantizes all N slices to int4 (quantize.py) and sends, in one all-to-all
   over its node's L ranks, to local rank l' the M slices meant for ranks (0, l'), (1, l'), ... (M-1, l');
   it receives L such sets for its own local index, dequantizes them and sums them in fp32: M partial
   sums, one per node, each over this node's L ranks;
2. across nodes: it quantizes those M partial sums to int4 again and sends, in one all-to-all over the M
   ranks with its local index, partial sum m' to node m'; the M partial sums of its own slice it receives
   add up to the full sum.

The result lands where the plain reduce-scatter puts it (this rank's slice of the buffer), and the
reducer averages it as before. What crosses nodes per rank is M int4 slices — ~Ψ/(2L) bytes for Ψ
parameters — instead of the 16-bit buffer's 2Ψ. As in DeepSpeed, the partial sums are quantized twice
(an error of up to half a quantization step of each block's largest value, each time); non-finite
gradients come out as nan, so fp16 overflow detection still sees them. A node of one rank skips step 1
and a single node skips step 2 (nothing is quantized where nothing is sent).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_to_all_single, completed_work, then
from shardspeed.zero.zeropp.quantize import BlockLayout, dequantize, quantize

__all__ = ["QuantizedGradientReduce"]


class QuantizedGradientReduce:
    """`reduce(own, staging, bucket)`: the reducer's reduce-scatter, as qgZ's two quantized all-to-alls."""

    def __init__(self, node_groups):
        self.intra, self.inter = node_groups.intra_node, node_groups.inter_node
        self.local_size, self.num_nodes = node_groups.local_size, node_groups.num_nodes
        self.world = self.local_size * self.num_nodes
        local = dist.get_rank(self.intra) if self.local_size > 1 else 0
        node = dist.get_rank(self.inter) if self.num_nodes > 1 else 0
        self.rank = node * self.local_size + local
        # step 1 sends slices grouped by the local index of the rank they are meant for, and receives from
        # each local rank the slices of the ranks with this local index; step 2 sends those M partial sums
        self.by_local_index = [
            m * self.local_size + i for i in range(self.local_size) for m in range(self.num_nodes)
        ]
        self.my_column = [m * self.local_size + local for m in range(self.num_nodes)]
        self._layouts: dict[int, BlockLayout] = {}  # id(bucket) -> its int4 blocks, worked out once
        self._orders: dict = {}

    def _order(self, device: torch.device) -> torch.Tensor:
        if device not in self._orders:  # made once per device: no host-to-device copy per bucket
            self._orders[device] = torch.tensor(self.by_local_index, device=device)
        return self._orders[device]

    def layout(self, bucket) -> BlockLayout:
        if id(bucket) not in self._layouts:
            self._layouts[id(bucket)] = BlockLayout.for_gradients(bucket)
        return self._layouts[id(bucket)]

    def __call__(self, own: torch.Tensor, staging: torch.Tensor, bucket):
        """Start reducing `staging` (N slices of `bucket`'s layout); `own` (this rank's slice of it) receives
        the sum on `wait()`."""
        slices = staging.view(self.world, -1)
        layout = self.layout(bucket)
        if self.local_size == 1:  # one rank per node: its slices are already its node's partial sums
            sums = slices.float()
            return then(completed_work(), lambda: self._across_nodes(own, sums, layout))
        records = quantize(slices.index_select(0, self._order(staging.device)), layout, self.by_local_index)
        received = torch.empty_like(records)
        work = all_to_all_single(received.view(-1), records.view(-1), group=self.intra, async_op=True)

        def finish() -> None:
            values = dequantize(received, layout, self.my_column * self.local_size)
            self._across_nodes(own, values.view(self.local_size, self.num_nodes, -1).sum(dim=0), layout)

        return then(work, finish)

    def _across_nodes(self, own: torch.Tensor, node_sums: torch.Tensor, layout: BlockLayout) -> None:
        """Step 2: partial sum m' to node m'; this rank's M partial sums add up in `own`."""
        if self.num_nodes == 1:
            own.copy_(node_sums[0])
            return
        records = quantize(node_sums, layout, self.my_column)
        received = torch.empty_like(records)
        all_to_all_single(received.view(-1), records.view(-1), group=self.inter)
        own.copy_(dequantize(received, layout, [self.rank] * self.num_nodes).sum(dim=0))
