"""Our decode path over the official modules' weights: slot KV caches, batched frames, on-device sampling.

One frame (80 ms of audio) is: the 15-step code predictor on the talker's last hidden state and codebook-0
token, the sum of the 16 codebook embeddings plus the next text-track embedding, one talker step, and the
sampling of the next codebook-0 token. `frame_step` does all of it for rows 0..b-1 of the slot tables with
fixed shapes and no host synchronisation, so the CUDA path can capture it as one graph per (batch, KV-length)
bucket while the CPU path simply calls it. Where Triton runs (a GPU), a decoder stack (talker or code
predictor) whose shapes the kernels take runs its layers as `kernels.decode_layer`, its heads as
`kernels.gemv` and each sampling with the frame's per-row state as one `kernels.frame` launch, so a graphed
frame is Triton kernels only; other stacks, and every stack elsewhere, move the same state through PyTorch
ops. The choice is made once, at load (`kernel_paths.choose_kernel_paths`), never per step.

Every request owns one slot: its rows of the KV cache and of the per-slot state tensors below. Rows that are
not active in a step still flow through the maths but write their KV to a scratch column and keep their state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...kernels import decode_layer, gemv
from ...kernels import frame as frame_kernels
from ...models.compat import OfficialModule
from .host import upload, upload_together
from .kernel_paths import TRITON_PATH, choose_kernel_paths
from .layers import FusedDecoderLayer, rope_tables
from .prompt import PrefillRow
from .sampling import DEFAULT_TOP_K_CAP, SamplerRows, apply_repetition_penalty, gumbel_noise_at, sample
from .staging import StagingCache

PREDICTOR_POSITIONS = 16  # 2-token prefill (talker hidden, codebook 0) + 14 single steps
# the rows of the per-slot tables (`ModelRunner.reset_slot`)
_INT_FIELDS = ("pos", "n_sampled", "step_idx", "text_len", "top_k", "sub_top_k", "seed")
_FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "sub_temperature", "sub_top_p")
_FLAG_FIELDS = ("do_sample", "sub_do_sample", "forbid_eos")


class ModelRunner:
    """Slot-based talker + code predictor over the weights of an official `Qwen3TTSForConditionalGeneration`."""

    def __init__(
        self,
        model: OfficialModule,
        *,
        max_slots: int,
        max_seq_len: int,
        max_text_tokens: int,
        top_k_cap: int = DEFAULT_TOP_K_CAP,
        fused_kernels: bool = True,
        prefix_entries: int = 0,
        prefix_len: int = 64,
        staged_prefill: bool = False,
    ) -> None:
        """`fused_kernels`: where Triton can run (a GPU), the talker's single-token steps and every predictor
        step run as the Triton kernels (`qwen3tts_agent.kernels`), for each stack whose shapes they take;
        elsewhere, for other stacks, and for prompts, PyTorch. `kernel_paths` says which.

        `prefix_entries`: how many voice prefixes (a prompt's voice-only head, up to `prefix_len` positions)
        the prefix store holds (`store_prefix`, `copy_prefix`); 0 for none. `staged_prefill`: with a store
        and a Triton talker, one-token prompt pieces run as the decode step in a staging cache (`staging`)."""
        talker = model.talker
        cfg = model.config.talker_config
        pcfg = cfg.code_predictor_config
        if cfg.sliding_window is not None or getattr(pcfg, "sliding_window", None) is not None:
            raise NotImplementedError("sliding-window attention is not used by released Qwen3-TTS models")
        self.device = next(talker.parameters()).device
        self.dtype = next(talker.parameters()).dtype
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.max_text_tokens = max_text_tokens
        self.top_k_cap = top_k_cap
        self.num_groups = cfg.num_code_groups
        self.vocab_size = cfg.vocab_size
        self.eos_id = cfg.codec_eos_token_id
        self.tts_pad_id = model.config.tts_pad_token_id

        self.layers = [FusedDecoderLayer(layer) for layer in talker.model.layers]
        self.norm = talker.model.norm
        self.codec_head = talker.codec_head
        self.codec_embedding = talker.model.codec_embedding
        self.text_embedding = talker.model.text_embedding
        self.text_projection = talker.text_projection
        self.hidden_size = cfg.hidden_size
        # RoPE rows by position, the spare column's included: the kernels index them by write position
        talker_positions = torch.arange(max_seq_len + 1, device=self.device)
        self.cos, self.sin = rope_tables(talker.model.rotary_emb.inv_freq.to(self.device), talker_positions, self.dtype)

        predictor = talker.code_predictor
        self.p_layers = [FusedDecoderLayer(layer) for layer in predictor.model.layers]
        self.p_norm = predictor.model.norm
        self.p_heads = list(predictor.lm_head)
        self.p_embeddings = list(predictor.model.codec_embedding)
        self.p_in_proj = predictor.small_to_mtp_projection
        p_inv_freq = predictor.model.rotary_emb.inv_freq.to(self.device)
        p_pos = torch.arange(PREDICTOR_POSITIONS, device=self.device)
        self.p_cos, self.p_sin = rope_tables(p_inv_freq, p_pos, self.dtype)
        # per stack ("talker", "predictor", "codec"): "triton", or "pytorch (why not)"
        self.kernel_paths = choose_kernel_paths(
            self.layers, self.p_layers, model.speech_tokenizer.model.decoder,
            device=self.device, dtype=self.dtype, max_slots=max_slots, requested=fused_kernels,
        )
        self.fused_talker = self.kernel_paths["talker"] == TRITON_PATH
        self.fused_predictor = self.kernel_paths["predictor"] == TRITON_PATH

        dev, dt = self.device, self.dtype
        kv_heads, head_dim = cfg.num_key_value_heads, self.layers[0].head_dim
        # One spare column per slot: inactive rows write their keys there. Keys and values of every layer
        # are views of one tensor [2, layers, slots, kv_heads, positions, head_dim], so that a slot's
        # positions [0, n) of all layers are one strided view: copying a prefix is one copy.
        n_layers = len(self.layers)
        self.kv_cache = torch.zeros(2, n_layers, max_slots, kv_heads, max_seq_len + 1, head_dim, device=dev, dtype=dt)
        self.k_cache, self.v_cache = list(self.kv_cache[0].unbind(0)), list(self.kv_cache[1].unbind(0))
        # voice prefixes (the KV of prompt heads), and the staging cache of one-token prompt pieces
        self.prefix_entries = prefix_entries
        self.prefix_len = min(prefix_len, max_seq_len - 1) if prefix_entries else 0
        self.prefix_kv = torch.zeros(2, n_layers, prefix_entries, kv_heads, self.prefix_len, head_dim, device=dev, dtype=dt)
        # None where staging is off (`Prefills` also turns it off when its graphs fail to capture)
        self.staging = StagingCache(self) if staged_prefill and prefix_entries and self.fused_talker else None
        p_heads, p_dim = pcfg.num_key_value_heads, self.p_layers[0].head_dim
        self.pk_cache = [torch.zeros(max_slots, p_heads, PREDICTOR_POSITIONS, p_dim, device=dev, dtype=dt) for _ in self.p_layers]
        self.pv_cache = [torch.zeros_like(k) for k in self.pk_cache]

        long = dict(device=dev, dtype=torch.int64)
        # Per-slot scalars live in three tables, one row per field, so that resetting a slot is one
        # asynchronous upload per table (`reset_slot`); each field is a contiguous [max_slots] row view.
        self._slot_ints = torch.zeros(len(_INT_FIELDS), max_slots, **long)
        self._slot_floats = torch.ones(len(_FLOAT_FIELDS), max_slots, device=dev)
        self._slot_flags = torch.zeros(len(_FLAG_FIELDS), max_slots, device=dev, dtype=torch.bool)
        ints = dict(zip(_INT_FIELDS, self._slot_ints.unbind(0), strict=True))
        floats = dict(zip(_FLOAT_FIELDS, self._slot_floats.unbind(0), strict=True))
        flags = dict(zip(_FLAG_FIELDS, self._slot_flags.unbind(0), strict=True))
        # per-slot decode state
        self.pos = ints["pos"]  # next talker cache position
        self.n_sampled = ints["n_sampled"]  # codebook-0 tokens sampled so far
        self.step_idx = ints["step_idx"]  # frames produced = index into the text track
        self.text_len = ints["text_len"]
        self.code0 = torch.zeros(max_slots, **long)  # last sampled codebook-0 token
        # the first predictor step's two inputs: the talker's last hidden state and the embedding of code0
        self.p_input = torch.zeros(max_slots, 2, cfg.hidden_size, device=dev, dtype=dt)
        self.seen = torch.zeros(max_slots, self.vocab_size, device=dev, dtype=torch.bool)
        # the text track, projected when it arrives (`append_text`), and what follows its end
        self.text_embeds = torch.zeros(max_slots, max_text_tokens, cfg.hidden_size, device=dev, dtype=dt)
        with torch.inference_mode():
            self.pad_embed = self.text_track_embeddings(torch.tensor([self.tts_pad_id], device=dev))[0]
        # per-slot sampling parameters
        self.do_sample, self.sub_do_sample, self.forbid_eos = flags["do_sample"], flags["sub_do_sample"], flags["forbid_eos"]
        self.temperature, self.top_p, self.top_k = floats["temperature"], floats["top_p"], ints["top_k"]
        self.sub_temperature, self.sub_top_p, self.sub_top_k = floats["sub_temperature"], floats["sub_top_p"], ints["sub_top_k"]
        self.repetition_penalty = floats["repetition_penalty"]
        self.seed = ints["seed"]
        # step inputs and outputs
        self.active = torch.zeros(max_slots, device=dev, dtype=torch.bool)
        # a frame's outputs side by side (the 16 codes, then 1 where EOS was sampled): one copy to the host
        self.frame_out = torch.zeros(max_slots, self.num_groups + 1, **long)
        self.frame_codes, self.finished = self.frame_out[:, : self.num_groups], self.frame_out[:, self.num_groups]
        # within a frame: the last code's embedding (the next predictor input), the running sum of the codes'
        # embeddings, then the talker's input and cache write position
        self.p_step_input = torch.zeros(max_slots, cfg.hidden_size, device=dev, dtype=dt)
        self.embed_sum = torch.zeros(max_slots, cfg.hidden_size, device=dev)
        self.talker_input = torch.zeros(max_slots, cfg.hidden_size, device=dev, dtype=dt)
        self.write_pos = torch.zeros(max_slots, **long)

        # tokens 2048..3071 are control codes, never audio; only EOS among them may be sampled
        self.suppress = torch.zeros(self.vocab_size, device=dev, dtype=torch.bool)
        self.suppress[self.vocab_size - 1024 :] = True
        self.suppress[self.eos_id] = False
        self._arange_slots = torch.arange(max_slots, device=dev)
        self._predictor_positions = torch.arange(PREDICTOR_POSITIONS, device=dev)
        # the slot tensors `kernels.frame` reads and writes, by name
        self._frame_state = {
            **ints, **floats, **flags, "code0": self.code0, "p_input": self.p_input, "seen": self.seen,
            "text_embeds": self.text_embeds, "pad_embed": self.pad_embed, "active": self.active,
            "frame_codes": self.frame_codes, "finished": self.finished, "p_step_input": self.p_step_input,
            "embed_sum": self.embed_sum, "talker_input": self.talker_input, "write_pos": self.write_pos,
            "suppress": self.suppress, "codec_embedding": self.codec_embedding.weight,
        }

    def lend_codec_cores(self, codec_idle: Callable[[], bool]) -> None:
        """A CPU backend runs its graphs on the codec's cores too while `codec_idle()` says they are idle.
        This runner's ops run on its caller's threads, whatever the codec does."""

    # ----------------------------------------------------------------- slot management (host side, between steps)
    def reset_slot(self, slot: int, sampling: dict[str, float | int | bool]) -> None:
        """Clear a slot's state and set its sampling parameters (keys as in `SamplingParams`).

        Only asynchronous uploads and fills: `tensor[i] = number` would copy from pageable memory, which
        waits for everything queued on the stream.
        """
        fields = {
            "pos": 0, "n_sampled": 0, "step_idx": 0, "text_len": 0,
            "top_k": min(max(int(sampling["top_k"]), 1), self.top_k_cap),
            "sub_top_k": min(max(int(sampling["subtalker_top_k"]), 1), self.top_k_cap),
            "seed": int(sampling["seed"]),
            "temperature": float(sampling["temperature"]), "top_p": float(sampling["top_p"]),
            "repetition_penalty": float(sampling["repetition_penalty"]),
            "sub_temperature": float(sampling["subtalker_temperature"]), "sub_top_p": float(sampling["subtalker_top_p"]),
            "do_sample": bool(sampling["do_sample"]), "sub_do_sample": bool(sampling["subtalker_do_sample"]),
            "forbid_eos": bool(sampling["ignore_eos"]),
        }
        tables = ((self._slot_ints, _INT_FIELDS), (self._slot_floats, _FLOAT_FIELDS), (self._slot_flags, _FLAG_FIELDS))
        columns = upload_together([([fields[name] for name in names], table.dtype) for table, names in tables], self.device)
        for (table, _), column in zip(tables, columns, strict=True):
            table[:, slot] = column
        self.seen[slot].zero_()

    @torch.inference_mode()
    def append_text(self, slot: int, start: int, ids: list[int]) -> None:
        """Make more text-track tokens available to a slot (ids may end with tts_eos).

        Their embeddings are projected here, between frames, so that a frame only looks one up.
        """
        end = start + len(ids)
        if end > self.max_text_tokens:
            raise ValueError(f"text track longer than {self.max_text_tokens} tokens")
        self.text_embeds[slot, start:end] = self.text_track_embeddings(upload(ids, torch.int64, self.device))
        self.text_len[slot].fill_(end)  # a fill, not a (synchronising) copy from a host scalar

    def store_prefix(self, slot: int, entry: int, length: int) -> None:
        """Keep `slot`'s cache positions [0, length) of every layer (a prompt's voice-only head, just
        prefilled) as prefix `entry` of the store. One asynchronous device copy, on the current stream."""
        if not 0 < length <= self.prefix_len or not 0 <= entry < self.prefix_entries:
            raise ValueError(f"prefix entry {entry} of {length} positions does not fit the prefix store")
        self.prefix_kv[:, :, entry, :, :length].copy_(self.kv_cache[:, :, slot, :, :length])

    def copy_prefix(self, entry: int, slot: int, length: int) -> None:
        """Start `slot`'s cache with prefix `entry` (positions [0, length) of every layer) instead of
        prefilling them: the prompt's next piece then starts at position `length`. One asynchronous copy."""
        if not 0 < length <= self.prefix_len or not 0 <= entry < self.prefix_entries:
            raise ValueError(f"prefix entry {entry} of {length} positions does not fit the prefix store")
        self.kv_cache[:, :, slot, :, :length].copy_(self.prefix_kv[:, :, entry, :, :length])

    def move_slot(self, src: int, dst: int, positions: int, text_tokens: int) -> None:
        """Move a slot's decode state to another slot, which then carries on the stream exactly as `src`
        would have: its cache positions [0, positions) of every layer, its first `text_tokens` text-track
        embeddings, every per-slot table and the state between frames. Asynchronous device copies on the
        current stream, so they follow the steps queued before them; `src` is free afterwards."""
        if positions:
            self.kv_cache[:, :, dst, :, :positions].copy_(self.kv_cache[:, :, src, :, :positions])
        if text_tokens:
            self.text_embeds[dst, :text_tokens].copy_(self.text_embeds[src, :text_tokens])
        for table in (self._slot_ints, self._slot_floats, self._slot_flags):
            table[:, dst].copy_(table[:, src])
        for state in (self.code0, self.p_input, self.seen):  # the next frame's inputs and the penalty mask
            state[dst].copy_(state[src])

    # ----------------------------------------------------------------- the model maths
    def text_track_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.text_embedding(ids))

    def _talker_forward(
        self,
        x: torch.Tensor,
        write_rows: torch.Tensor,
        write_pos: torch.Tensor,
        read_rows: slice | torch.Tensor,
        read_len: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The talker's layers (before its final norm). The frame step's talker (one token per row, rows =
        slots 0..b-1, keys up to the written position: `mask` None) runs as the kernels when fused; prompts
        (many tokens, their own masks) stay on the PyTorch layers."""
        fused = self.fused_talker and mask is None
        if mask is None and not fused:
            mask = (torch.arange(read_len, device=self.device) <= write_pos.unsqueeze(-1)).unsqueeze(1)
        if fused:
            return decode_layer.decode_layers(
                self.layers, self.k_cache, self.v_cache, x, self.cos, self.sin, write_pos, read_len, masked=True
            )
        cos, sin = self.cos[write_pos], self.sin[write_pos]
        for layer, ck, cv in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            x = layer(x, cos, sin, ck, cv, write_rows, write_pos, read_rows, read_len, mask)
        return x

    def _predictor_forward(self, x: torch.Tensor, b: int, start: int) -> torch.Tensor:
        """Predictor layers on x [b, t, hidden] at cache positions start..start+t-1, each token attending the
        keys up to its own (t = 2 on the first step, then 1); returns the last token's state [b, hidden]."""
        t = x.shape[1]
        x = self._to_predictor_width(x)
        pos = self._predictor_positions[start : start + t].expand(b, t)
        if self.fused_predictor:
            x = decode_layer.decode_layers(
                self.p_layers, self.pk_cache, self.pv_cache, x, self.p_cos, self.p_sin, pos, start + t, masked=False
            )
            return x[:, -1]
        cos, sin = self.p_cos[pos], self.p_sin[pos]
        rows = self._arange_slots[:b].unsqueeze(1)
        for layer, ck, cv in zip(self.p_layers, self.pk_cache, self.pv_cache, strict=True):
            x = layer(x, cos, sin, ck, cv, rows, pos, slice(0, b), start + t, None)
        return x[:, -1]

    def _to_predictor_width(self, x: torch.Tensor) -> torch.Tensor:
        """The talker-to-predictor projection (1.7B: a biased Linear, 2048 -> 1024; 0.6B: identity), as one
        GEMV kernel when fused: a cuBLAS call in the middle of the predictor's Triton kernels costs more than
        one more GEMV (measured in docs/performance.md)."""
        proj = self.p_in_proj
        rows = x.reshape(-1, x.shape[-1])
        if not isinstance(proj, torch.nn.Linear) or not self.fused_predictor or rows.shape[0] > gemv.GEMV_MAX_ROWS:
            return proj(x)
        out = torch.empty(rows.shape[0], proj.out_features, device=x.device, dtype=x.dtype)
        gemv.gemv(rows, proj.weight, out, bias=proj.bias)
        return out.view(*x.shape[:-1], proj.out_features)

    def _logits(self, x: torch.Tensor, norm: OfficialModule, head: torch.nn.Linear, fused: bool) -> torch.Tensor:
        """head(norm(x)) for rows x [b, hidden], as one kernel when `fused` (the stack's kernel path)."""
        if not fused or x.shape[0] > gemv.GEMV_MAX_ROWS:
            return head(norm(x))
        logits = torch.empty(x.shape[0], head.weight.shape[0], device=x.device, dtype=x.dtype)
        gemv.gemv(x, head.weight, logits, norm=norm.weight, eps=norm.variance_epsilon)
        return logits

    def _sample_code0(self, logits: torch.Tensor, slots: torch.Tensor, sampling: bool) -> torch.Tensor:
        """Talker sampling for the given slots (PyTorch): the official processors, then warp and draw.

        The draw counter of a slot's next codebook-0 token is n_sampled * num_groups (see `predict_codes`).
        """
        eos_blocked = (self.n_sampled[slots] < 2) | self.forbid_eos[slots]
        params = SamplerRows(
            do_sample=self.do_sample[slots], temperature=self.temperature[slots], top_k=self.top_k[slots],
            top_p=self.top_p[slots],
        )
        scores = apply_repetition_penalty(logits.float(), self.seen[slots], self.repetition_penalty[slots])
        scores = scores.masked_fill(self.suppress, float("-inf"))
        scores[:, self.eos_id] = torch.where(eos_blocked, float("-inf"), scores[:, self.eos_id])
        def gumbel_at(ids: torch.Tensor) -> torch.Tensor:  # only sampling rows draw: greedy steps skip it
            return gumbel_noise_at(self.seed[slots], self.n_sampled[slots] * self.num_groups, ids)

        return sample(scores, params, gumbel_at, self.top_k_cap, sampling)

    def _record_code0(
        self, logits: torch.Tensor, slots: torch.Tensor, act: torch.Tensor, hidden: torch.Tensor, *, frame: bool,
        sampling: bool = True,
    ) -> None:
        """Sample the next codebook-0 token of `slots` and, where `act`, record it and the talker's last hidden
        state as the slot's first predictor input. `hidden`: normed for prompts; the last layer's output for a
        frame, normed here. `frame` also advances the slots' positions and flags EOS."""
        if self.fused_talker:
            norm = dict(norm=self.norm.weight, eps=self.norm.variance_epsilon) if frame else {}
            frame_kernels.talker_code0(
                logits, slots, act, hidden, self._frame_state, self.top_k_cap, eos_id=self.eos_id, frame=frame, **norm
            )
            return
        if frame:
            hidden = self.norm(hidden)
        code0 = self._sample_code0(logits, slots, sampling)
        self.code0[slots] = torch.where(act, code0, self.code0[slots])
        first = torch.stack([hidden, self.codec_embedding(code0)], dim=1)
        self.p_input[slots] = torch.where(act.view(-1, 1, 1), first, self.p_input[slots])
        self.seen[slots, code0] = self.seen[slots, code0] | act  # touches n entries, not n x vocab
        self.n_sampled[slots] += act.long()
        if frame:
            self.pos[slots] += act.long()
            self.step_idx[slots] += act.long()
            self.finished[slots] = (act & (code0 == self.eos_id)).long()

    def _record_code(self, logits: torch.Tensor, code: int, b: int, sampling: bool) -> None:
        """Sample code `code` (1..15) of the frame for slots [0, b); its embedding is the next predictor input
        and joins the frame's sum, which after the last code becomes the talker's input with the text track."""
        if self.fused_predictor:
            frame_kernels.predictor_code(
                logits, code, self.p_embeddings[code - 1].weight, self._frame_state, self.top_k_cap, spare_pos=self.max_seq_len
            )
            return
        rows = slice(0, b)
        params = SamplerRows(
            do_sample=self.sub_do_sample[rows], temperature=self.sub_temperature[rows], top_k=self.sub_top_k[rows],
            top_p=self.sub_top_p[rows],
        )
        def gumbel_at(ids: torch.Tensor) -> torch.Tensor:  # only sampling rows draw: greedy steps skip it
            # draw counters: (n_sampled - 1) * num_groups for codebook 0 (drawn by the talker), then one more
            # for each of the frame's codes 1..15; the talker's next draw follows them
            counter = (self.n_sampled[rows] - 1) * self.num_groups + code
            return gumbel_noise_at(self.seed[rows], counter, ids)

        token = sample(logits, params, gumbel_at, self.top_k_cap, sampling)
        self.frame_codes[rows, code] = token
        embed = self.p_embeddings[code - 1](token)
        self.p_step_input[rows] = embed
        if code == 1:
            self.frame_codes[rows, 0] = self.code0[rows]
            total = self.p_input[rows, 1].float() + embed.float()
        else:
            total = self.embed_sum[rows] + embed.float()
        if code < self.num_groups - 1:
            self.embed_sum[rows] = total
            return
        step = self.step_idx[rows]
        text = self.text_embeds[self._arange_slots[rows], step.clamp(max=self.max_text_tokens - 1)]
        text = torch.where((step < self.text_len[rows]).unsqueeze(1), text, self.pad_embed)
        self.talker_input[rows] = total.to(self.dtype) + text
        self.write_pos[rows] = torch.where(self.active[rows], self.pos[rows], self.max_seq_len)

    @torch.inference_mode()
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        """Run prompt pieces of several slots in one batched forward pass (eagerly, unpadded)."""
        inputs = self.prefill_inputs(rows, len(rows), max(r.embeds.shape[0] for r in rows))
        kv_len = max(r.start + r.embeds.shape[0] for r in rows)
        self.finish_prefill(rows, self.prefill_forward(*inputs, kv_len=kv_len))

    def prefill_inputs(
        self, rows: Sequence[PrefillRow], batch: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad rows to [batch, length]: (embeds, slots, write positions, index of each row's last token).

        Padding positions and padding rows write to the spare cache column, so they change no slot.
        """
        spare = self.max_seq_len
        slots = [r.slot for r in rows] + [rows[0].slot] * (batch - len(rows))
        write_pos = torch.full((batch, length), spare, dtype=torch.int64)
        last = torch.zeros(batch, dtype=torch.int64)
        embeds = torch.zeros(batch, length, self.hidden_size, device=self.device, dtype=self.dtype)
        for i, r in enumerate(rows):
            t = r.embeds.shape[0]
            if r.start + t > self.max_seq_len:
                raise ValueError(f"prompt of {r.start + t} positions exceeds max_seq_len={self.max_seq_len}")
            write_pos[i, :t] = torch.arange(r.start, r.start + t)
            last[i] = t - 1
            embeds[i, :t] = r.embeds
        slot_ids, positions, last_ids = upload_together(
            [(slots, torch.int64), (write_pos, torch.int64), (last, torch.int64)], self.device
        )
        return embeds, slot_ids, positions, last_ids

    def prefill_forward(
        self, embeds: torch.Tensor, slots: torch.Tensor, write_pos: torch.Tensor, last: torch.Tensor, *, kv_len: int
    ) -> torch.Tensor:
        """Talker over padded prompt pieces [b, t, hidden]; returns each row's last hidden state [b, hidden],
        after the final norm.

        Fixed shapes for a given (b, t, kv_len) and no host synchronisation, so it can be captured.
        """
        keys = torch.arange(kv_len, device=self.device)
        mask = (keys <= write_pos.unsqueeze(-1)).unsqueeze(1)  # [b, 1, t, kv_len]
        hidden = self._talker_forward(embeds, slots.unsqueeze(1), write_pos, slots, kv_len, mask)
        return self.norm(hidden[self._arange_slots[: embeds.shape[0]], last])

    def finish_prefill(self, rows: Sequence[PrefillRow], last_hidden: torch.Tensor) -> None:
        """Advance the slots' positions; rows that end their prompt sample their first codebook-0 token."""
        n = len(rows)
        slots, ends, act = upload_together([
            ([r.slot for r in rows], torch.int64),
            ([r.start + r.embeds.shape[0] for r in rows], torch.int64),
            ([r.sample for r in rows], torch.bool),
        ], self.device)
        self.pos[slots] = ends
        if not any(r.sample for r in rows):
            return
        hidden = last_hidden[:n]
        self._record_code0(self.codec_head(hidden), slots, act, hidden, frame=False)

    @torch.inference_mode()
    def frame_step(self, b: int, kv_len: int, talker_sampling: bool = True, predictor_sampling: bool = True) -> None:
        """One frame for slots [0, b): predictor codes for the pending codebook-0 token, then the next one.

        Reads `active`; writes `frame_out`: `frame_codes` (the 16 codes of this frame) and `finished` (1 where
        EOS was sampled).
        `kv_len` must exceed every active slot's position. The sampling flags may be False only when no row
        in [0, b) samples (a host-side shortcut for greedy decoding on the CPU).
        """
        self.predict_codes(b, predictor_sampling)
        self.talker_step(b, kv_len, talker_sampling)

    def predict_codes(self, b: int, sampling: bool = True) -> None:
        """The 15-step code predictor: fills `frame_codes`, then the talker's input and write position."""
        x = self.p_input[:b]
        for code in range(1, self.num_groups):
            hidden = self._predictor_forward(x, b, start=0 if code == 1 else code)
            logits = self._logits(hidden, self.p_norm, self.p_heads[code - 1], self.fused_predictor)
            self._record_code(logits, code, b, sampling)
            x = self.p_step_input[:b].unsqueeze(1)

    def talker_step(self, b: int, kv_len: int, sampling: bool = True) -> None:
        """Talker on this frame's input, then sample and record the next codebook-0 token."""
        rows = self._arange_slots[:b]
        write_pos = self.write_pos[:b].unsqueeze(1)
        hidden = self._talker_forward(self.talker_input[:b].unsqueeze(1), rows.unsqueeze(1), write_pos, slice(0, b), kv_len, None)[:, 0]
        logits = self._logits(hidden, self.norm, self.codec_head, self.fused_talker)
        self._record_code0(logits, rows, self.active[:b], hidden, frame=True, sampling=sampling)
