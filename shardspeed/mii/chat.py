"""Chat messages to prompt tokens: the tokenizer's own chat template, or a documented default.

A model directory may ship a chat template (``tokenizer.chat_template``, Jinja); models trained here
(examples/train_to_serve.py) have none and get ``DEFAULT_CHAT_TEMPLATE``: each message as
``<|role|>\\n`` + content + ``\\n``, then ``<|assistant|>\\n`` for the answer. Errors a template raises
(``raise_exception("roles must alternate")``) are the client's: a 400 naming ``messages``.
"""

from __future__ import annotations

from .errors import APIError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "chat_prompt_ids"]

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` (protocol.ChatMessage) rendered for the model to answer next."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        # DEFAULT_CHAT_TEMPLATE's text, written directly: rendering it through Jinja took ~5 ms a request on
        # the event loop, where every streaming client's first token waits its turn.
        text = "".join(f"<|{m.role}|>\n{m.text}\n" for m in messages) + "<|assistant|>\n"
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    plain = [{"role": m.role, "content": m.text} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            plain, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as error:  # jinja's TemplateError and the template's own raise_exception
        raise APIError(
            400, f"messages: the model's chat template refused them: {error}", "messages"
        ) from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
