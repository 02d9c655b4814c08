"""A ZeRO training rank for the fault-injection tests: one rank dies at a chosen point, the others go on.

Environment: FAULT_OUT (directory: each rank writes rank<R>.json with its pid and process group; the dying
rank writes died_at with the wall-clock time of its death), FAULT_RANK (the rank that dies), FAULT_WHERE
(before_init, after_initialize, forward, backward, collective, save_checkpoint), FAULT_HOW (raise, exit:
os._exit(1), sigkill: SIGKILL to itself), FAULT_STAGE (ZeRO stage, default 2).

The survivors carry on into the next collective and block there, as real ranks do when a peer is gone;
only the launcher stops them. A job that completes instead exits 0, which the tests count as a failure.
"""

import json
import os
import signal
import sys
import time

OUT = os.environ["FAULT_OUT"]
RANK = int(os.environ["RANK"])
DYING = int(os.environ["FAULT_RANK"]) == RANK
WHERE = os.environ["FAULT_WHERE"]
HOW = os.environ["FAULT_HOW"]
FAULT_STEP = 1


def die_if(where: str) -> None:
    if not DYING or where != WHERE:
        return
    print(f"fault rank {RANK} dying in {where} by {HOW}", flush=True)
    with open(os.path.join(OUT, "died_at"), "w") as handle:
        handle.write(repr(time.time()))
    if HOW == "raise":
        raise RuntimeError(f"injected fault in rank {RANK} ({where})")
    if HOW == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def record_start() -> None:
    # Written under a temporary name and renamed: a rank the launcher stops mid-write must not leave a
    # half-written record for the orphan check to read.
    path = os.path.join(OUT, f"rank{RANK}.json")
    with open(f"{path}.tmp", "w") as handle:
        json.dump({"pid": os.getpid(), "pgid": os.getpgid(0)}, handle)
    os.replace(f"{path}.tmp", path)
    print(f"fault rank {RANK} started", flush=True)
    if DYING and WHERE == "before_init":  # let every rank record its pid first, for the orphan check
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(
            [name for name in os.listdir(OUT) if name.endswith(".json")]
        ) < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.01)


def build_engine(progress: dict):
    import shardspeed as deepspeed  # isort: skip
    import torch

    class Faulty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)

        def forward(self, x):
            at_fault = progress["step"] == FAULT_STEP
            if at_fault:
                die_if("forward")
            hidden = torch.tanh(self.inner(x))
            if at_fault and hidden.requires_grad:
                hidden.register_hook(lambda grad: die_if("backward"))
            return self.outer(hidden)

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": int(os.environ.get("FAULT_STAGE", "2"))},
    }
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Faulty()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def die_inside_save() -> None:
    from shardspeed.checkpoint import files

    real_save = files.save_file

    def save_then_die(obj, path):
        real_save(obj, path)
        die_if("save_checkpoint")

    files.save_file = save_then_die


def main() -> None:
    record_start()
    die_if("before_init")
    import torch
    import torch.distributed as dist

    progress = {"step": 0}
    engine = build_engine(progress)
    die_if("after_initialize")
    if DYING and WHERE == "save_checkpoint":
        die_inside_save()
    for step in range(3):
        progress["step"] = step
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step == FAULT_STEP and WHERE == "collective":
            if DYING:
                time.sleep(0.5)  # the others are blocked in the all-reduce by now
                die_if("collective")
            dist.all_reduce(torch.ones(4))
        if step == FAULT_STEP and WHERE == "save_checkpoint":
            engine.save_checkpoint(os.path.join(OUT, "checkpoints"))
    dist.barrier()
    print(f"fault rank {RANK} finished without a fault", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
