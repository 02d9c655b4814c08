"""Train a small GPT on the Python standard library's own source text, the DeepSpeed way.

    shardspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/gpt_small.json
    shardspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/gpt_observe.json

`gpt_observe.json` adds activation checkpointing, the CSV monitor (runs/gpt/), the flops profiler at step 2
and the comms logger; set "enabled": true in its tensorboard/wandb blocks once `pip install
'shardspeed[tensorboard,wandb]'` is done, then plot the CSV curves with
`python -m shardspeed.monitor.plot runs/gpt --out curves.png`.

Runs on CPU (Gloo) or GPUs (NCCL) unchanged; the script only talks to the `deepspeed` API, so replacing
`import shardspeed as deepspeed` by `import deepspeed` runs it under DeepSpeed. The corpus is every `.py` file
of the interpreter's standard library, read as bytes (a 256-token vocabulary): present on every machine,
nothing to download.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

# shardspeed first: it quiets torch's import-time warning about NumPy, which a clean install does not have.
import shardspeed as deepspeed  # isort: skip
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from tqdm import tqdm


def read_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's source files, concatenated in a fixed order, as a tensor of byte values."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Windows(Dataset):
    """Non-overlapping windows of `seq + 1` tokens (inputs and their next-token targets)."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq : i * self.seq + self.seq + 1]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4, seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: small normal weights keep the first logits (and loss) near uniform.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            # with an "activation_checkpointing" block in the config, keep only each block's input and
            # recompute the rest in backward
            x = (
                deepspeed.checkpointing.checkpoint(block, x)
                if deepspeed.checkpointing.is_configured()
                else block(x)
            )
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--corpus_bytes", type=int, default=4_000_000)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    dataset = Windows(read_corpus(args.corpus_bytes), args.seq)
    model = GPT(dim=args.dim, layers=args.layers, seq=args.seq)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    rank = deepspeed.comm.get_rank()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{params / 1e6:.2f}M parameters, {len(dataset)} windows of {args.seq} tokens, "
              f"{engine.world_size} processes, global batch {engine.train_batch_size()}")  # fmt: skip

    batches = iter(deepspeed.RepeatingLoader(loader))
    gas = engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype
    progress = tqdm(total=args.steps, disable=rank != 0, desc="training", unit="step")
    start, first_loss, loss = time.perf_counter(), None, None
    for _ in range(args.steps):
        for _ in range(gas):
            loss = engine(next(batches).to(engine.device))
            engine.backward(loss)
            engine.step()
        first_loss = first_loss if first_loss is not None else loss.item()
        progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{engine.get_lr()[0]:.2e}")
        progress.update()
    progress.close()
    elapsed = time.perf_counter() - start
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    deepspeed.comm.log_summary()  # the comms logger's table, when the config's "comms_logger" is enabled
    if rank == 0:
        tokens = args.steps * engine.train_batch_size() * args.seq
        final = loss.item()
        print(f"loss {first_loss:.3f} -> {final:.3f} (uniform guess: {math.log(256):.3f}); "
              f"{tokens / elapsed:,.0f} tokens/s over {elapsed:.1f} s ({dtype})")  # fmt: skip


if __name__ == "__main__":
    main()
