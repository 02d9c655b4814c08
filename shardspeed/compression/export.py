"""The packed model on disk: one safetensors file with a small metadata header, and loading it back.

``export_packed(model, path)`` writes the cleaned model's state: packed layers as their ``qweight`` /
``scales`` / ``offsets`` buffers (names as in ``state_dict()``), everything else as is (floating tensors in
``dtype`` when given, e.g. fp16). Tied tensors are written once. The header (safetensors' string metadata):

    "shardspeed_packed": "1"
    "packed_layers": JSON {layer name: {"kind": "linear"|"embedding"|"conv2d", "shape", "bits",
                     "storage_bits", "blocks", "signed", "binary", "asymmetric", "compute_dtype", ...}}
    "aliases": JSON {state-dict name: the name it was written under}   (tied weights)

``is_packed_file`` / ``packed_layers`` read the header; ``make_packed_shells(model, layers)`` swaps a freshly
built model's layers (Linear/Embedding/Conv2d of the original architecture, meta device allowed) for empty
packed layers of the recorded shapes, so the file's tensors load into them by name. ``init_inference`` and
``shardspeed-serve`` do that when a checkpoint directory holds a packed file (inference/loading.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from .helper import recursive_getattr, recursive_setattr
from .packed import PackedConv2d, PackedEmbedding, PackedLinear, PackedWeight

__all__ = ["export_packed", "is_packed_file", "load_packed_state", "make_packed_shells", "packed_layers"]

FORMAT_KEY = "shardspeed_packed"
_KINDS = {PackedLinear: "linear", PackedEmbedding: "embedding", PackedConv2d: "conv2d"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _describe(layer: nn.Module) -> dict:
    packed: PackedWeight = layer.packed
    info = {
        "kind": _KINDS[type(layer)], "shape": list(packed.shape), "bits": packed.bits,
        "storage_bits": packed.storage_bits, "blocks": packed.blocks, "signed": packed.signed,
        "binary": packed.binary, "asymmetric": packed.asymmetric, "bias": layer.bias is not None,
        "compute_dtype": str(layer.compute_dtype).removeprefix("torch."),
    }  # fmt: skip
    if isinstance(layer, PackedEmbedding):
        info["padding_idx"] = layer.padding_idx
    if isinstance(layer, PackedConv2d):
        info["conv"] = {k: list(v) if isinstance(v, tuple) else v for k, v in layer.conv.items()}
    if layer.activation_quantization is not None:
        raise ValueError(
            "export_packed: activation quantization is a property of the compressed model's forward, not of its "
            "weights; the packed format stores weights only (serve the model in Python instead)"
        )
    return info


def export_packed(
    model: nn.Module, path, *, dtype: torch.dtype | None = None, metadata: dict | None = None
) -> int:
    """Write ``model`` (after ``redundancy_clean``) to ``path`` (a .safetensors file); returns its size in bytes.
    ``dtype``: cast the floating tensors that are not packed (norms, embeddings, biases) to it."""
    from shardspeed.checkpoint.consolidate import save_safetensors

    inner = model.module if hasattr(model, "module") else model
    layers = {name: _describe(m) for name, m in inner.named_modules() if type(m) in _KINDS}
    if not layers:
        raise ValueError("export_packed: the model has no packed layers; call redundancy_clean first")
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in inner.state_dict(keep_vars=False).items():
        owner = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.dtype,
        )
        if owner in seen:
            aliases[name] = seen[owner]
            continue
        seen[owner] = name
        if dtype is not None and tensor.is_floating_point() and not name.endswith((".scales", ".offsets")):
            tensor = tensor.to(dtype)
        tensors[name] = tensor.detach().cpu().contiguous()
    header = {FORMAT_KEY: "1", "packed_layers": json.dumps(layers), "aliases": json.dumps(aliases)}
    header.update({k: str(v) for k, v in (metadata or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, path, metadata=header)
    return os.path.getsize(path)


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as handle:
        return handle.metadata() or {}


def is_packed_file(path) -> bool:
    return Path(path).suffix == ".safetensors" and _metadata(path).get(FORMAT_KEY) == "1"


def packed_layers(path) -> tuple[dict, dict]:
    """(layer name -> description, alias -> written name) from a packed file's header."""
    meta = _metadata(path)
    return json.loads(meta.get("packed_layers", "{}")), json.loads(meta.get("aliases", "{}"))


class _Shell(nn.Module):
    """Just enough of a source layer for a packed layer's constructor."""

    def __init__(self, info: dict, device):
        super().__init__()
        dtype = _DTYPES[info["compute_dtype"]]
        self.weight = torch.empty(0, dtype=dtype, device=device)
        out = info["shape"][0]
        self.bias = torch.empty(out, dtype=dtype, device=device) if info.get("bias") else None
        self.padding_idx, self.max_norm, self.padding_mode = info.get("padding_idx"), None, "zeros"
        for key, value in (info.get("conv") or {}).items():
            setattr(self, key, tuple(value) if isinstance(value, list) else value)


def make_packed_shells(model: nn.Module, layers: dict) -> None:
    """Replace each named layer of ``model`` by an empty packed layer of the recorded layout (same device)."""
    for name, info in layers.items():
        try:
            old = recursive_getattr(model, name)
        except AttributeError:
            raise ValueError(f"packed checkpoint: layer {name} does not exist in the model") from None
        device = next(iter(old.parameters()), torch.empty(0)).device
        expected = list(old.weight.shape) if hasattr(old, "weight") else None
        if expected is not None and expected != info["shape"]:
            raise ValueError(
                f"packed checkpoint: {name} holds a {info['shape']} weight, the model expects {expected} "
                "(build the model with the compressed shapes: fewer layers, pruned dimensions)"
            )
        packed = PackedWeight(info["shape"], info["bits"], info["blocks"], signed=info["signed"],
                              binary=info["binary"], asymmetric=info["asymmetric"], device=device)  # fmt: skip
        shell = _Shell(info, device)
        kind = {"linear": PackedLinear, "embedding": PackedEmbedding, "conv2d": PackedConv2d}[info["kind"]]
        recursive_setattr(model, name, kind(shell, packed))


def load_packed_state(model: nn.Module, path, strict: bool = True) -> nn.Module:
    """Load a packed file into ``model`` (the uncompressed architecture with the compressed shapes)."""
    from safetensors.torch import load_file

    layers, aliases = packed_layers(path)
    device = next(iter(model.parameters()), torch.empty(0)).device
    make_packed_shells(model, layers)
    state = load_file(os.fspath(path), device=str(device if device.type != "meta" else "cpu"))
    for alias, source in aliases.items():
        state[alias] = state[source]
    model.load_state_dict(state, strict=strict, assign=True)
    return model
