"""Compress the README's trained GPT (train_to_serve.py's tiny Llama), clean it, export it packed, serve it.

    python examples/compress_gpt.py --deepspeed_config examples/configs/compress_8bit.json \
        --teacher runs/tiny-llama --out runs/tiny-llama-int8
    python examples/compress_gpt.py --deepspeed_config examples/configs/compress_4bit.json \
        --teacher runs/tiny-llama --out runs/tiny-llama-int4
    python examples/compress_gpt.py --deepspeed_config examples/configs/compress_ternary.json \
        --teacher runs/tiny-llama --out runs/tiny-llama-ternary --steps 300
    shardspeed-serve runs/tiny-llama-ternary --port 28080 &

If --teacher holds no model yet, a teacher is trained there first (train_to_serve.py's model and data). Then:
1. the student is the teacher's copy, or, with ``layer_reduction`` (compress_ternary.json), a shallower
   Llama initialised from the teacher layers the config names (``init_compression(student, config,
   teacher_model=teacher)``);
2. it trains through ``deepspeed.initialize`` on the distillation loss (the teacher's soft targets and the
   next tokens), the engine switching the compression techniques on at their ``schedule_offset``;
3. ``redundancy_clean`` makes the compression permanent: quantized linears become packed codes;
4. ``export_packed`` writes ``model.safetensors`` (codes + group scales) beside config.json and the
   tokenizer, and ``shardspeed.mii.pipeline`` loads that directory, as ``shardspeed-serve`` does.

The configs' weight-quantization groups give every row of every linear one scale (8-bit, ternary) or two
(4-bit), for the README's model (hidden 128, intermediate 336, 2 key/value heads of 32).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

# shardspeed first: it quiets torch's import-time warning about NumPy, which a clean install does not have.
import shardspeed as deepspeed  # isort: skip
import torch
from tqdm import tqdm
from train_gpt import Windows, read_corpus
from train_to_serve import tiny_llama
from transformers import LlamaForCausalLM

from shardspeed.compression import distillation_loss, export_packed
from shardspeed.compression.compress import init_compression, redundancy_clean
from shardspeed.mii.pipeline import pipeline
from shardspeed.mii.tokenizer import byte_tokenizer


def split(dataset: Windows, eval_windows: int):
    """Training windows and the last `eval_windows` windows held out for evaluation."""
    train = torch.utils.data.Subset(dataset, range(len(dataset) - eval_windows))
    held_out = torch.stack([dataset[i] for i in range(len(dataset) - eval_windows, len(dataset))])
    return train, held_out


@torch.no_grad()
def eval_loss(model, held_out: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token loss over the held-out windows."""
    model.eval()
    losses = [model(input_ids=chunk, labels=chunk).loss.item() for chunk in held_out.split(batch)]
    model.train()
    return sum(losses) / len(losses)


def train_teacher(path: Path, dataset, args) -> None:
    """train_to_serve.py's run, one process: the README's model, saved in Hugging Face format."""
    torch.manual_seed(0)
    device = getattr(args, "device", torch.device("cpu"))
    model = tiny_llama(args.dim, args.layers, args.seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True)
    batches = iter(deepspeed.RepeatingLoader(loader))
    for _ in tqdm(range(args.teacher_steps), desc="teacher", unit="step"):
        batch = next(batches).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.cpu().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def student_for(teacher, config: dict):
    """The teacher's copy, or a shallower model initialised from the teacher's layers (layer_reduction)."""
    reduction = config["compression_training"].get("layer_reduction", {})
    if not reduction.get("enabled"):
        return copy.deepcopy(teacher)
    student_config = copy.deepcopy(teacher.config)
    student_config.num_hidden_layers = reduction["keep_number_layer"]
    return LlamaForCausalLM(student_config)


def distill(engine, teacher, dataset, args) -> None:
    loader = torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                                         shuffle=True, drop_last=True)  # fmt: skip
    batches = iter(deepspeed.RepeatingLoader(loader))
    teacher.eval()
    progress = tqdm(range(args.steps), desc="compressing", unit="step")
    for _ in progress:
        batch = next(batches).to(engine.device)
        with torch.no_grad():
            soft_targets = teacher(input_ids=batch).logits
        logits = engine(input_ids=batch).logits
        # next-token targets: logits at t predict token t + 1
        labels = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
        loss = distillation_loss(logits, soft_targets, labels, temperature=args.temperature, alpha=args.alpha)
        engine.backward(loss)
        engine.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument(
        "--teacher", default="runs/tiny-llama", help="trained model directory (trained if missing)"
    )
    parser.add_argument("--out", required=True, help="directory for the packed model, config and tokenizer")
    parser.add_argument("--steps", type=int, default=60, help="distillation steps")
    parser.add_argument("--teacher_steps", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the teacher's soft targets")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--corpus_bytes", type=int, default=4_000_000)
    parser.add_argument("--eval_windows", type=int, default=64)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    config = json.loads(Path(args.deepspeed_config).read_text())

    train, held_out = split(Windows(read_corpus(args.corpus_bytes), args.seq), args.eval_windows)
    teacher_dir = Path(args.teacher)
    if not (teacher_dir / "config.json").exists():
        train_teacher(teacher_dir, train, args)
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir)

    torch.manual_seed(0)
    student = student_for(teacher, config)
    init_compression(student, config, teacher_model=teacher)
    engine, *_ = deepspeed.initialize(model=student, model_parameters=student.parameters(), config=config)
    distill(engine, teacher, train, args)

    compressed = eval_loss(student, held_out)
    redundancy_clean(student, config)
    cleaned = eval_loss(student, held_out)
    out = Path(args.out)
    size = export_packed(student, out / "model.safetensors")
    student.config.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)

    pipe = pipeline(str(out))  # what shardspeed-serve loads
    served = eval_loss(pipe.engine.module, held_out)
    teacher_loss = eval_loss(teacher, held_out)
    teacher_bytes = sum((teacher_dir / name).stat().st_size for name in ("model.safetensors",))
    completion = pipe(["def "], max_new_tokens=32)[0].generated_text
    print(f"eval loss: teacher {teacher_loss:.4f}, compressed {compressed:.4f}, cleaned {cleaned:.4f}, "
          f"served {served:.4f} ({(served / teacher_loss - 1) * 100:+.2f}%)")  # fmt: skip
    print(f"file: {size:,} bytes ({size / teacher_bytes:.3f}x the teacher's {teacher_bytes:,}); "
          f"perplexity {math.exp(served):.2f}")  # fmt: skip
    print(f"saved to {out}: serve it with `shardspeed-serve {out}`; 'def ' -> {completion!r}")


if __name__ == "__main__":
    main()
