"""``shardspeed.mii.pipeline``: a Hugging Face model directory served in-process with continuous batching.

``load_model(model_dir)`` builds the model on the meta device from its ``config.json`` and lets
``init_inference`` load the safetensors files one tensor at a time (split over ranks when
``tensor_parallel`` > 1); the tokenizer comes from the same directory. ``Pipeline.__call__`` submits every
prompt to one ``ContinuousBatcher`` and steps it until all are done, returning MII's ``Response`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.inference import init_inference
from shardspeed.inference.decoder import FastDecoder
from shardspeed.inference.generation import GenerationSettings
from shardspeed.inference.scheduler import BatchRequest, ContinuousBatcher

__all__ = ["Pipeline", "Response", "load_model", "pipeline"]


@dataclass
class Response:
    """One prompt's answer (MII's ``Response``)."""

    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str

    def __str__(self) -> str:
        return self.generated_text


def _transformers():
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "loading a model directory needs transformers: pip install 'shardspeed[hf]'"
        ) from error
    return transformers


def load_model(
    model_dir: str, *, tensor_parallel: int = 1, dtype=torch.float32, max_out_tokens=None, **kwargs
):
    """(engine, tokenizer) for a Hugging Face causal-LM directory (config.json + *.safetensors + tokenizer)."""
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    engine = init_inference(
        model, dtype=dtype, checkpoint=str(model_dir), tensor_parallel={"tp_size": tensor_parallel},
        max_out_tokens=max_out_tokens or context, **kwargs,
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return engine, tokenizer


def settings_for(engine, tokenizer, max_new_tokens: int, **sampling) -> GenerationSettings:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else None
    kwargs = {k: v for k, v in sampling.items() if v is not None}
    kwargs.setdefault("eos_token_id", eos)
    kwargs["max_new_tokens"] = max_new_tokens
    return GenerationSettings.resolve(engine.module, 0, kwargs)


class Pipeline:
    """``pipe(prompts, max_new_tokens=…)`` → list of ``Response`` (continuous batching in this process)."""

    def __init__(self, engine, tokenizer, *, max_batch: int = 32):
        if not isinstance(engine.decoder, FastDecoder):
            raise ValueError(
                f"pipeline: continuous batching needs a Llama-style model (Llama, Mistral, Qwen2); "
                f"{type(engine.module).__name__} can use engine.generate instead"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.batcher = ContinuousBatcher(
            engine.decoder, max_len=engine.config.max_out_tokens, max_batch=max_batch
        )

    def __call__(self, prompts, max_new_tokens: int = 128, return_full_text: bool = False, **sampling):
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        settings = settings_for(self.engine, self.tokenizer, max_new_tokens, **sampling)
        requests = []
        for prompt in prompts:
            ids = self.tokenizer(prompt)["input_ids"]
            request = BatchRequest(prompt_ids=list(ids), settings=settings, emit=lambda token, reason: None)
            self.batcher.submit(request)
            requests.append(request)
        while self.batcher.step():
            pass
        responses = []
        for prompt, request in zip(prompts, requests):
            text = self.tokenizer.decode(request.generated, skip_special_tokens=True)
            responses.append(
                Response(
                    generated_text=prompt + text if return_full_text else text,
                    prompt_length=len(request.prompt_ids),
                    generated_length=len(request.generated),
                    finish_reason=request.finish_reason,
                )
            )
        return responses


def pipeline(model_name_or_path: str, tensor_parallel: int = 1, dtype=torch.float32, **kwargs) -> Pipeline:
    """MII's ``mii.pipeline``: load ``model_name_or_path`` (a local directory) and return a ``Pipeline``."""
    max_batch = kwargs.pop("max_batch", 32)
    engine, tokenizer = load_model(model_name_or_path, tensor_parallel=tensor_parallel, dtype=dtype, **kwargs)
    return Pipeline(engine, tokenizer, max_batch=max_batch)
