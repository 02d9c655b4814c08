"""The generation loop behind ``InferenceEngine.generate``: Hugging Face's arguments, our decode path.

``GenerationSettings.resolve`` reads ``generate``'s keyword arguments over the model's
``generation_config`` defaults (as Hugging Face does); ``generate_tokens`` runs prefill, then one decode step
per token, and returns what HF's ``generate`` returns for a decoder-only model: ``[batch, prompt + new]``
token ids, rows that stopped early padded with ``pad_token_id``. ``next_tokens`` (greedy / temperature,
top-k, top-p sampling) is the batch sampler of ``generate``; the server's per-request sampler, with its
penalties, biases and log-probabilities, is sampling.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GenerationSettings", "generate_tokens", "next_tokens"]


@dataclass
class GenerationSettings:
    """The subset of Hugging Face's ``GenerationConfig`` our loop implements."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # The server's per-request fields (OpenAI's and vLLM's; sampling.py applies them). ``generate`` never
    # sets them: its own arguments of the same meaning go to the model's generate (see ``unhandled``).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_new_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the k most likely
    prompt_logprobs: bool = False  # also for every prompt token (OpenAI's echo with logprobs)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to adjust or report: the batcher takes the batch's argmax for this row."""
        return (
            not self.do_sample
            and self.logprobs is None
            and not self.logit_bias
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and self.repetition_penalty == 1
            and self.min_new_tokens == 0
        )

    HANDLED = frozenset(
        {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
         "pad_token_id", "generation_config", "use_cache", "attention_mask", "input_ids", "inputs"}
    )  # fmt: skip

    # generation_config values that ask for something the loop does not do, and their neutral values
    NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
               "min_new_tokens": 0, "min_length": 0, "penalty_alpha": None, "return_dict_in_generate": False}  # fmt: skip

    @classmethod
    def unhandled(cls, model, kwargs: dict) -> list[str]:
        """Arguments (or generation_config values) only the model's own generate implements."""
        names = [k for k, v in kwargs.items() if k not in cls.HANDLED and v is not None]
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        for key, neutral in cls.NEUTRAL.items():
            value = getattr(config, key, None) if config is not None else None
            if key not in names and value not in (None, neutral):
                names.append(f"generation_config.{key}")
        return sorted(names)

    @classmethod
    def resolve(cls, model, prompt_len: int, kwargs: dict) -> GenerationSettings:
        """Arguments first, then the model's generation_config, then Hugging Face's defaults."""
        defaults = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def pick(name, fallback):
            value = kwargs.get(name)
            if value is None and defaults is not None:
                value = getattr(defaults, name, None)
            return fallback if value is None else value

        max_new = kwargs.get("max_new_tokens")
        if max_new is None and kwargs.get("max_length") is not None:
            max_new = int(kwargs["max_length"]) - prompt_len
        if max_new is None:
            max_new = pick("max_new_tokens", None)
        if max_new is None:
            max_new = int(pick("max_length", 20)) - prompt_len
        eos = pick("eos_token_id", None)
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
        pad = pick("pad_token_id", None)
        do_sample = bool(pick("do_sample", False))
        settings = cls(
            max_new_tokens=int(max_new),
            do_sample=do_sample,
            temperature=float(pick("temperature", 1.0)),
            top_k=int(pick("top_k", 50)) if do_sample else 0,
            top_p=float(pick("top_p", 1.0)),
            eos_token_ids=eos_ids,
            pad_token_id=int(pad) if pad is not None else (eos_ids[0] if eos_ids else None),
        )
        settings.check()
        return settings

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")


def next_tokens(logits: torch.Tensor, settings: GenerationSettings, generator=None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: argmax, or a sample after temperature/top-k/top-p."""
    if not settings.do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / settings.temperature
    if settings.top_k:
        kth = torch.topk(scores, min(settings.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the best token always stays).
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= settings.top_p
        drop_sorted[..., 0] = False  # even when top_p rounds to 0 in the scores' dtype
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def generate_tokens(decoder, input_ids, attention_mask, settings: GenerationSettings, max_len: int):
    """Prefill + decode loop; returns ``[B, prompt + generated]`` as Hugging Face's generate does."""
    batch, prompt_len = input_ids.shape
    if prompt_len + settings.max_new_tokens > max_len:
        raise ValueError(
            f"max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({settings.max_new_tokens}) exceeds "
            f"max_out_tokens ({max_len}) of the inference config"
        )
    eos = torch.tensor(settings.eos_token_ids, dtype=input_ids.dtype, device=input_ids.device)
    has_eos = bool(settings.eos_token_ids)
    generated = torch.empty(batch, settings.max_new_tokens, dtype=input_ids.dtype, device=input_ids.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    try:
        logits = decoder.prefill(input_ids, attention_mask, max_len)
        steps = 0
        for step in range(settings.max_new_tokens):
            tokens = next_tokens(logits, settings)
            if has_eos and settings.pad_token_id is not None:  # without stop tokens no row ever finishes
                tokens = tokens.masked_fill(finished, settings.pad_token_id)
            generated[:, step] = tokens
            steps = step + 1
            if has_eos:  # a Python bool: len() of a tensor costs a dispatch per token
                finished |= torch.isin(tokens, eos)
                if bool(finished.all()):  # one host sync per token, as HF's stopping criteria
                    break
            if step + 1 < settings.max_new_tokens:
                logits = decoder.decode(tokens)
    finally:
        decoder.release()
    return torch.cat([input_ids, generated[:, :steps]], dim=1)
