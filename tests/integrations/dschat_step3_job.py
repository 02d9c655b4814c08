"""DeepSpeed-Chat's step 3 (PPO: actor, critic, reference and reward engines; the actor on the hybrid engine) on
2 ranks, through the `deepspeed` alias, with tiny models and a tokenizer built locally (nothing downloaded).

    torchrun --nproc_per_node 2 dschat_step3_job.py --work W --out R.json --runs llama:3 opt:2 [--dschat DIR]

Each run is `family:actor_zero_stage[:tp2][:lora]`: `tp2` sets the actor's `hybrid_engine.inference_tp_size` to 2,
`lora` gives the actor LoRA on every linear of its layers (DeepSpeed-Chat's `--actor_lora_dim 4`, with its
layout written below as `LoraLinear`; only the LoRA factors train). Without `--dschat` the loop below runs: DeepSpeed-Chat's loop in its
shape (its config blocks, `actor.module.generate(prompts, attention_mask, max_length, pad_token_id,
synced_gpus)` between `eval()` and `train()`, reference and reward forwards, the clipped PPO actor loss and the
clipped value loss, `backward`/`step` on actor and critic), written here because CI has no DeepSpeed-Chat. With
`--dschat DIR` (DeepSpeed-Chat's folder, holding dschat/) its own `DeepSpeedRLHFEngine` and
`DeepSpeedPPOTrainer` run unchanged instead, from the same model folders (with transformers 5.23 that stops at
DeepSpeed-Chat's own import of `transformers.modeling_utils.no_init_weights`, which transformers 5 removed).

Rank 0 writes, per run: the actor's engine class, the sequences generated at each step, the losses, whether the
first step's rollouts equal Hugging Face's `generate` on the unsharded actor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "</s>", "<unk>", "<|endoftext|>"]
PROMPT_LEN, ANSWER_LEN, BATCH = 8, 6, 2


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def _config(family: str, vocab: int):
    from transformers import LlamaConfig, OPTConfig

    if family == "opt":  # DeepSpeed-Chat's default actor family
        return OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                         max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, dropout=0.0)  # fmt: skip
    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                       eos_token_id=1, bos_token_id=1)  # fmt: skip


def _write_models(family: str, work: Path, tokenizer) -> tuple[Path, Path]:
    """The actor (a causal LM) and the critic (DeepSpeed-Chat's step-2 output: `pytorch_model.bin` holding a
    RewardModel's weights, `rwtransformer.*` and `v_head.weight`) as folders, written by rank 0."""
    from transformers import AutoModel, AutoModelForCausalLM

    actor_dir, critic_dir = work / f"{family}-actor", work / f"{family}-critic"
    if dist.get_rank() == 0:
        vocab = 8 * math.ceil(len(tokenizer) / 8)  # DeepSpeed-Chat resizes embeddings to a multiple of 8
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(family, vocab)).save_pretrained(actor_dir)
        tokenizer.save_pretrained(actor_dir)
        torch.manual_seed(1)
        base = AutoModel.from_config(_config(family, vocab))
        base.config.save_pretrained(critic_dir)
        state = {f"rwtransformer.{k}": v for k, v in base.state_dict().items()}
        state["v_head.weight"] = torch.randn(1, 32) * 0.1
        torch.save(state, critic_dir / "pytorch_model.bin")
        tokenizer.save_pretrained(critic_dir)
    dist.barrier()
    return actor_dir, critic_dir


def _prompts(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's prompts, left-padded to PROMPT_LEN as DeepSpeed-Chat's DataCollatorRLHF leaves them."""
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.full((BATCH, PROMPT_LEN), tokenizer.pad_token_id)
    mask = torch.zeros(BATCH, PROMPT_LEN, dtype=torch.long)
    for row in range(BATCH):
        length = PROMPT_LEN - 2 * row
        ids[row, -length:] = torch.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), (length,), generator=g)
        mask[row, -length:] = 1
    return ids, mask


# ---- DeepSpeed-Chat's loop, in its shape --------------------------------------------------------------------


class Critic(torch.nn.Module):
    """A base transformer and a value head (DeepSpeed-Chat's RewardModel's layout and forward_value)."""

    def __init__(self, folder: Path, pad_id: int):
        from transformers import AutoConfig, AutoModel

        super().__init__()
        self.rwtransformer = AutoModel.from_config(AutoConfig.from_pretrained(folder))
        self.v_head = torch.nn.Linear(32, 1, bias=False)
        self.load_state_dict(torch.load(folder / "pytorch_model.bin"))
        self.pad_id = pad_id

    def forward_value(
        self, input_ids, attention_mask, return_value_only=False, prompt_length=0, use_cache=False
    ):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=use_cache)[0]
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        ends = []
        for row in range(values.shape[0]):  # the value at the last answer token
            pads = (input_ids[row, prompt_length:] == self.pad_id).nonzero()
            ends.append(
                values[row, (pads[0].item() + prompt_length if len(pads) else input_ids.shape[1]) - 1]
            )
        return {"values": values, "chosen_end_scores": torch.stack(ends)}


class LoraLinear(torch.nn.Module):
    """DeepSpeed-Chat's `LinearLayer_LoRA` layout: the frozen base `weight`/`bias`, `lora_right_weight` [in, r]
    (Kaiming-initialised), `lora_left_weight` [r, out] (zeros: the model starts as its base), `lora_scaling`."""

    def __init__(self, linear: torch.nn.Linear, rank: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad = False
        self.lora_right_weight = torch.nn.Parameter(torch.empty(linear.in_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(rank, linear.out_features))
        self.lora_scaling = 1.0 / rank

    def forward(self, x):
        low_rank = x @ self.lora_right_weight @ self.lora_left_weight
        return F.linear(x, self.weight, self.bias) + low_rank * self.lora_scaling


def _with_lora(model, part_name: str = "layers.", rank: int = 4):
    """DeepSpeed-Chat's `convert_linear_layer_to_lora`: every `nn.Linear` whose name contains `part_name`."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and part_name in n]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        setattr(
            model.get_submodule(parent), leaf, LoraLinear(getattr(model.get_submodule(parent), leaf), rank)
        )
    return model


def _ds_config(stage: int, *, train: bool, hybrid: bool, tp: int = 1) -> dict:
    config = {
        "train_batch_size": BATCH * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": BATCH,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "none"}, "memory_efficient_linear": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }  # fmt: skip
    if train:
        config["zero_optimization"].update(overlap_comm=True, stage3_max_live_parameters=3e7,
                                           stage3_prefetch_bucket_size=3e7)  # fmt: skip
        config["hybrid_engine"] = {"enabled": hybrid, "max_out_tokens": PROMPT_LEN + ANSWER_LEN,
                                   "inference_tp_size": tp, "release_inference_cache": False,
                                   "pin_parameters": True, "tp_gather_partition_size": 8}  # fmt: skip
    return config


def _engines(family: str, stage: int, actor_dir: Path, critic_dir: Path, pad_id: int, options=()):
    import deepspeed
    from deepspeed.ops.adam import FusedAdam
    from transformers import AutoModelForCausalLM

    ref_stage = stage if stage == 3 else 0  # as DeepSpeed-Chat: ZeRO-3 for everything, else plain
    engines = {}
    for name, folder, train in (("actor", actor_dir, True), ("ref", actor_dir, False),
                                ("critic", critic_dir, True), ("reward", critic_dir, False)):  # fmt: skip
        torch.manual_seed(0)
        model = (
            AutoModelForCausalLM.from_pretrained(folder) if folder == actor_dir else Critic(folder, pad_id)
        )
        if name == "actor" and "lora" in options:
            model = _with_lora(model)
        tp = 2 if name == "actor" and "tp2" in options else 1
        config = _ds_config(stage if train else ref_stage, train=train, hybrid=name == "actor", tp=tp)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = FusedAdam(trained, lr=1e-3, betas=(0.9, 0.95)) if train else None
        engines[name], *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engines


def _gather_log_probs(logits, labels):
    return F.log_softmax(logits, dim=-1).gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def _ppo_step(engines, prompts, mask, pad_id: int, z3: bool) -> dict:
    actor, critic, ref, reward = (engines[k] for k in ("actor", "critic", "ref", "reward"))
    for engine in engines.values():
        engine.eval()
    with torch.no_grad():
        seq = actor.module.generate(prompts, attention_mask=mask, max_length=PROMPT_LEN + ANSWER_LEN,
                                    pad_token_id=pad_id, synced_gpus=z3)  # fmt: skip
    local_numel = sum(p.numel() for p in actor.module.parameters())
    actor.train()
    critic.train()
    attention = seq.not_equal(pad_id).long()
    start = PROMPT_LEN - 1
    with torch.no_grad():
        logprobs = _gather_log_probs(actor(seq, attention_mask=attention).logits[:, :-1], seq[:, 1:])
        ref_logprobs = _gather_log_probs(ref(seq, attention_mask=attention).logits[:, :-1], seq[:, 1:])
        score = reward.forward_value(seq, attention, prompt_length=PROMPT_LEN)["chosen_end_scores"]
        old_values = critic.forward_value(seq, attention, return_value_only=True)[:, :-1]
        rewards = -0.1 * (logprobs - ref_logprobs)
        rewards[:, -1] += score.clamp(-5, 5)
        advantages = torch.zeros_like(rewards)
        last = 0.0
        for t in reversed(range(start, rewards.shape[1])):  # GAE, gamma 1, lambda 0.95
            next_value = old_values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
            last = rewards[:, t] + next_value - old_values[:, t] + 0.95 * last
            advantages[:, t] = last
        returns = advantages + old_values
    action = attention[:, 1:].float()[:, start:]
    new_logprobs = _gather_log_probs(
        actor(seq, attention_mask=attention, use_cache=False).logits[:, :-1], seq[:, 1:]
    )
    ratio = torch.exp((new_logprobs - logprobs)[:, start:] * action)
    adv = advantages[:, start:]
    actor_loss = (torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * action).sum() / action.sum()
    actor.backward(actor_loss)
    actor.step()
    values = critic.forward_value(seq, attention, return_value_only=True, use_cache=False)[:, :-1][:, start:]
    clipped = torch.max(old_values[:, start:] - 0.2, torch.min(values, old_values[:, start:] + 0.2))
    value_loss = torch.max((values - returns[:, start:]) ** 2, (clipped - returns[:, start:]) ** 2)
    critic_loss = 0.5 * (value_loss * action).sum() / action.sum()
    critic.backward(critic_loss)
    critic.step()
    return {"seq": seq, "actor_loss": actor_loss.item(), "critic_loss": critic_loss.item(),
            "local_numel": local_numel}  # fmt: skip


def _own_loop(family, stage, actor_dir, critic_dir, tokenizer, prompts, mask, steps, options=()) -> dict:
    engines = _engines(family, stage, actor_dir, critic_dir, tokenizer.pad_token_id, options)
    results = [_ppo_step(engines, prompts, mask, tokenizer.pad_token_id, stage == 3) for _ in range(steps)]
    for engine in engines.values():
        engine.destroy()
    return {"actor": engines["actor"], "steps": results}


# ---- DeepSpeed-Chat's own trainer ---------------------------------------------------------------------------


def _dschat_args(family: str, stage: int) -> argparse.Namespace:
    """Step 3's command-line arguments, as its main.py parses them (defaults, tiny sizes, bf16)."""
    return argparse.Namespace(
        offload=False, dtype="bf16", actor_zero_stage=stage, critic_zero_stage=stage, enable_hybrid_engine=True,
        inference_tp_size=1, release_inference_cache=False, unpin_actor_parameters=False, tp_gather_partition_size=8,
        max_prompt_seq_len=PROMPT_LEN, max_answer_seq_len=ANSWER_LEN, enable_tensorboard=False,
        enable_mixed_precision_lora=False, tensorboard_path="", per_device_training_batch_size=BATCH,
        per_device_generation_batch_size=BATCH, gradient_accumulation_steps_actor=1, gradient_accumulation_steps=1,
        actor_dropout=None, critic_dropout=None, actor_lora_dim=0, critic_lora_dim=0,
        actor_lora_module_name="decoder.layers.", critic_lora_module_name="decoder.layers.", only_optimize_lora=False,
        actor_weight_decay=0.0, critic_weight_decay=0.0, actor_lora_learning_rate=5e-4, critic_lora_learning_rate=5e-4,
        actor_learning_rate=1e-3, critic_learning_rate=1e-3, lr_scheduler_type="cosine", num_warmup_steps=0,
        offload_reference_model=False, offload_reward_model=False, enable_ema=False, critic_gradient_checkpointing=False,
        num_padding_at_beginning=1 if family == "opt" else 0, end_of_conversation_token="<|endoftext|>",
        compute_fp32_loss=False, print_answers=False, print_answers_interval=1, align_overflow=False,
        local_rank=dist.get_rank(), global_rank=dist.get_rank(),
    )  # fmt: skip


def _dschat_loop(family, stage, actor_dir, critic_dir, tokenizer, prompts, mask, steps, dschat: str) -> dict:
    sys.path.insert(0, dschat)
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine

    args = _dschat_args(family, stage)
    engine = DeepSpeedRLHFEngine(str(actor_dir), str(critic_dir), tokenizer, args, num_total_iters=steps)
    trainer = DeepSpeedPPOTrainer(engine, args)
    results = []
    for step in range(steps):
        out = trainer.generate_experience(prompts, mask, step)
        local_numel = sum(p.numel() for p in engine.actor.module.parameters())
        actor_loss, critic_loss = trainer.train_rlhf(out)
        results.append({"seq": out["input_ids"], "actor_loss": actor_loss.item(),
                        "critic_loss": critic_loss.item(), "local_numel": local_numel})  # fmt: skip
    return {"actor": engine.actor, "steps": results}


# ---- the job -------------------------------------------------------------------------------------------------


def _hf_rollouts(actor_dir: Path, prompts, mask, pad_id: int) -> torch.Tensor:
    """Hugging Face's generate on the unsharded actor as saved: what the first rollouts must be."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor_dir).eval()
    with torch.no_grad():
        return model.generate(prompts, attention_mask=mask, max_length=PROMPT_LEN + ANSWER_LEN, pad_token_id=pad_id,
                              do_sample=False)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", nargs="+", default=["llama:3", "llama:2", "opt:3", "opt:2"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dschat", help="DeepSpeed-Chat's folder: run its own trainer and engines")
    args = parser.parse_args()
    import deepspeed

    deepspeed.init_distributed()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(work / "tokenizer")
    report = {}
    for run in args.runs:
        family, stage, *options = run.split(":")
        stage = int(stage)
        if options and args.dschat:
            raise ValueError(
                f"--runs {run}: the options {options} are for the loop written here, not --dschat"
            )
        actor_dir, critic_dir = _write_models(family, work, tokenizer)
        prompts, mask = _prompts(tokenizer)
        reference = _hf_rollouts(actor_dir, prompts, mask, tokenizer.pad_token_id)
        loop = _dschat_loop if args.dschat else _own_loop
        extra = (args.dschat,) if args.dschat else (tuple(options),)
        torch.manual_seed(0)
        out = loop(family, stage, actor_dir, critic_dir, tokenizer, prompts, mask, args.steps, *extra)
        first = out["steps"][0]["seq"]
        same = first.shape == reference.shape and bool(torch.equal(first, reference))
        flags = torch.tensor([float(same)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's rollouts
        report[run] = {
            "actor class": [c.__name__ for c in type(out["actor"]).__mro__][:3],
            "is DeepSpeedHybridEngine": isinstance(out["actor"], deepspeed.DeepSpeedHybridEngine),
            "first rollouts equal HF generate": bool(flags.item()),
            "actor_loss": [s["actor_loss"] for s in out["steps"]],
            "critic_loss": [s["critic_loss"] for s in out["steps"]],
            "seq": [s["seq"].tolist() for s in out["steps"]],
            "lora fused": getattr(getattr(out["actor"], "rollout", None), "last_lora_fused", None),
            "decode weight bytes": getattr(getattr(out["actor"], "rollout", None), "weight_bytes", None),
        }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
