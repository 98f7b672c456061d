"""Prompt (prefill) construction, exactly as `Qwen3TTSForConditionalGeneration.generate` lays it out.

Every position is a text-track embedding plus a codec-track embedding. A prompt has a head that does not
depend on the target text (instruct, role, codec tags, speaker) and a body that does; with text streaming
in, the head can be run as soon as the request arrives and the body once enough text is final. The text
that the body does not take is fed one token per frame afterwards (the "trailing" text track).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TypeVar

import torch

from ...models.compat import OfficialModule
from ..messages import PromptSpec
from ..types import TextLayout, VoicePrompt
from .host import upload

K = TypeVar("K")
V = TypeVar("V")

VOICE_CACHE = 64  # cloned voices, and prompt heads, whose tensors stay on the device
_NOT_ICL = "an in-context prompt needs a cloned voice with reference codes"


@dataclass(frozen=True)
class PromptBody:
    embeds: torch.Tensor  # [t, hidden]
    trailing_ids: list[int]  # text-track ids for the following frames (tts_pad after them)


@dataclass(frozen=True)
class PrefillRow:
    """A piece of one slot's prompt: embeddings [t, hidden] written from cache position `start`.

    A prompt may arrive in pieces (its head before the text is known); the piece that ends it has
    `sample=True`, which samples the first codebook-0 token from its last position.
    """

    slot: int
    start: int
    embeds: torch.Tensor
    sample: bool


class PromptBuilder:
    """Builds prompt embeddings from the official modules of a loaded model."""

    def __init__(self, model: OfficialModule, role_ids: list[int]) -> None:
        talker = model.talker
        self._cfg = model.config
        self._tcfg = model.config.talker_config
        self._codec_embedding = talker.model.codec_embedding
        self._predictor_embeddings = list(talker.code_predictor.model.codec_embedding)
        self._text_embedding = talker.model.text_embedding
        self._text_projection = talker.text_projection
        self._device = next(talker.parameters()).device
        self._dtype = next(talker.parameters()).dtype
        self._role_ids = role_ids
        self._voices: collections.OrderedDict[str, tuple[torch.Tensor, torch.Tensor | None]] = collections.OrderedDict()
        # a head depends on the voice and the language only: callers reuse it, and each build is ~30 launches
        self._heads: collections.OrderedDict[tuple[object, ...], torch.Tensor] = collections.OrderedDict()

    @property
    def tts_eos_id(self) -> int:
        return int(self._cfg.tts_eos_token_id)

    def _text(self, ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        return self._text_projection(self._text_embedding(upload(list(ids), torch.long, self._device)))

    def _codec(self, ids: list[int]) -> torch.Tensor:
        return self._codec_embedding(upload(ids, torch.long, self._device))

    def _voice(self, clone: VoicePrompt) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A cloned voice's speaker embedding [1, hidden] and, for ICL, the codec track of its prompt body:
        codec_bos then the reference codes' embeddings [1 + frames, hidden]."""
        cached = _lru_get(self._voices, clone.voice_id)
        if cached is not None:
            return cached
        speaker = upload(clone.speaker_embedding, self._dtype, self._device).view(1, -1)
        ref = None
        if clone.ref_codes is not None:
            codes = upload(clone.ref_codes, torch.long, self._device)
            parts = [self._codec_embedding(codes[:, 0])]
            parts += [emb(codes[:, i + 1]) for i, emb in enumerate(self._predictor_embeddings)]
            ref = torch.cat([self._codec([self._tcfg.codec_bos_id]), torch.stack(parts, dim=1).sum(1)])
        return _lru_put(self._voices, clone.voice_id, (speaker, ref))

    @staticmethod
    def head_key(spec: PromptSpec) -> tuple[object, ...]:
        """What a prompt's head depends on: requests with equal keys have equal heads."""
        return (spec.language_id, spec.speaker_id, spec.clone.voice_id if spec.clone else None, spec.instruct_ids)

    @torch.inference_mode()
    def head(self, spec: PromptSpec) -> torch.Tensor:
        """The text-independent prompt part [t, hidden]; shared between requests: do not modify it."""
        key = self.head_key(spec)
        cached = _lru_get(self._heads, key)
        if cached is not None:
            return cached
        return _lru_put(self._heads, key, self._build_head(spec))

    def _build_head(self, spec: PromptSpec) -> torch.Tensor:
        cfg = self._tcfg
        if spec.language_id is None:
            tags = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
        else:
            tags = [cfg.codec_think_id, cfg.codec_think_bos_id, spec.language_id, cfg.codec_think_eos_id]
        codec = [self._codec(tags)]
        if spec.clone is not None:
            codec.append(self._voice(spec.clone)[0])
        elif spec.speaker_id is not None:
            codec.append(self._codec([spec.speaker_id]))
        codec.append(self._codec([cfg.codec_pad_id]))  # codec_bos, the last codec-prefix token, opens the body
        codec_prefix = torch.cat(codec)
        n = codec_prefix.shape[0]
        text_track = self._text([self._cfg.tts_pad_token_id] * (n - 1) + [self._cfg.tts_bos_token_id])
        parts = []
        if spec.instruct_ids:
            parts.append(self._text(spec.instruct_ids))
        parts.append(self._text(self._role_ids))
        parts.append(text_track + codec_prefix)
        return torch.cat(parts)

    def body_ready(self, spec: PromptSpec, n_text: int, closed: bool) -> bool:
        """Whether the body can be built from `n_text` final target tokens."""
        if closed:
            return True
        if spec.layout is TextLayout.PREFILL:
            return False
        if spec.icl:
            covered = len(spec.ref_text_ids) + n_text >= self._icl_codec_len(spec)
            return covered or (spec.icl_early_start and n_text >= 1)
        return n_text >= 1

    def _icl_codec_len(self, spec: PromptSpec) -> int:
        codes = spec.clone.ref_codes if spec.clone is not None else None
        if codes is None:
            raise ValueError(_NOT_ICL)
        return 1 + int(codes.shape[0])

    def _reference_track(self, spec: PromptSpec) -> torch.Tensor:
        """The codec track of an in-context prompt: codec_bos and the reference codes' embeddings."""
        track = self._voice(spec.clone)[1] if spec.clone is not None else None
        if track is None:
            raise ValueError(_NOT_ICL)
        return track

    @torch.inference_mode()
    def body(self, spec: PromptSpec, text_ids: list[int], closed: bool) -> PromptBody:
        """The text-dependent prompt part; `text_ids` are the final target tokens known so far."""
        cfg = self._tcfg
        pad, eos = self._cfg.tts_pad_token_id, self.tts_eos_id
        tail = [eos] if closed else []
        if spec.icl:
            all_ids = list(spec.ref_text_ids) + text_ids + tail
            codec = self._reference_track(spec)
            if spec.layout is TextLayout.PREFILL:
                embeds = torch.cat([
                    self._text(all_ids) + self._codec([cfg.codec_pad_id] * len(all_ids)),
                    codec + self._text([pad]),
                ])
                return PromptBody(embeds, [])
            n_codec = codec.shape[0]
            if len(all_ids) > n_codec:
                return PromptBody(self._text(all_ids[:n_codec]) + codec, all_ids[n_codec:])
            if not closed and spec.icl_early_start and text_ids:
                # Early start (opt-in, NOT the official prompt): the reference span is laid out with the text
                # known so far but its last token, padded over the rest; that token and all later text follow
                # on the text track, so the first frame needs no more text. The official layout would put
                # the later text inside the span.
                known = list(spec.ref_text_ids) + text_ids[:-1]
                return PromptBody(self._text(known + [pad] * (n_codec - len(known))) + codec, text_ids[-1:])
            return PromptBody(self._text(all_ids + [pad] * (n_codec - len(all_ids))) + codec, [])
        if spec.layout is TextLayout.PREFILL:
            ids = text_ids + tail
            embeds = torch.cat([
                self._text(ids) + self._codec([cfg.codec_pad_id] * len(ids)),
                self._text([pad]) + self._codec([cfg.codec_bos_id]),
            ])
            return PromptBody(embeds, [])
        first = self._text(text_ids[:1]) + self._codec([cfg.codec_bos_id])
        return PromptBody(first, text_ids[1:] + tail)


def _lru_get(cache: collections.OrderedDict[K, V], key: K) -> V | None:
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _lru_put(cache: collections.OrderedDict[K, V], key: K, value: V) -> V:
    cache[key] = value
    if len(cache) > VOICE_CACHE:
        cache.popitem(last=False)
    return value
