"""Generation under ZeRO-3 against the same model unsharded: tokens/s, as an RLHF trainer generates.

    python benchmarks/zero3_generation.py [--rounds 5] [--new-tokens 32] [--hidden 512 --layers 8]

Two CPU ranks (Gloo, loopback), one thread each, a Llama built from a config, greedy `generate` with the KV
cache. Each round times, in turn on every rank:
- `unsharded`: the plain model, no engine;
- `trl-unwrap`: a ZeRO-3 engine (built by Accelerate, as TRL's trainers get it) inside TRL's own
  `unwrap_model_for_generation`: every parameter gathered once, ZeRO-3 hooks taken off, put back afterwards
  (the time includes the gather and the re-registration);
- `zero-unwrap`: the same engine inside `deepspeed.zero.unwrap_model_for_generation` (gathered once, hooks
  paused);
- `per-token`: the same engine with its hooks on (TRL's `ds3_gather_for_generation=False`): every module
  gathers its parameters for every new token (`synced_gpus=True`, as TRL passes);
- `hybrid`: a ZeRO-3 engine built with `hybrid_engine.enabled` (DeepSpeed-Chat's actor), `engine.generate`: one
  gather per call, our KV-cache decode path (`max_new_tokens` only: `min_new_tokens` would hand the call to
  the model's own generate; `same_tokens` says whether no row stopped early); q/k/v and gate/up decode as one
  matmul each, from fused copies made inside the gather;
- `hybrid-unfused`: the same hybrid engine with its decoder built without those copies (q, k, v, gate and up
  as five matmuls, as before the copies): what the copies are worth, measured in the same rounds.
The hybrid engine's own split of each call (gather, then decode) is reported too.
Reports median tokens/s per variant, the ratio to `unsharded`, and whether every variant generated the
unsharded model's tokens. Needs transformers, accelerate and trl (the [hf] extra) and the alias (staged here).
Writes benchmarks/results/zero3_generation.{md,json}. A measurement, not a test: no assertion on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("unsharded", "trl-unwrap", "zero-unwrap", "per-token", "hybrid", "hybrid-unfused")


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.prompt + args.new_tokens + 8, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def job(args) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
    }
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    plain = _model(args)
    sharded = _model(args)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    engine, _ = accelerator.prepare(sharded, optimizer)
    import deepspeed

    actor = _model(args)
    hybrid_config = {
        **config,
        "hybrid_engine": {"enabled": True, "max_out_tokens": args.prompt + args.new_tokens},
    }
    hybrid_engine, *_ = deepspeed.initialize(
        model=actor, optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-4), config=hybrid_config
    )
    rank = dist.get_rank()
    prompt = torch.randint(
        2, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank)
    )
    gen = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, use_cache=True
    )

    def unsharded():
        return plain.generate(prompt, **gen)

    def trl_unwrap():
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(engine, accelerator) as model:
            return model.generate(prompt, **gen)

    def zero_unwrap():
        import deepspeed

        with deepspeed.zero.unwrap_model_for_generation(engine) as model:
            return model.generate(prompt, **gen)

    def per_token():
        return engine.module.generate(prompt, synced_gpus=True, **gen)

    gather_seconds: list[float] = []

    def hybrid():
        hybrid_engine.eval()
        out = hybrid_engine.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        gather_seconds.append(hybrid_engine.rollout.last_gather_seconds)
        return out

    def unfused_decoder():
        from shardspeed.inference.decoder import FastDecoder

        rollout = hybrid_engine.rollout
        decoder = FastDecoder(rollout.module, fuse=False)
        decoder.cache, decoder.keep_cache = rollout.cache, not rollout.release_cache
        return decoder

    def hybrid_unfused():
        hybrid_engine.rollout._decoder = unfused_decoder  # shadows the method for this call only
        try:
            hybrid_engine.eval()
            return hybrid_engine.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        finally:
            del hybrid_engine.rollout._decoder

    runs = dict(zip(VARIANTS, (unsharded, trl_unwrap, zero_unwrap, per_token, hybrid, hybrid_unfused)))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    outputs = {}
    with torch.no_grad():
        for name, fn in runs.items():  # warm-up, and the tokens each variant generates
            outputs[name] = fn()
        for _ in range(args.rounds):
            for name, fn in runs.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    same = {name: bool(torch.equal(outputs[name], outputs["unsharded"])) for name in VARIANTS}
    tokens = args.batch * args.new_tokens
    result = {name: {"seconds": times[name], "tokens_per_s": tokens / statistics.median(times[name]),
                     "same_tokens": same[name]} for name in VARIANTS}  # fmt: skip
    result["hybrid"]["gather_seconds"] = gather_seconds[1:]  # the timed rounds (not the warm-up)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": gathered, "args": vars(args)}, indent=1))


def report(data: dict) -> str:
    ranks, args = data["ranks"], data["args"]
    rate = {name: statistics.mean(r[name]["tokens_per_s"] for r in ranks) for name in VARIANTS}
    params = args["layers"] * 12 * args["hidden"] ** 2 + 2 * args["vocab"] * args["hidden"]
    lines = [
        "# Generation under ZeRO-3 against the unsharded model",
        "",
        f"`python benchmarks/zero3_generation.py` — a Llama of ~{params / 1e6:.0f}M parameters (hidden "
        f"{args['hidden']}, {args['layers']} layers, vocabulary {args['vocab']}), 2 CPU ranks (Gloo, loopback, one "
        f"thread each), batch {args['batch']}, prompt {args['prompt']}, {args['new_tokens']} new tokens, greedy "
        f"with the KV cache; median of {args['rounds']} interleaved rounds per rank, mean over ranks.",
        "",
        "| variant | tokens/s | ratio to unsharded | same tokens as unsharded |",
        "|---|---|---|---|",
    ]
    for name in VARIANTS:
        same = all(r[name]["same_tokens"] for r in ranks)
        lines.append(f"| `{name}` | {rate[name]:.1f} | {rate[name] / rate['unsharded']:.2f} | {same} |")
    gather = statistics.mean(statistics.median(r["hybrid"]["gather_seconds"]) for r in ranks)
    call = statistics.mean(statistics.median(r["hybrid"]["seconds"]) for r in ranks)
    lines += [
        "",
        f"`hybrid`'s calls: {call:.3f} s (median), of which the gather of every parameter unit {gather:.3f} s "
        f"({gather / call:.0%}); the rest is prefill and decode.",
    ]
    lines += [
        "",
        f"Load average of the machine when the run started: {data['load']:.1f} (other jobs share its cores, so the "
        "ratios vary from run to run). On CPU a per-token gather is cheap next to single-threaded "
        "compute (two ranks over loopback copy the weights in memory), so `per-token` is not much slower here; "
        "with GPUs the compute is faster and the per-token gathers cross the interconnect, which was not "
        "measured.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    sys.path.insert(0, str(ROOT / "tests"))
    from alias_path import env_with_alias

    from harness import free_port

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = env_with_alias(Path(tmp) / "site")
        env.update(SHARDSPEED_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("job", "out")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), __file__, "--job", "--out", str(out), *flags]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-6000:])
        data = json.loads(out.read_text())
        data["load"] = load
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero3_generation.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    (RESULTS / "zero3_generation.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
