"""Pipeline schedules as plain instruction lists: what one stage does, in order, for one batch.

A schedule is data, not control flow: `TrainSchedule(micro_batches, stages, stage_id).steps()` returns a
list of `PipeInstruction`s that can be printed, compared and tested without any process group; the engine
(`pipe/engine.py`) executes them one by one. The instruction names are DeepSpeed's.

`TrainSchedule` is 1F1B ("one forward, one backward"): stage s first runs `stages - s - 1` warm-up forwards,
then alternates a forward with a backward, then drains the remaining backwards. At most `stages - s`
micro-batches are in flight on stage s (their activations are what a stage keeps), instead of all of them
as in GPipe; the idle "bubble" is (stages - 1) / (micro_batches + stages - 1) of the batch time.

Sends are non-blocking and every receive is matched by a send its peer issues earlier in its own list, in
the same order (activations flow down, gradients up; each direction is FIFO), so no order of execution can
deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "InferenceSchedule",
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
]


@dataclass(frozen=True)
class PipeInstruction:
    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, repr=False)
class MicroBatchInstruction(PipeInstruction):
    micro_batch: int


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
    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(
                f"bad schedule: micro_batches={micro_batches} stages={stages} stage_id={stage_id}"
            )
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.is_first_stage = stage_id == 0
        self.is_last_stage = stage_id == stages - 1

    def steps(self) -> list[PipeInstruction]:
        raise NotImplementedError

    def __iter__(self):
        return iter(self.steps())

    def _forward(self, mb: int) -> list[PipeInstruction]:
        out: list[PipeInstruction] = []
        if not self.is_first_stage:
            out.append(RecvActivation(mb))
        if self.is_first_stage or self.is_last_stage:
            out.append(LoadMicroBatch(mb))
        out.append(ForwardPass(mb))
        if not self.is_last_stage:
            out.append(SendActivation(mb))
        return out

    def _backward(self, mb: int) -> list[PipeInstruction]:
        out: list[PipeInstruction] = []
        if not self.is_last_stage:
            out.append(RecvGrad(mb))
        out.append(BackwardPass(mb))
        if not self.is_first_stage:
            out.append(SendGrad(mb))
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


class InferenceSchedule(PipeSchedule):
    """Forward only: each micro-batch flows through the stages; sends never wait, so stages overlap."""

    def steps(self) -> list[PipeInstruction]:
        return [inst for mb in range(self.micro_batches) for inst in self._forward(mb)]
