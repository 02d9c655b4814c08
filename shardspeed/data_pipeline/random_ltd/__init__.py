"""Random layerwise token dropping (random-LTD): the layer wrapper, its schedule, conversion and token moves."""

from .convert import convert_to_random_ltd, remove_random_ltd_state_dict, save_without_random_ltd
from .layer import RandomLayerTokenDrop
from .scheduler import RandomLTDScheduler

__all__ = [
    "RandomLTDScheduler",
    "RandomLayerTokenDrop",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
]
