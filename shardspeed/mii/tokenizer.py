"""A byte-level tokenizer built locally (no download): token id = byte value, plus ``<|endoftext|>`` = 256.

Models trained on raw bytes (examples/train_to_serve.py) are served with it: ``byte_tokenizer()`` returns a
Hugging Face ``PreTrainedTokenizerFast`` that ``save_pretrained`` writes next to the weights, so the model
directory loads with ``AutoTokenizer`` like any other. Bytes are shown as GPT-2's printable byte alphabet
inside the tokenizer and decode back to the original text.
"""

from __future__ import annotations

__all__ = ["END_OF_TEXT", "byte_tokenizer", "byte_values"]

END_OF_TEXT = 256


def _byte_alphabet() -> list[str]:
    """256 printable characters, one per byte value (printable bytes stand for themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_values() -> dict[str, int]:
    """Character of the byte alphabet -> byte value (GPT-2's alphabet: any byte-level BPE token reads back)."""
    return {char: byte for byte, char in enumerate(_byte_alphabet())}


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` over bytes (ids 0-255) with ``<|endoftext|>`` (256) as eos and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    vocab["<|endoftext|>"] = END_OF_TEXT
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
