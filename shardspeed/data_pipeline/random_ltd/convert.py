"""Turning a model's layers into random-LTD layers, and state dicts without the wrapper's name.

`convert_to_random_ltd(engine, LayerClass)` wraps every `LayerClass` module of the engine's model in a
`RandomLayerTokenDrop` and lets the engine attach its scheduler to those named in `random_ltd_layer_id`
(`engine.random_ltd_initialize()`); given the plain module before `initialize`, it only wraps, and the engine
attaches its scheduler when it is built. The wrapper adds `.random_ltd_layer` to its parameters' names;
`remove_random_ltd_state_dict` takes it out again, for a state dict the unwrapped model loads.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from .layer import RandomLayerTokenDrop

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]


def _inner(model) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def convert_to_random_ltd(model, convert_type: type):
    """Wrap each `convert_type` module of `model`; returns `model`.

    `model` is the engine (DeepSpeed's way: the engine then attaches its scheduler at once) or, beyond DeepSpeed,
    the plain module before `initialize`, which attaches the scheduler when it builds the engine. Converting
    first is needed with ZeRO stages 1 and 2, whose optimizer records parameter names when it is built (the
    wrapper adds `.random_ltd_layer` to them); the engine refuses a later conversion there, saying so."""
    inner = _inner(model)
    targets = [name for name, module in inner.named_modules() if isinstance(module, convert_type) and name]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = inner.get_submodule(parent_name) if parent_name else inner
        setattr(parent, child, RandomLayerTokenDrop(getattr(parent, child)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    """`state_dict` with every `.random_ltd_layer` taken out of the keys."""
    return OrderedDict((key.replace(".random_ltd_layer", ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model) -> OrderedDict:
    """The model's state dict under the names of the unwrapped model."""
    return remove_random_ltd_state_dict(_inner(model).state_dict())
