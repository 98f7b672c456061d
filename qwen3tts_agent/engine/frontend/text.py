"""Text tokenization as the official package does it, and incremental tokenization for text that streams in."""

from __future__ import annotations

import logging

from ...errors import InvalidTextError

logger = logging.getLogger(__name__)

# The official templates: `<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n` for the target
# text (sliced [3:-5]), `<|im_start|>assistant\n{ref}<|im_end|>\n` for a reference transcript ([3:-2]),
# `<|im_start|>user\n{instruct}<|im_end|>\n` for an instruction. Control tokens split the tokenizer's input
# into pieces tokenized on their own, so the sliced ids are the tokens of `assistant\n{text}` minus the first two.
_ROLE_TOKENS = 3
_TEXT_PREFIX = "assistant\n"
_TEXT_PREFIX_TOKENS = 2


def validate_text(text: object, *, what: str = "text") -> str:
    """The text rules every entry point applies (Python API, WebSocket, HTTP): a `str` that is valid Unicode.

    A lone surrogate (e.g. from a JSON escape like `\\ud800`) is a `str` Python accepts but no tokenizer
    can encode; it is refused here, with the offending position, instead of failing deep inside the engine.
    """
    if not isinstance(text, str):
        raise InvalidTextError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTextError(
            f"{what} is not valid Unicode: a lone surrogate at character {exc.start}"
        ) from None
    return text


class TextTokenizer:
    """The official prompt templates over the model's Qwen2 tokenizer, with user text kept as plain text.

    The official package tokenizes user text inside its chat template, so a string such as `<|im_end|>` in
    the text becomes the control token and changes the prompt's structure. Here user text (target text,
    reference transcript, instruction) never turns into control tokens: such strings are tokenized as the
    plain characters they are. That is the one deviation from the official tokenization; for any text
    without control-token strings the ids are the official ones (tests compare them).
    """

    def __init__(self, tokenizer: object) -> None:
        """`tokenizer`: the official processor's (fast) tokenizer, or its backend's JSON (`to_json`)."""
        from tokenizers import Tokenizer

        self._json = tokenizer if isinstance(tokenizer, str) else tokenizer.backend_tokenizer.to_str()  # type: ignore[attr-defined]
        self._plain = Tokenizer.from_str(self._json)
        self._plain.encode_special_tokens = True  # control-token strings are plain text
        im_start, im_end = self._plain.token_to_id("<|im_start|>"), self._plain.token_to_id("<|im_end|>")
        if im_start is None or im_end is None:
            raise ValueError("not a Qwen chat tokenizer: <|im_start|> / <|im_end|> are missing")
        self._im_start, self._im_end = im_start, im_end
        self._newline = self._plain.encode("\n", add_special_tokens=False).ids

    def to_json(self) -> str:
        """The tokenizer as JSON, to rebuild it in another process (an engine client)."""
        return self._json

    def encode_plain(self, text: str) -> tuple[list[int], list[int | None], list[tuple[int, int]]]:
        """Ids, pre-token index and character span of every token of `text`, control-token strings as text."""
        encoding = self._plain.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.word_ids, encoding.offsets

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def role_ids(self) -> list[int]:
        return ([self._im_start] + self._plain_ids(_TEXT_PREFIX))[:_ROLE_TOKENS]

    def target_ids(self, text: str) -> list[int]:
        return self._plain_ids(_TEXT_PREFIX + text)[_TEXT_PREFIX_TOKENS:]

    def ref_ids(self, ref_text: str) -> list[int]:
        return self._plain_ids(_TEXT_PREFIX + ref_text)[_TEXT_PREFIX_TOKENS:]

    def instruct_ids(self, instruct: str) -> list[int]:
        return [self._im_start, *self._plain_ids("user\n" + instruct), self._im_end, *self._newline]


class IncrementalText:
    """Turns text deltas into target-text token ids as soon as they are final, at a cost of O(delta) each.

    BPE never merges across pre-tokens, and with the Qwen2 split pattern only the last pre-token of a text
    can still grow or re-split once more text follows (a word being typed, trailing whitespace, a
    contraction). So the ids of every pre-token but the last are final, and only the uncommitted tail (the
    last pre-token plus new text) is ever tokenized again. A delta of letters only cannot end a pre-token
    except at a change of letter case, so the tail is tokenized when a delta brings another character;
    letters wait for it (or for `close`). `close` tokenizes the tail: the ids then equal the whole text's
    (`TextTokenizer.target_ids`), which tests check on random splits of awkward strings.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._tail = _TEXT_PREFIX  # uncommitted text, starting at a pre-token boundary
        self._to_skip = _TEXT_PREFIX_TOKENS  # the template's tokens before the target text
        self.chars = 0
        self.blank = True  # only whitespace so far
        self.tokenized_chars = 0  # characters handed to the tokenizer (for the cost test)
        self.committed = 0  # target-text ids handed out so far

    def push(self, delta: str) -> list[int]:
        self._tail += delta
        self.chars += len(delta)
        if self.blank and not delta.isspace():
            self.blank = False
        if delta.isalpha():
            return []
        self.tokenized_chars += len(self._tail)
        ids, words, offsets = self._tok.encode_plain(self._tail)
        if not ids:
            return []
        cut = words.index(words[-1])  # the last pre-token's first token
        if cut == 0:
            return []
        self._tail = self._tail[min(start for start, _ in offsets[cut:]) :]
        return self._emit(ids[:cut])

    def tentative(self) -> list[int]:
        """The uncommitted tail's ids as the text stands now: what `push`/`close` will most likely commit
        next, though more text may still change them (the core may run a first frame on them, see
        `Scheduler.speculate`). Costs one tokenization of the tail; changes nothing."""
        if not self._tail:
            return []
        self.tokenized_chars += len(self._tail)
        return self._tok.encode_plain(self._tail)[0][self._to_skip :]

    def close(self) -> list[int]:
        self.tokenized_chars += len(self._tail)
        ids = self._tok.encode_plain(self._tail)[0] if self._tail else []
        self._tail = ""
        return self._emit(ids)

    def _emit(self, ids: list[int]) -> list[int]:
        skip = min(self._to_skip, len(ids))
        self._to_skip -= skip
        self.committed += len(ids) - skip
        return ids[skip:]
