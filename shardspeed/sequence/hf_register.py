"""`UlyssesSPAttentionHF.register_with_transformers`: install Ulysses under a Transformers attention name.

DeepSpeed does not register a new "ulysses" implementation: it replaces the function stored under the
model's own one (`ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper`), so every branch of Transformers that checks
`config._attn_implementation == "sdpa"` still runs, and only the attention call itself is intercepted. That
is process-wide: every model of the process using that implementation goes through Ulysses afterwards.
The function also creates the sequence-parallel groups (parallel_state.py) and returns that module as the
mpu to hand to `deepspeed.initialize` (Accelerate does both).
"""

from __future__ import annotations

import importlib.metadata
import re

from shardspeed.utils.logging import logger

__all__ = ["register_with_transformers"]

_MIN_TRANSFORMERS = (4, 51, 3)
# eager attention always materialises a 4D mask (O(s^2)) and cannot fall back to is_causal as sdpa does
_UNSUPPORTED = ("eager", "paged|eager")
# "owner/name", "owner/name@revision", "owner/name:function": a kernel from the Hub, registered lazily
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")


def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                               micro_batch_size, seq_length=None, seq_length_is_variable=True,
                               disable_in_eval=False, max_length=None):  # fmt: skip
    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        logger.warning("The 'max_length' argument is deprecated, please use `seq_length` instead")
        seq_length = max_length if seq_length is None else seq_length
    if not seq_length_is_variable and seq_length is None:
        raise ValueError(
            "Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be set to an integer value "
            "of the fixed sequence length."
        )
    _check_transformers_version()
    config = _model_config(model_name_or_path, core_attn_implementation)
    core_attn = _core_attention(core_attn_implementation)

    from shardspeed.sequence import parallel_state as mpu

    mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    arch = config.get_text_config()
    head_size = getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads
    fixed = not seq_length_is_variable
    ulysses = cls(
        attn=core_attn, batch_size=micro_batch_size, attn_head_count=arch.num_attention_heads,
        attn_head_size=head_size, kv_head_count=getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads,
        num_hidden_layers=arch.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
        seq_length_is_variable=seq_length_is_variable,
        local_seq_length=seq_length // sequence_parallel_size if fixed else None,
        global_seq_length=seq_length if fixed else None, disable_in_eval=disable_in_eval,
    )  # fmt: skip
    ulysses.core_attn_implementation = core_attn_implementation

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        # The model built its mask for the local slice: wrong for the gathered sequence, and O(s^2). Causality
        # comes from the core attention's is_causal and the gathered position ids instead.
        return ulysses(module, query, key, value, None, *args, **kwargs)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
    return mpu


def _check_transformers_version() -> None:
    have = importlib.metadata.version("transformers")
    numbers = tuple(int(n) for n in re.findall(r"\d+", have)[:3])
    if numbers < _MIN_TRANSFORMERS:
        wanted = ".".join(map(str, _MIN_TRANSFORMERS))
        raise ValueError(f"transformers>={wanted} is required, but you have transformers=={have}")


def _model_config(model_name_or_path, core_attn_implementation: str):
    """The model's config: from the loaded model (or anything with `.config`, such as a PEFT wrapper), else
    read from the Hub name or local path."""
    if not hasattr(model_name_or_path, "config"):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_name_or_path)
    config = model_name_or_path.config
    # only a loaded model's config holds the implementation resolved at load time
    loaded = getattr(config, "_attn_implementation", None)
    if loaded is not None and loaded != core_attn_implementation:
        raise ValueError(
            f"core_attn_implementation='{core_attn_implementation}' does not match model config "
            f"attn_implementation='{loaded}'. Set both to the same value so the sequence-parallel wrapper can "
            "intercept the active attention path."
        )
    return config


def _core_attention(name: str):
    if name in _UNSUPPORTED:
        raise ValueError(
            f"{name} attn_implementation isn't supported by Ulysses sequence parallelism because it requires a 4D "
            "attention_mask (O(n^2) memory). Use 'sdpa', a flash attention variant, or a hub-hosted kernel."
        )
    if name == "flex_attention":
        raise ValueError(
            "flex_attention is not supported by shardspeed's Ulysses sequence parallelism (its block mask would "
            "have to be rebuilt for the gathered sequence); use 'sdpa' or a flash attention variant"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if isinstance(name, str) and _HUB_KERNEL.search(name) is not None:
        try:  # Transformers registers Hub kernels only when first asked for them
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
        except ImportError as error:
            raise ImportError(
                "Hub kernel attention requires a transformers version exposing "
                "`transformers.modeling_flash_attention_utils.lazy_import_flash_attention`."
            ) from error
        lazy_import_flash_attention(name)
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{name} is not a valid attn_implementation. The choices are {ALL_ATTENTION_FUNCTIONS.valid_keys()}"
        )
    return ALL_ATTENTION_FUNCTIONS[name]
