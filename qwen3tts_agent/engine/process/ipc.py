"""Wire format between engine clients and an engine-core process (ZeroMQ multipart messages).

Every message is `[kind, payload, *buffers]`. Frequent messages (text, chunks, endings, stats) are
msgpack; a chunk's PCM travels as a raw float32 buffer beside its header. The two messages that carry
Python objects — a new request (its prompt spec holds a cloned voice's tensors) and the handshake (model
facts and the tokenizer) — are pickled: both ends are processes of one deployment that trust each other,
and the socket is a local IPC path or a private cluster address, never a public endpoint.
"""

from __future__ import annotations

import pickle
from dataclasses import fields
from typing import Any

import msgpack
import numpy as np

from ..messages import (
    AbortRequest,
    AddRequest,
    AppendText,
    ChunkOutput,
    CloseInput,
    CoreRequest,
    ErrorInfo,
    FinishOutput,
)
from ..types import ChunkTimings, FinishReason

# message kinds, client -> core
HELLO, ADD, TEXT, CLOSE, ABORT, VOICE, PING, BYE = (b"hello", b"add", b"text", b"close", b"abort", b"voice", b"ping", b"bye")
# core -> client
WELCOME, CHUNK, FINISH, STATS, VOICE_DONE = (b"welcome", b"chunk", b"finish", b"stats", b"voice_done")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode_request(message: CoreRequest) -> list[bytes]:
    if isinstance(message, AddRequest):
        return [ADD, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)]
    if isinstance(message, AppendText):
        return [TEXT, pack([message.request_id, list(message.token_ids), list(message.tentative)])]
    if isinstance(message, CloseInput):
        return [CLOSE, pack([message.request_id, list(message.token_ids)])]
    return [ABORT, pack(message.request_id)]


def decode_request(kind: bytes, payload: bytes) -> CoreRequest:
    if kind == ADD:
        message = pickle.loads(payload)
        if not isinstance(message, AddRequest):
            raise ValueError("an add message must carry an AddRequest")
        return message
    if kind == TEXT:
        rid, ids, tentative = unpack(payload)
        return AppendText(rid, tuple(int(i) for i in ids), tuple(int(i) for i in tentative))
    if kind == CLOSE:
        rid, ids = unpack(payload)
        return CloseInput(rid, tuple(int(i) for i in ids))
    if kind == ABORT:
        return AbortRequest(unpack(payload))
    raise ValueError(f"unknown request kind {kind!r}")


# ChunkTimings' fields in order: a chunk's header lists their values (read one by one: `asdict` deep-copies, and
# the core sends over a thousand chunks a second at capacity).
_TIMING_FIELDS = tuple(f.name for f in fields(ChunkTimings))


def encode_chunk(output: ChunkOutput, request_id: str) -> list[bytes | memoryview]:
    """A chunk's message. Its PCM goes as a view of the float32 array, not as a `bytes` copy of it: ZeroMQ copies it
    into its message anyway (or, from 64 KiB, sends it without a copy), so the bytes object was one copy of every
    chunk's audio too many on the core's engine thread (docs/performance.md)."""
    timings = [getattr(output.timings, name) for name in _TIMING_FIELDS]
    header = [request_id, output.frame_start, output.frame_end, output.is_last, timings]
    return [CHUNK, pack(header), np.ascontiguousarray(output.pcm, dtype=np.float32).data]


def decode_chunk(payload: bytes, pcm: bytes) -> ChunkOutput:
    rid, start, end, is_last, timings = unpack(payload)
    return ChunkOutput(rid, np.frombuffer(pcm, dtype=np.float32).copy(), start, end, is_last, ChunkTimings(*timings))


def encode_finish(output: FinishOutput, request_id: str) -> list[bytes]:
    error = None if output.error is None else [output.error.kind, output.error.message]
    body = [request_id, output.reason.value, error, output.frames, output.queue_wait, output.text_wait, output.codes]
    return [FINISH, pack(body)]


def decode_finish(payload: bytes) -> FinishOutput:
    rid, reason, error, frames, queue_wait, text_wait, codes = unpack(payload)
    return FinishOutput(
        rid, FinishReason(reason), None if error is None else ErrorInfo(*error), frames, queue_wait, text_wait, codes
    )


def encode_stats(stats: Any) -> bytes:
    return pack({f.name: getattr(stats, f.name) for f in fields(stats)})
