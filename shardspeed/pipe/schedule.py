"""Pipeline schedules as plain instruction lists: what one stage does, in order, for one batch.

A schedule is data, not control flow: `TrainSchedule(micro_batches, stages, stage_id).steps()` returns a
list of `PipeInstruction`s that can be printed, compared and tested without any process group; the engine
(`runtime/pipeline_engine.py`) executes them one by one. The instruction names are DeepSpeed's.

`TrainSchedule` is 1F1B ("one forward, one backward"): stage s first runs `stages - s - 1` warm-up forwards,
then alternates a forward with a backward, then drains the remaining backwards. At most `stages - s`
micro-batches are in flight on stage s (their activations are what a stage keeps), instead of all of them
as in GPipe; the idle "bubble" is (stages - 1) / (micro_batches + stages - 1) of the batch time.

`InterleavedTrainSchedule` (beyond DeepSpeed; Megatron's interleaved 1F1B) runs v model chunks per rank (a
`PipelineModule` with `virtual_stages=v`): chunk c of rank r is part c * p + r of the layers, so a
micro-batch passes every rank v times. Forwards go through micro-batches in groups of p per chunk (chunk 0 of
micro-batches 0..p-1, chunk 1 of the same, ..., then the next p micro-batches), backwards in the mirror order,
with `2 (p - r - 1) + (v - 1) p` warm-up forwards on rank r. Each chunk is 1/v of a stage's work, so the fill
and drain of the pipeline cost about 1/v as much: the bubble is about (p - 1) / (v m + p - 1).

Sends are non-blocking and every receive is matched by a send its peer issues earlier in its own list, in
the same order (activations flow down, gradients up; each direction between two parts is FIFO), so no order
of execution can deadlock; `simulate` checks this for any set of instruction lists.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "InferenceSchedule",
    "InterleavedTrainSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
    "simulate",
]


@dataclass(frozen=True)
class PipeInstruction:
    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, repr=False)
class MicroBatchInstruction(PipeInstruction):
    micro_batch: int
    chunk: int = 0  # which of this rank's model chunks (virtual stages); always 0 without interleaving
    buffer_id: int | None = None  # in DeepSpeed's step view (`ticks()`): the pipe buffer the micro-batch uses

    def __repr__(self) -> str:
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        buffer = f", buffer_id={self.buffer_id}" if self.buffer_id is not None else ""
        return f"{type(self).__name__}(micro_batch={self.micro_batch}{chunk}{buffer})"


class LoadMicroBatch(MicroBatchInstruction):
    """First stage: take the micro-batch's inputs; last stage: its labels."""


class ForwardPass(MicroBatchInstruction):
    pass


class BackwardPass(MicroBatchInstruction):
    pass


class SendActivation(MicroBatchInstruction):
    pass


class RecvActivation(MicroBatchInstruction):
    pass


class SendGrad(MicroBatchInstruction):
    pass


class RecvGrad(MicroBatchInstruction):
    pass


class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages holding them."""


class ReduceGrads(PipeInstruction):
    """Average gradients over the data-parallel replicas of this stage."""


class OptimizerStep(PipeInstruction):
    pass


class PipeSchedule:
    chunks = 1  # model chunks per rank

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(
                f"bad schedule: micro_batches={micro_batches} stages={stages} stage_id={stage_id}"
            )
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.is_first_stage = stage_id == 0
        self.is_last_stage = stage_id == stages - 1

    def is_first_part(self, chunk: int) -> bool:
        """Whether `chunk` of this rank is the model's first part (it reads the inputs)."""
        return self.is_first_stage and chunk == 0

    def is_last_part(self, chunk: int) -> bool:
        """Whether `chunk` of this rank is the model's last part (it reads the labels, computes the loss)."""
        return self.is_last_stage and chunk == self.chunks - 1

    def steps(self) -> list[PipeInstruction]:
        raise NotImplementedError

    # -- DeepSpeed's view of the same schedule: lockstep steps ------------------------------------------------
    # DeepSpeed's schedules are iterated step by step, each step a list of instructions (empty while the
    # stage waits), every stage taking the same number of steps; a stage sends what it computed one step
    # after computing it, when its peer is ready to receive it. The engine runs `steps()`; `ticks()` lays the
    # same per-stage order of forwards and backwards out in those steps, with DeepSpeed's buffer ids.

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def prev_stage(self) -> int:
        return self.stage_id - 1

    @property
    def next_stage(self) -> int:
        return self.stage_id + 1

    def num_pipe_buffers(self) -> int:
        """Micro-batches whose tensors this stage holds at once (DeepSpeed allocates that many buffers)."""
        return 2

    def ticks(self) -> list[list[PipeInstruction]]:
        raise NotImplementedError(
            f"{type(self).__name__} has no lockstep view (DeepSpeed has no such schedule); use steps()"
        )

    def __iter__(self):
        """DeepSpeed's iteration: one list of instructions per step (see `ticks`)."""
        return iter(self.ticks())

    def _valid(self, micro_batch: int) -> bool:
        return 0 <= micro_batch < self.micro_batches

    def _buffered(self, kind: type, micro_batch: int) -> MicroBatchInstruction:
        return kind(micro_batch, buffer_id=micro_batch % self.num_pipe_buffers())

    def _forward(self, mb: int, chunk: int = 0) -> list[PipeInstruction]:
        first, last = self.is_first_part(chunk), self.is_last_part(chunk)
        out: list[PipeInstruction] = []
        if not first:
            out.append(RecvActivation(mb, chunk))
        if first or last:
            out.append(LoadMicroBatch(mb, chunk))
        out.append(ForwardPass(mb, chunk))
        if not last:
            out.append(SendActivation(mb, chunk))
        return out

    def _backward(self, mb: int, chunk: int = 0) -> list[PipeInstruction]:
        out: list[PipeInstruction] = []
        if not self.is_last_part(chunk):
            out.append(RecvGrad(mb, chunk))
        out.append(BackwardPass(mb, chunk))
        if not self.is_first_part(chunk):
            out.append(SendGrad(mb, chunk))
        return out


class TrainSchedule(PipeSchedule):
    """1F1B training over `micro_batches`, then the gradient reductions and the optimizer step."""

    def warmup(self) -> int:
        return min(self.stages - self.stage_id - 1, self.micro_batches)

    def steps(self) -> list[PipeInstruction]:
        warmup = self.warmup()
        out: list[PipeInstruction] = []
        for mb in range(warmup):
            out += self._forward(mb)
        for i in range(self.micro_batches - warmup):  # steady state: forward mb warmup+i, backward mb i
            out += self._forward(warmup + i)
            out += self._backward(i)
        for mb in range(self.micro_batches - warmup, self.micro_batches):
            out += self._backward(mb)
        return out + [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def max_in_flight(self) -> int:
        """Micro-batches whose activations this stage holds at once."""
        return self.warmup() + 1

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.max_in_flight(), self.micro_batches))

    def _slot(self, step: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of this stage's work at `step`: stage s runs the forward of micro-batch m
        at step 2m + s and its backward at step 2m + 2 stages - s - 1, so every activation reaches the next
        stage, and every gradient the previous one, exactly one step after it was computed."""
        if (step - self.stage_id) % 2 == 0:
            return (step - self.stage_id) // 2, True
        return (step - 2 * self.stages + self.stage_id + 1) // 2, False

    def ticks(self) -> list[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        out: list[list[PipeInstruction]] = []
        for step in range(total):
            micro_batch, forward = self._slot(step)
            previous, _ = self._slot(step - 1)  # what this stage computed one step ago (the other kind)
            cmds: list[PipeInstruction] = []
            if forward:
                if self._valid(previous) and not self.is_first_stage:
                    cmds.append(self._buffered(SendGrad, previous))
                if self._valid(micro_batch) and not self.is_first_stage:
                    cmds.append(self._buffered(RecvActivation, micro_batch))
            else:
                if self._valid(micro_batch) and not self.is_last_stage:
                    cmds.append(self._buffered(RecvGrad, micro_batch))
                if self._valid(previous) and not self.is_last_stage:
                    cmds.append(self._buffered(SendActivation, previous))
            if self._valid(micro_batch):
                if forward and (self.is_first_stage or self.is_last_stage):
                    cmds.append(self._buffered(LoadMicroBatch, micro_batch))
                cmds.append(self._buffered(ForwardPass if forward else BackwardPass, micro_batch))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            out.append(cmds)
        return out


class InterleavedTrainSchedule(PipeSchedule):
    """Interleaved 1F1B over `chunks` model chunks per rank; `micro_batches` must be a multiple of `stages`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int):
        super().__init__(micro_batches, stages, stage_id)
        if chunks < 1:
            raise ValueError(f"bad schedule: chunks={chunks}")
        if chunks > 1 and micro_batches % stages != 0:
            raise ValueError(
                f"the interleaved pipeline schedule needs the micro-batches per batch "
                f"(gradient_accumulation_steps = {micro_batches}) to be a multiple of the stages ({stages})"
            )
        self.chunks = chunks

    def _unit(self, k: int, backward: bool) -> tuple[int, int]:
        """(micro-batch, chunk) of this rank's k-th forward (or backward) unit."""
        group = k // self.stages
        chunk = group % self.chunks
        micro_batch = (group // self.chunks) * self.stages + k % self.stages
        return micro_batch, (self.chunks - 1 - chunk if backward else chunk)

    def warmup(self) -> int:
        total = self.micro_batches * self.chunks
        if self.chunks == 1:
            return min(self.stages - self.stage_id - 1, total)
        return min(2 * (self.stages - self.stage_id - 1) + (self.chunks - 1) * self.stages, total)

    def steps(self) -> list[PipeInstruction]:
        total, warmup = self.micro_batches * self.chunks, self.warmup()
        out: list[PipeInstruction] = []
        for k in range(warmup):
            out += self._forward(*self._unit(k, backward=False))
        for i in range(total - warmup):
            out += self._forward(*self._unit(warmup + i, backward=False))
            out += self._backward(*self._unit(i, backward=True))
        for k in range(total - warmup, total):
            out += self._backward(*self._unit(k, backward=True))
        return out + [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


class InferenceSchedule(PipeSchedule):
    """Forward only: each micro-batch flows through the stages (and, interleaved, through this rank's chunks in
    order); sends never wait, so stages overlap."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1):
        super().__init__(micro_batches, stages, stage_id)
        self.chunks = chunks

    def steps(self) -> list[PipeInstruction]:
        return [
            inst
            for mb in range(self.micro_batches)
            for chunk in range(self.chunks)
            for inst in self._forward(mb, chunk)
        ]

    def ticks(self) -> list[list[PipeInstruction]]:
        """Stage s forwards micro-batch m at step m + s and sends its activation at step m + s + 1."""
        if self.chunks != 1:
            return super().ticks()  # no lockstep view of the interleaved order
        out: list[list[PipeInstruction]] = []
        for step in range(self.micro_batches + self.stages - 1):
            current, previous = step - self.stage_id, step - self.stage_id - 1
            cmds: list[PipeInstruction] = []
            if self._valid(previous) and not self.is_last_stage:
                cmds.append(self._buffered(SendActivation, previous))
            if self._valid(current):
                if not self.is_first_stage:
                    cmds.append(self._buffered(RecvActivation, current))
                if self.is_first_stage or self.is_last_stage:
                    cmds.append(self._buffered(LoadMicroBatch, current))
                cmds.append(self._buffered(ForwardPass, current))
            out.append(cmds)
        return out


def simulate(lists: list[list[PipeInstruction]], costs: dict | None = None) -> float:
    """Run the instruction lists of every rank of one pipeline (index = stage) with non-blocking sends and
    blocking receives; raise RuntimeError naming the stuck instructions if they deadlock or a receive would
    get another micro-batch's data. Transfers are matched per boundary between consecutive parts, FIFO.

    `costs` maps instruction types to durations (e.g. {ForwardPass: 1, BackwardPass: 2}; others take 0);
    the return value is then the batch's makespan: each stage's clock advances by its instructions' costs and
    waits at a receive for the time the matching send was issued."""
    costs = costs or {}
    stages = len(lists)
    sent: dict[tuple, list[tuple[int, float]]] = {}  # (kind, boundary) -> (micro-batch, send time), in order
    taken: dict[tuple, int] = {}
    pos, clock = [0] * stages, [0.0] * stages

    def channel(stage: int, inst: PipeInstruction) -> tuple:
        part = inst.chunk * stages + stage
        if isinstance(inst, SendActivation | RecvGrad):
            part += 1  # the boundary after this part
        kind = "act" if isinstance(inst, SendActivation | RecvActivation) else "grad"
        return kind, part

    while any(pos[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(lists[s]):
                inst = lists[s][pos[s]]
                if isinstance(inst, SendActivation | SendGrad):
                    sent.setdefault(channel(s, inst), []).append((inst.micro_batch, clock[s]))
                elif isinstance(inst, RecvActivation | RecvGrad):
                    key = channel(s, inst)
                    n = taken.get(key, 0)
                    if n >= len(sent.get(key, [])):
                        break  # blocks until the peer sends
                    micro_batch, at = sent[key][n]
                    if micro_batch != inst.micro_batch:
                        raise RuntimeError(f"stage {s}: {inst!r} would receive micro-batch {micro_batch}")
                    taken[key] = n + 1
                    clock[s] = max(clock[s], at)
                clock[s] += costs.get(type(inst), 0.0)
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][pos[s]] for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"pipeline schedule deadlocks; stuck at {stuck}")
    return max(clock)
