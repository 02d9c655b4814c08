"""Compression: eval loss, file bytes, serving memory and decode speed of the packed models against fp32.

    python benchmarks/compression.py                      # CPU, ~15-25 min on 2 loaded cores
    python benchmarks/compression.py --device cuda        # a GPU box, < 3 min

Needs transformers (the `serve` or `hf` extra); nothing else beyond shardspeed's own dependencies.

1. Teacher: the README's tiny Llama (train_to_serve.py: hidden 128, 4 layers, the standard library's bytes),
   trained --teacher-steps steps, saved in Hugging Face format.
2. Variants, each through examples/compress_gpt.py's path (init_compression -> initialize -> distillation ->
   redundancy_clean -> export_packed): int8 (one scale per row, 8-bit weights), int4 (asymmetric, two runs
   per row), ternary + layer reduction (4 -> 2 layers) + distillation, binary + distillation. Eval loss on 64
   held-out windows: compressed (before cleaning), cleaned, and served (the packed directory loaded by
   `shardspeed.mii.pipeline.load_model`, what `shardspeed-serve` runs).
3. Serving, one fresh process per model and round, rounds interleaved: peak RSS over the process's baseline
   (torch and transformers imported) while loading and decoding, and greedy decode tokens/s at batch 1 (64
   new tokens, 1 thread; on CPU per CPU-second of the process, which a shared machine does not distort, and
   per wall second). On CUDA: wall tokens/s and peak allocated bytes.
4. The same decode comparison, fp32 against int8, for wider random-weight Llamas (hidden 256 and 512), where
   the weights no longer fit in the caches.

Results: benchmarks/results/compression.md and .json (--out to change).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
NEW_TOKENS, EVAL_WINDOWS, SEQ = 64, 64, 128
TARGETS = {"int8": ("eval loss within 1% of fp32", 0.01), "int4": ("eval loss within 5% of fp32", 0.05)}


def _config(name: str, steps: int) -> dict:
    configs = ROOT / "examples" / "configs"
    if name == "binary":  # ternary's groups at 1 bit, no layer reduction
        config = json.loads((configs / "compress_ternary.json").read_text())
        del config["compression_training"]["layer_reduction"]
        for group in config["compression_training"]["weight_quantization"]["different_groups"].values():
            group["params"].update(start_bits=1, target_bits=1)
    else:
        file = {
            "int8": "compress_8bit.json",
            "int4": "compress_4bit.json",
            "ternary": "compress_ternary.json",
        }[name]
        config = json.loads((configs / file).read_text())
    if "scheduler" in config:
        config["scheduler"]["params"]["total_num_steps"] = steps
    return config


def _data():
    from compress_gpt import split
    from train_gpt import Windows, read_corpus

    return split(Windows(read_corpus(4_000_000), SEQ), EVAL_WINDOWS)


@torch.no_grad()
def _eval(model, held_out, device) -> float:
    model.eval()
    losses = [model(input_ids=c.to(device), labels=c.to(device)).loss.item() for c in held_out.split(16)]
    return sum(losses) / len(losses)


def prepare(args, work: Path) -> dict:
    """Teacher and variants on disk; eval losses and file sizes."""
    from compress_gpt import distill, student_for, train_teacher
    from transformers import LlamaForCausalLM

    import shardspeed as deepspeed
    from shardspeed.compression import export_packed
    from shardspeed.compression.compress import init_compression, redundancy_clean
    from shardspeed.mii.tokenizer import byte_tokenizer

    train, held_out = _data()
    device = torch.device(args.device)
    teacher_dir = work / "fp32"
    if not (teacher_dir / "model.safetensors").exists():
        options = argparse.Namespace(
            dim=128, layers=4, seq=SEQ, teacher_steps=args.teacher_steps, device=device
        )
        start = time.perf_counter()
        train_teacher(teacher_dir, train, options)
        print(f"teacher trained in {time.perf_counter() - start:.0f} s")
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).to(device)
    results = {"fp32": {"eval_loss": _eval(teacher, held_out, device),
                        "file_bytes": (teacher_dir / "model.safetensors").stat().st_size}}  # fmt: skip
    results["fp32"]["distilled_loss"] = _distilled_fp32(teacher, train, held_out, device, args.distill_steps)
    for name in args.variants:
        steps = args.steps[name]
        config = _config(name, steps)
        torch.manual_seed(0)
        student = student_for(teacher, config)
        init_compression(student, config, teacher_model=teacher)
        quantized_only = _post_training_loss(student, config, held_out, device)
        engine, *_ = deepspeed.initialize(model=student, model_parameters=student.parameters(), config=config)
        options = argparse.Namespace(steps=steps, temperature=2.0, alpha=0.5)
        start = time.perf_counter()
        distill(engine, teacher, train, options)
        compressed = _eval(student, held_out, device)
        redundancy_clean(student, config)
        cleaned = _eval(student, held_out, device)
        out = work / name
        size = export_packed(student.cpu(), out / "model.safetensors")
        student.config.save_pretrained(out)
        byte_tokenizer().save_pretrained(out)
        results[name] = {"steps": steps, "seconds": time.perf_counter() - start, "compressed_loss": compressed,
                         "post_training_loss": quantized_only,
                         "cleaned_loss": cleaned, "file_bytes": size,
                         "layers": student.config.num_hidden_layers}  # fmt: skip
        print(name, json.dumps(results[name]))
        del engine, student
    return results


def _distilled_fp32(teacher, train, held_out, device, steps: int) -> float:
    """The reference for the distilled variants: the teacher's copy trained on the same distillation loss for
    the same steps, uncompressed (the teacher is not converged, so extra steps alone lower the loss)."""
    from compress_gpt import distill, student_for

    import shardspeed as deepspeed

    config = _config("ternary", steps)
    config["compression_training"] = {}  # nothing compressed
    torch.manual_seed(0)
    student = student_for(teacher, config)
    engine, *_ = deepspeed.initialize(model=student, model_parameters=student.parameters(), config=config)
    distill(engine, teacher, train, argparse.Namespace(steps=steps, temperature=2.0, alpha=0.5))
    return _eval(student, held_out, device)


def _post_training_loss(student, config: dict, held_out, device) -> float:
    """Eval loss with every technique on and no training: what quantization alone costs (on a copy)."""
    from shardspeed.compression.scheduler import compression_scheduler

    probe = copy.deepcopy(student).to(device)
    compression_scheduler(probe, config).step(step_zero_check=True)
    return _eval(probe, held_out, device)


def wide_models(work: Path) -> list[str]:
    """Random-weight Llamas of hidden 256 and 512, fp32 and int8 (one scale per row), saved for serving."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardspeed.compression import export_packed
    from shardspeed.compression.compress import init_compression, redundancy_clean
    from shardspeed.compression.scheduler import compression_scheduler
    from shardspeed.mii.tokenizer import byte_tokenizer

    names = []
    for dim, layers in ((256, 4), (512, 8)):
        fp32_dir, int8_dir = work / f"wide{dim}_fp32", work / f"wide{dim}_int8"
        names += [fp32_dir.name, int8_dir.name]
        if (int8_dir / "model.safetensors").exists():
            continue
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=257, hidden_size=dim, intermediate_size=dim * 8 // 3 // 8 * 8,
                             num_hidden_layers=layers, num_attention_heads=dim // 32, num_key_value_heads=dim // 64,
                             max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=256)  # fmt: skip
        model = LlamaForCausalLM(config)
        model.save_pretrained(fp32_dir)
        byte_tokenizer().save_pretrained(fp32_dir)
        groups = {}
        for key in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            rows = getattr(model.model.layers[0].self_attn if key.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                           else model.model.layers[0].mlp, key).out_features  # fmt: skip
            groups[key] = {"params": {"start_bits": 8, "target_bits": 8, "quantize_groups": rows},
                           "modules": [rf"\.{key}$"]}  # fmt: skip
        compression = {"compression_training": {"weight_quantization": {
            "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True}, "different_groups": groups}}}  # fmt: skip
        init_compression(model, compression)
        compression_scheduler(model, compression).step(step_zero_check=True)
        redundancy_clean(model, compression)
        export_packed(model, int8_dir / "model.safetensors")
        model.config.save_pretrained(int8_dir)
        byte_tokenizer().save_pretrained(int8_dir)
    return names


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes, from /proc (Linux)."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def serve_once(path: str, device: str, with_loss: bool) -> dict:
    """One fresh process: load the directory as shardspeed-serve does, decode, report time and memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardspeed.mii.pipeline import load_model

    torch.set_num_threads(1)
    # the baseline has every module loading needs imported (a server has them too): what follows is the model
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    AutoTokenizer.from_pretrained(path)
    baseline = _rss()[0]
    engine, tokenizer = load_model(path, dtype=torch.float32, max_out_tokens=256)
    ids = torch.tensor([tokenizer("def main():")["input_ids"]])
    engine.generate(ids, max_new_tokens=4, do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cpu, wall = time.process_time(), time.perf_counter()
    out = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[])  # all 64 tokens
    if device == "cuda":
        torch.cuda.synchronize()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = out.shape[1] - ids.shape[1]
    result = {"tokens_per_cpu_s": tokens / cpu, "tokens_per_s": tokens / wall, "peak_rss_over_baseline": _rss()[1] - baseline,
              "model_bytes": sum(t.numel() * t.element_size() for t in engine.module.state_dict().values())}  # fmt: skip
    if device == "cuda":
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    if with_loss:
        result["served_loss"] = _eval(engine.module, _data()[1], engine.module.device)
    return result


def measure(args, work: Path, names: list[str]) -> dict:
    """Every model in a fresh process per round, the models taking turns; medians and min/max."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    for round_index in range(args.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--serve-once", str(work / name), "--device", args.device]
            if round_index == 0 and not name.startswith("wide"):
                cmd.append("--with-loss")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode:
                raise RuntimeError(f"{name}: {proc.stderr[-3000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, values in runs.items():
        entry = {}
        for key in values[0]:
            series = [v[key] for v in values if key in v]
            entry[key] = {"median": statistics.median(series), "min": min(series), "max": max(series)}
        summary[name] = entry
    return summary


def report(args, prepared: dict, served: dict, out: Path) -> None:
    speed_key = "tokens_per_cpu_s" if args.device == "cpu" else "tokens_per_s"
    fp32 = prepared["fp32"]
    base_speed = served["fp32"][speed_key]["median"]
    lines = [f"# Compression ({args.device}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)",
             "", "The README's tiny Llama (hidden 128, 4 layers, 0.75M parameters) and its compressed variants "
             "(benchmarks/compression.py). Eval loss on 64 held-out windows of 128 bytes; served = the packed "
             f"file loaded by `shardspeed.mii.pipeline.load_model`. Decode: greedy, batch 1, {NEW_TOKENS} tokens, "
             f"1 thread, {args.rounds} rounds (median [min, max]); "
             + ("tokens per CPU-second of the process." if args.device == "cpu" else "tokens per wall second."),
             "", "| model | layers | eval loss, quantized only (vs fp32) | eval loss after distillation, served (vs fp32) "
             "| cleaned = compressed | file bytes (vs fp32) | model bytes in memory | peak RSS over baseline | "
             "decode tokens/s (vs fp32) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ["fp32", *args.variants]:
        row, s = prepared[name], served[name]
        loss = s["served_loss"]["median"]
        speed = s[speed_key]
        same = (
            "—"
            if name == "fp32"
            else ("yes" if abs(row["cleaned_loss"] - row["compressed_loss"]) < 1e-4 else "NO")
        )
        ptq = row.get("post_training_loss", fp32["eval_loss"])
        lines.append(
            f"| {name} | {row.get('layers', 4)} | {ptq:.4f} ({(ptq / fp32['eval_loss'] - 1) * 100:+.2f}%) | "
            f"{loss:.4f} ({(loss / fp32['eval_loss'] - 1) * 100:+.2f}%, {row.get('steps', 0)} steps) | {same} | "
            f"{row['file_bytes']:,} ({row['file_bytes'] / fp32['file_bytes']:.3f}x) | "
            f"{s['model_bytes']['median'] / 2**20:.2f} MiB | {s['peak_rss_over_baseline']['median'] / 2**20:.1f} MiB | {speed['median']:.0f} [{speed['min']:.0f}, "
            f"{speed['max']:.0f}] ({speed['median'] / base_speed:.2f}x) |"
        )  # fmt: skip
    distilled = fp32["distilled_loss"]
    lines += [
        "",
        f"The teacher is not converged: the fp32 model trained on the same distillation loss for {args.distill_steps} "
        f"steps reaches {distilled:.4f} ({(distilled / fp32['eval_loss'] - 1) * 100:+.2f}%), the reference for "
        "the distilled ternary and binary rows; the quantized-only column is what quantization itself costs.",
    ]
    lines += ["", "Wider random-weight Llamas (hidden 256 x 4 layers, 512 x 8), fp32 against int8 (one scale per row):", "",
              "| model | model bytes in memory | peak RSS over baseline | decode tokens/s (vs fp32) |", "|---|---|---|---|"]  # fmt: skip
    for dim in (256, 512):
        base = served[f"wide{dim}_fp32"][speed_key]["median"]
        for kind in ("fp32", "int8"):
            s = served[f"wide{dim}_{kind}"]
            speed = s[speed_key]
            lines.append(f"| hidden {dim} {kind} | {s['model_bytes']['median'] / 2**20:.1f} MiB | "
                         f"{s['peak_rss_over_baseline']['median'] / 2**20:.1f} MiB | {speed['median']:.0f} "
                         f"[{speed['min']:.0f}, {speed['max']:.0f}] ({speed['median'] / base:.2f}x) |")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "compression.md").write_text("\n".join(lines) + "\n")
    (out / "compression.json").write_text(
        json.dumps({"device": args.device, "prepared": prepared, "served": served}, indent=1)
    )
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--distill-steps", type=int, default=300, help="ternary and binary distillation steps"
    )
    parser.add_argument("--workdir", default="runs/compression_bench")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--serve-once")
    parser.add_argument("--with-loss", action="store_true")
    args = parser.parse_args()
    if args.serve_once:
        print(json.dumps(serve_once(args.serve_once, args.device, args.with_loss)))
        return
    args.variants = ["int8", "int4", "ternary", "binary"]
    steps = args.distill_steps  # int8 and int4 need a fraction of the distillation steps extreme bits do
    args.steps = {"int8": max(1, steps // 15), "int4": max(1, steps // 5), "ternary": steps, "binary": steps}
    work = Path(args.workdir)
    prepared = prepare(args, work)
    served = measure(args, work, ["fp32", *args.variants, *wide_models(work)])
    report(args, prepared, served, Path(args.out))


if __name__ == "__main__":
    main()
