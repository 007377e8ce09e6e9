"""Conversations to prompt token ids, through the tokenizer's chat template."""

from typing import Any

from transformers import PreTrainedTokenizerBase

Conversation = list[dict[str, Any]]


def chat_prompt_token_ids(tokenizer: PreTrainedTokenizerBase | None, conversation: Conversation,
                          add_generation_prompt: bool = True,
                          chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it. The template
    writes any special tokens itself, so none are added on top (no double BOS)."""
    text = render_chat_prompt(tokenizer, conversation, add_generation_prompt, chat_template_kwargs)
    assert tokenizer is not None, "render_chat_prompt refuses a model without a tokenizer"
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_prompt(tokenizer: PreTrainedTokenizerBase | None, conversation: Conversation,
                       add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as text, through the model's chat template or the one in
    chat_template_kwargs["chat_template"] (tokenize it without adding special tokens)."""
    chat_template_kwargs = chat_template_kwargs or {}
    template = chat_template_kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise ValueError("This model's tokenizer has no chat template: send a plain prompt instead.")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **chat_template_kwargs)
    except Exception as error:  # jinja2 errors: a message shape this template does not take
        raise ValueError(f"The chat template could not render these messages: {error}") from error
    assert isinstance(text, str), "tokenize=False renders text"
    return text
