"""DeepSpeed-MII's front, on shardspeed's inference engine: ``pipeline`` (in-process) and ``serve`` (HTTP).

    pipe = shardspeed.mii.pipeline("path/to/hf_model_dir")
    responses = pipe(["Hello", "Once upon a time"], max_new_tokens=32)
    client = shardspeed.mii.serve("path/to/hf_model_dir", port=28080)   # needs the `serve` extra

Modules: ``pipeline`` (model loading, Response, Pipeline), ``server`` (the ``shardspeed-serve`` command and
its lifecycle), ``app`` (the FastAPI routes), ``protocol`` (typed request bodies), ``service`` (requests to
generations), ``responses``, ``errors``, ``guard``, ``openapi`` (what the schema says), ``lifecycle``
(the drain on SIGTERM), ``metrics``, ``chat``, ``text``, ``engine_loop`` (the
generation thread), ``client`` (``serve`` and the client it returns). Loading a model directory needs the
``hf`` extra (transformers, for the config and tokenizer); the server needs ``serve``.
"""

from __future__ import annotations

import importlib

__all__ = ["Pipeline", "Response", "client", "load_model", "pipeline", "serve"]

_LAZY = {
    "Pipeline": "shardspeed.mii.pipeline",
    "Response": "shardspeed.mii.pipeline",
    "load_model": "shardspeed.mii.pipeline",
    "serve": "shardspeed.mii.client",
    "client": "shardspeed.mii.client",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardspeed.mii' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


# `pipeline` names both a submodule and its main function. Once the submodule is imported (by
# `from shardspeed.mii.pipeline import load_model`, anywhere), Python sets the package attribute to the module,
# so a lazy look-up would then return the module; binding the function here keeps `mii.pipeline(path)` callable.
from .pipeline import pipeline  # noqa: E402
