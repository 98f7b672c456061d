"""Text tokenization as the official package does it, and incremental tokenization for text that streams in."""

from __future__ import annotations

import logging

from ..errors import InvalidTextError

logger = logging.getLogger(__name__)

# `<|im_start|>assistant\n` and `<|im_end|>\n<|im_start|>assistant\n` around the target text; the official
# code slices them off with [3:-5] (and `<|im_end|>\n` with [:-2] after a reference text).
_ROLE_TOKENS = 3
_TARGET_TAIL_TOKENS = 5
_REF_TAIL_TOKENS = 2


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
    """The official prompt templates over the model's Qwen2 tokenizer."""

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def role_ids(self) -> list[int]:
        return self._ids("<|im_start|>assistant\n")[:_ROLE_TOKENS]

    def target_ids(self, text: str) -> list[int]:
        ids = self._ids(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        return ids[_ROLE_TOKENS:-_TARGET_TAIL_TOKENS]

    def ref_ids(self, ref_text: str) -> list[int]:
        return self._ids(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")[_ROLE_TOKENS:-_REF_TAIL_TOKENS]

    def instruct_ids(self, instruct: str) -> list[int]:
        return self._ids(f"<|im_start|>user\n{instruct}<|im_end|>\n")

    def stable_prefix_ids(self, text: str) -> list[int]:
        """Tokens of `text` that no continuation can change: all but its last pre-token.

        BPE never merges across pre-tokens, and with the Qwen2 split regex only the last pre-token can still
        grow or re-split (a word being typed, trailing whitespace, a contraction); tests fuzz this claim.
        """
        backend = self._tok.backend_tokenizer  # type: ignore[attr-defined]
        pieces = backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text))
        if len(pieces) < 2:
            return []
        boundary = pieces[-1][1][0]
        encoding = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)  # type: ignore[operator]
        return [i for i, (_, end) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True) if end <= boundary]


class IncrementalText:
    """Turns text deltas into text-track token ids as soon as they are final.

    Once the input is closed the remainder comes from the official whole-text tokenization, so a stream
    whose text arrived in pieces is fed exactly the tokens the whole text would give.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self.text = ""
        self.committed: list[int] = []

    def push(self, delta: str) -> list[int]:
        self.text += delta
        stable = self._tok.stable_prefix_ids(self.text)
        if len(stable) <= len(self.committed) or stable[: len(self.committed)] != self.committed:
            return []
        new = stable[len(self.committed) :]
        self.committed = stable
        return new

    def close(self) -> list[int]:
        final = self._tok.target_ids(self.text)
        if final[: len(self.committed)] != self.committed:
            logger.warning("streamed tokenization diverged from the whole-text tokenization; continuing")
        new = final[len(self.committed) :]
        self.committed = final
        return new
