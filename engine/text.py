"""Text in and out of the model: prompt token ids, end-of-sequence ids, and streamed text pieces."""
from __future__ import annotations

from .models import LoadedModel


def prompt_ids(lm: LoadedModel, prompt: str, raw: bool) -> list[int]:
    """Token ids of the prompt: chat-formatted for instruct models unless raw."""
    if not raw and lm.has_chat_template:
        text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
        return lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return lm.tokenizer(prompt)["input_ids"]


def eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


class TextStream:
    """Turns token ids into text pieces without re-decoding the whole output each step and
    without emitting half of a multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""
