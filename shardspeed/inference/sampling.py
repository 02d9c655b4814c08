"""The server's per-request token choice: OpenAI's and vLLM's sampling fields over one row of logits.

``choose`` takes one request's logits row and its ``GenerationSettings`` and returns the next token, plus
its log-probability and the ``logprobs`` most likely alternatives when asked. In order:

1. log-probabilities are read from the model's own distribution (``log_softmax`` of the raw logits, before
   any adjustment below: what the model thinks, as vLLM reports by default);
2. adjustments: ``repetition_penalty`` (vLLM/HF: divides positive and multiplies negative logits of every
   token seen in prompt or output), ``presence_penalty`` / ``frequency_penalty`` (OpenAI: minus once per
   token present in the output / per occurrence), ``logit_bias`` (added), ``min_new_tokens`` (stop tokens
   masked until then);
3. choice: greedy (argmax) when ``do_sample`` is off, else temperature, ``top_k``, ``top_p`` and a draw
   from the request's own seeded generator.

Everything the HTTP layer lets through must be safe here: temperatures below ``GREEDY_BELOW`` are greedy
(dividing logits by 1e-300 overflows to inf), scores are shifted so the best is 0 before the temperature
divides them, a tiny ``repetition_penalty`` cannot push a score to +inf, and a distribution that is still
not finite raises ``ValueError``, which ends that request only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation import GenerationSettings

__all__ = ["GREEDY_BELOW", "Choice", "choose", "prompt_logprobs"]

GREEDY_BELOW = 1e-5  # vLLM's threshold too


@dataclass
class Choice:
    """A chosen token, with its log-probability and the top alternatives when the request asked for them."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))


def adjust(logits: torch.Tensor, settings: GenerationSettings, prompt_ids, generated) -> torch.Tensor:
    """``logits`` [V] (float32, modified in place) after penalties, biases and the minimum length."""
    vocab = logits.shape[-1]
    if settings.repetition_penalty != 1:
        seen = torch.tensor(list(prompt_ids) + list(generated), device=logits.device).unique()
        scores = logits[seen]
        penalty = settings.repetition_penalty
        logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
        logits.clamp_(
            max=torch.finfo(logits.dtype).max
        )  # a tiny penalty must not make +inf (inf - inf = NaN)
    if generated and (settings.presence_penalty or settings.frequency_penalty):
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=vocab)[:vocab]
        logits -= settings.frequency_penalty * counts + settings.presence_penalty * (counts > 0)
    if settings.logit_bias:
        ids = torch.tensor(list(settings.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(settings.logit_bias.values()), device=logits.device)
    if len(generated) < settings.min_new_tokens and settings.eos_token_ids:
        logits[torch.tensor(settings.eos_token_ids, device=logits.device)] = float("-inf")
    return logits


def _sample(scores: torch.Tensor, settings: GenerationSettings, generator) -> int:
    # Best score first to 0: dividing by a small temperature then never overflows to +inf.
    scores = (scores - scores.max()) / settings.temperature
    if settings.top_k:
        kth = torch.topk(scores, min(settings.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        # Drop a token once the mass before it already reaches top_p (the best token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= settings.top_p
        drop_sorted[..., 0] = False  # even when top_p rounds to 0 in the scores' dtype
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = scores.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("sampling: the adjusted distribution is not finite (check logit_bias and penalties)")
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def choose(
    logits: torch.Tensor, settings: GenerationSettings, prompt_ids, generated, generator=None
) -> Choice:
    """The next token for one request from its logits row [V] (see module docstring)."""
    raw = logits.float()
    logprobs = torch.log_softmax(raw, -1) if settings.logprobs is not None else None
    scores = adjust(raw.clone(), settings, prompt_ids, generated)
    if not bool(torch.isfinite(scores).any()):
        raise ValueError("sampling: every token is excluded (check logit_bias)")
    if settings.do_sample and settings.temperature >= GREEDY_BELOW:
        token = _sample(scores, settings, generator)
    else:
        token = int(scores.argmax())
    if logprobs is None:
        return Choice(token)
    return Choice(token, float(logprobs[token]), _top(logprobs, settings.logprobs))


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[Choice]:
    """For every prompt token after the first: its log-probability given the tokens before it (echo)."""
    logprobs = torch.log_softmax(logits.float(), -1)  # [T, V]: row t predicts token t + 1
    targets = torch.tensor(prompt_ids[1:], device=logits.device)
    chosen = logprobs[:-1].gather(-1, targets[:, None])[:, 0].tolist()
    return [
        Choice(token, lp, _top(logprobs[t], k)) for t, (token, lp) in enumerate(zip(prompt_ids[1:], chosen))
    ]
