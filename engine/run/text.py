"""Text in and out of the model: prompt token ids, end-of-sequence ids, streamed text pieces, and
the output a run builds, with its budget and stop conditions."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.model.loader import LoadedModel


def prompt_ids(lm: LoadedModel, prompt: str, raw: bool) -> list[int]:
    """Token ids of the prompt: chat-formatted for instruct models unless raw."""
    return tokenizer_prompt_ids(lm.tokenizer, prompt, chat=not raw and lm.has_chat_template)


def tokenizer_prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of the prompt with a tokenizer alone: in its chat template (one user turn, then the
    assistant's turn to answer) where chat, else as plain text."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


class TextStream:
    """Turns token ids into text pieces without re-decoding the whole output each step and
    without emitting half of a multi-byte character: a piece is the text the tokens since the last one
    add, once it ends in a whole character. A fast tokenizer's own DecodeStream does this in one call a
    token; others decode the pending tokens twice, the same pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # decode() cleans up spaces around punctuation afterwards where a tokenizer asks it to; DecodeStream never
        self.fast = DecodeStream(skip_special_tokens=True) if backend is not None and \
            not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.fast is not None:
            try:
                piece = self.fast.step(self.tokenizer.backend_tokenizer, token_id)
            except Exception:  # its text no longer starts with the text it gave (bytes that stopped making a
                self.fast = None  # character, under a byte-fallback decoder): decoded twice from here on
            else:
                if piece:  # where the decoding twice below would move on too
                    self.prefix, self.read = self.read, len(self.ids)
                return piece or ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


class Output:
    """A run's output so far: token ids and text, cut at the token budget, an end-of-sequence token
    (unless ignored) or a stop string."""

    def __init__(self, lm: LoadedModel, max_new_tokens: int, stop: list[str], ignore_eos: bool):
        self.stream = TextStream(lm.tokenizer)
        self.eos = set() if ignore_eos else eos_ids(lm)
        self.max_new_tokens, self.stop = max_new_tokens, stop
        self.token_ids: list[int] = []
        self.text = ""

    def take(self, emitted: list[int]) -> tuple[list[tuple[int, str]], str, str | None]:
        """Append a step's approved tokens up to the budget or a stop; returns (token, text piece)
        pairs, the text they added and why the run ends (None: it goes on)."""
        events, added, done = [], "", None
        for token in emitted[: self.max_new_tokens - len(self.token_ids)]:
            self.token_ids.append(token)
            piece = self.stream.push(token)
            self.text += piece
            done = self._stop_check(token, piece)
            if done == "stop_string":
                cut = self._cut_at_stop()
                piece = piece[: max(0, len(piece) - (len(self.text) - len(cut)))]
                self.text = cut
            events.append((token, piece))
            added += piece
            if done:
                break
        if not done and len(self.token_ids) >= self.max_new_tokens:
            done = "max_new_tokens"
        return events, added, done

    def rewind(self, token_ids: list[int], text: str) -> None:
        """Keep only these tokens and their text (a run stopped before it recorded its last step)."""
        self.token_ids[:] = token_ids
        self.text = text

    def _stop_check(self, token: int, piece: str) -> str | None:
        if token in self.eos:
            return "eos"
        # a stop string that appeared now ends within the last piece
        if any(s and s in self.text[-(len(s) + len(piece)):] for s in self.stop):
            return "stop_string"
        return None

    def _cut_at_stop(self) -> str:
        cut = min(self.text.find(s) for s in self.stop if s and s in self.text)
        return self.text[:cut]
