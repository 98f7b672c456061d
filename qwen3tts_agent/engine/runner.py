"""Our decode path over the official modules' weights: slot KV caches, batched frames, on-device sampling.

One frame (80 ms of audio) is: the 15-step code predictor on the talker's last hidden state and codebook-0
token, the sum of the 16 codebook embeddings plus the next text-track embedding, one talker step, and the
sampling of the next codebook-0 token. `frame_step` does all of it for rows 0..b-1 of the slot tables with
fixed shapes and no host synchronisation, so the CUDA path can capture it as one graph per (batch, KV-length)
bucket while the CPU path simply calls it.

Every request owns one slot: its rows of the KV cache and of the per-slot state tensors below. Rows that are
not active in a step still flow through the maths but write their KV to a scratch column and keep their state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .sampling import SamplerRows, apply_repetition_penalty, warp_and_sample

PREDICTOR_POSITIONS = 16  # 2-token prefill (talker hidden, codebook 0) + 14 single steps


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., head_dim] for integer positions, computed in float32 as the official rotary modules do."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _attention(
    attn: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    write_rows: torch.Tensor,
    write_pos: torch.Tensor,
    read_rows: slice,
    read_len: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Self-attention of a Qwen3-style layer (q/k RMSNorm, RoPE, GQA) over a static cache.

    x: [b, t, hidden]; cos/sin: [b, t, head_dim]; write_rows: [b, 1] and write_pos: [b, t] say where the new
    keys go; keys are then read from cache rows `read_rows`, positions [0, read_len), under `mask`
    (bool, broadcastable to [b, heads, t, read_len]; None means plain causal over exactly t new keys).
    """
    b, t, _ = x.shape
    head_dim = attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(b, t, -1, head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, t, -1, head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    cache_k[write_rows, :, write_pos] = k.transpose(1, 2)
    cache_v[write_rows, :, write_pos] = v.transpose(1, 2)
    keys = cache_k[read_rows, :, :read_len]
    values = cache_v[read_rows, :, :read_len]
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None and t > 1, scale=attn.scaling
    )
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _decoder_layer(layer: torch.nn.Module, x: torch.Tensor, **attn_kwargs: object) -> torch.Tensor:
    h = x + _attention(layer.self_attn, layer.input_layernorm(x), **attn_kwargs)  # type: ignore[arg-type]
    return h + layer.mlp(layer.post_attention_layernorm(h))


class ModelRunner:
    """Slot-based talker + code predictor over the weights of an official `Qwen3TTSForConditionalGeneration`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_slots: int,
        max_seq_len: int,
        max_text_tokens: int,
    ) -> None:
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
        self.num_groups = cfg.num_code_groups
        self.vocab_size = cfg.vocab_size
        self.eos_id = cfg.codec_eos_token_id
        self.tts_pad_id = model.config.tts_pad_token_id

        self.layers = list(talker.model.layers)
        self.norm = talker.model.norm
        self.codec_head = talker.codec_head
        self.codec_embedding = talker.model.codec_embedding
        self.text_embedding = talker.model.text_embedding
        self.text_projection = talker.text_projection
        self.inv_freq = talker.model.rotary_emb.inv_freq.to(self.device)

        predictor = talker.code_predictor
        self.p_layers = list(predictor.model.layers)
        self.p_norm = predictor.model.norm
        self.p_heads = list(predictor.lm_head)
        self.p_embeddings = list(predictor.model.codec_embedding)
        self.p_in_proj = predictor.small_to_mtp_projection
        p_inv_freq = predictor.model.rotary_emb.inv_freq.to(self.device)
        p_pos = torch.arange(PREDICTOR_POSITIONS, device=self.device)
        self.p_cos, self.p_sin = _rope_tables(p_inv_freq, p_pos, self.dtype)

        dev, dt = self.device, self.dtype
        kv_heads, head_dim = cfg.num_key_value_heads, self.layers[0].self_attn.head_dim
        # one spare column per slot: inactive rows write their keys there
        self.k_cache = [torch.zeros(max_slots, kv_heads, max_seq_len + 1, head_dim, device=dev, dtype=dt) for _ in self.layers]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        p_heads, p_dim = pcfg.num_key_value_heads, self.p_layers[0].self_attn.head_dim
        self.pk_cache = [torch.zeros(max_slots, p_heads, PREDICTOR_POSITIONS, p_dim, device=dev, dtype=dt) for _ in self.p_layers]
        self.pv_cache = [torch.zeros_like(k) for k in self.pk_cache]

        long = dict(device=dev, dtype=torch.int64)
        # per-slot decode state
        self.pos = torch.zeros(max_slots, **long)  # next talker cache position
        self.code0 = torch.zeros(max_slots, **long)  # last sampled codebook-0 token
        self.n_sampled = torch.zeros(max_slots, **long)  # codebook-0 tokens sampled so far
        self.step_idx = torch.zeros(max_slots, **long)  # frames produced = index into the text track
        self.past_hidden = torch.zeros(max_slots, cfg.hidden_size, device=dev, dtype=dt)
        self.seen = torch.zeros(max_slots, self.vocab_size, device=dev, dtype=torch.bool)
        self.text_ids = torch.full((max_slots, max_text_tokens), self.tts_pad_id, **long)
        self.text_len = torch.zeros(max_slots, **long)
        # per-slot sampling parameters
        self.do_sample = torch.zeros(max_slots, device=dev, dtype=torch.bool)
        self.temperature = torch.ones(max_slots, device=dev)
        self.top_k = torch.zeros(max_slots, **long)
        self.top_p = torch.ones(max_slots, device=dev)
        self.repetition_penalty = torch.ones(max_slots, device=dev)
        self.sub_do_sample = torch.zeros(max_slots, device=dev, dtype=torch.bool)
        self.sub_temperature = torch.ones(max_slots, device=dev)
        self.sub_top_k = torch.zeros(max_slots, **long)
        self.sub_top_p = torch.ones(max_slots, device=dev)
        self.seed = torch.zeros(max_slots, **long)
        self.forbid_eos = torch.zeros(max_slots, device=dev, dtype=torch.bool)
        # step inputs and outputs
        self.active = torch.zeros(max_slots, device=dev, dtype=torch.bool)
        self.frame_codes = torch.zeros(max_slots, self.num_groups, **long)
        self.finished = torch.zeros(max_slots, device=dev, dtype=torch.bool)

        # tokens 2048..3071 are control codes, never audio; only EOS among them may be sampled
        self.suppress = torch.zeros(self.vocab_size, device=dev, dtype=torch.bool)
        self.suppress[self.vocab_size - 1024 :] = True
        self.suppress[self.eos_id] = False
        self._arange_slots = torch.arange(max_slots, device=dev)

    # ----------------------------------------------------------------- slot management (host side, between steps)
    def reset_slot(self, slot: int, sampling: dict[str, float | int | bool]) -> None:
        """Clear a slot's state and set its sampling parameters (keys as in `SamplingParams`)."""
        self.pos[slot] = 0
        self.n_sampled[slot] = 0
        self.step_idx[slot] = 0
        self.seen[slot] = False
        self.text_len[slot] = 0
        self.text_ids[slot] = self.tts_pad_id
        self.do_sample[slot] = bool(sampling["do_sample"])
        self.temperature[slot] = float(sampling["temperature"])
        self.top_k[slot] = int(sampling["top_k"])
        self.top_p[slot] = float(sampling["top_p"])
        self.repetition_penalty[slot] = float(sampling["repetition_penalty"])
        self.sub_do_sample[slot] = bool(sampling["subtalker_do_sample"])
        self.sub_temperature[slot] = float(sampling["subtalker_temperature"])
        self.sub_top_k[slot] = int(sampling["subtalker_top_k"])
        self.sub_top_p[slot] = float(sampling["subtalker_top_p"])
        self.seed[slot] = int(sampling["seed"])
        self.forbid_eos[slot] = bool(sampling["ignore_eos"])

    def append_text(self, slot: int, start: int, ids: list[int]) -> None:
        """Make more text-track tokens available to a slot (ids may end with tts_eos)."""
        end = start + len(ids)
        if end > self.max_text_tokens:
            raise ValueError(f"text track longer than {self.max_text_tokens} tokens")
        self.text_ids[slot, start:end] = torch.tensor(ids, device=self.device, dtype=torch.int64)
        self.text_len[slot] = end

    # ----------------------------------------------------------------- the model maths
    def text_track_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.text_embedding(ids))

    def _talker_forward(
        self, x: torch.Tensor, write_rows: torch.Tensor, write_pos: torch.Tensor, read_rows: slice, read_len: int, mask: torch.Tensor
    ) -> torch.Tensor:
        cos, sin = _rope_tables(self.inv_freq, write_pos, self.dtype)
        for layer, ck, cv in zip(self.layers, self.k_cache, self.v_cache):
            x = _decoder_layer(
                layer, x, cos=cos, sin=sin, cache_k=ck, cache_v=cv, write_rows=write_rows,
                write_pos=write_pos, read_rows=read_rows, read_len=read_len, mask=mask,
            )
        return self.norm(x)

    def _predictor_forward(self, x: torch.Tensor, b: int, start: int) -> torch.Tensor:
        t = x.shape[1]
        x = self.p_in_proj(x)
        cos = self.p_cos[start : start + t].expand(b, t, -1)
        sin = self.p_sin[start : start + t].expand(b, t, -1)
        rows = self._arange_slots[:b].unsqueeze(1)
        pos = torch.arange(start, start + t, device=self.device).expand(b, t)
        for layer, ck, cv in zip(self.p_layers, self.pk_cache, self.pv_cache):
            x = _decoder_layer(
                layer, x, cos=cos, sin=sin, cache_k=ck, cache_v=cv, write_rows=rows,
                write_pos=pos, read_rows=slice(0, b), read_len=start + t, mask=None,
            )
        return self.p_norm(x[:, -1])

    def _sample_code0(self, logits: torch.Tensor, rows: torch.Tensor, any_sampling: bool = True) -> torch.Tensor:
        """Talker sampling for the given slots: the official processors, then warp and draw."""
        scores = apply_repetition_penalty(logits.float(), self.seen[rows], self.repetition_penalty[rows])
        eos_blocked = (self.n_sampled[rows] < 2) | self.forbid_eos[rows]
        scores = scores.masked_fill(self.suppress, float("-inf"))
        scores[:, self.eos_id] = torch.where(eos_blocked, float("-inf"), scores[:, self.eos_id])
        params = SamplerRows(
            do_sample=self.do_sample[rows], temperature=self.temperature[rows], top_k=self.top_k[rows],
            top_p=self.top_p[rows], seed=self.seed[rows], counter=self.n_sampled[rows] * self.num_groups,
        )
        return warp_and_sample(scores, params, any_sampling)

    def _after_code0(self, rows: torch.Tensor, code0: torch.Tensor, hidden: torch.Tensor, act: torch.Tensor) -> None:
        """Record a sampled codebook-0 token for `rows` where `act` is set."""
        self.code0[rows] = torch.where(act, code0, self.code0[rows])
        self.past_hidden[rows] = torch.where(act.unsqueeze(1), hidden, self.past_hidden[rows])
        seen_rows = self.seen[rows]
        seen_rows.scatter_(1, code0.unsqueeze(1), seen_rows.gather(1, code0.unsqueeze(1)) | act.unsqueeze(1))
        self.seen[rows] = seen_rows
        self.n_sampled[rows] += act.long()

    @torch.inference_mode()
    def prefill(self, slot: int, embeds: torch.Tensor, *, sample: bool) -> None:
        """Run prompt embeddings [t, hidden] into a slot's cache at its current position.

        A prompt may arrive in pieces (its head before the text is known); the piece that ends it has
        `sample=True`, which samples the first codebook-0 token from its last position.
        """
        t = embeds.shape[0]
        start = int(self.pos[slot])
        if start + t > self.max_seq_len:
            raise ValueError(f"prompt of {start + t} positions exceeds max_seq_len={self.max_seq_len}")
        write_pos = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        keys = torch.arange(start + t, device=self.device)
        mask = (keys.unsqueeze(0) <= write_pos.squeeze(0).unsqueeze(1)).view(1, 1, t, start + t)
        rows = torch.tensor([[slot]], device=self.device)
        hidden = self._talker_forward(
            embeds.to(self.dtype).unsqueeze(0), rows, write_pos, slice(slot, slot + 1), start + t, mask
        )
        self.pos[slot] = start + t
        if sample:
            last = hidden[:, -1]
            row = rows.view(1)
            code0 = self._sample_code0(self.codec_head(last), row)
            self._after_code0(row, code0, last, torch.ones(1, device=self.device, dtype=torch.bool))

    @torch.inference_mode()
    def frame_step(self, b: int, kv_len: int, talker_sampling: bool = True, predictor_sampling: bool = True) -> None:
        """One frame for slots [0, b): predictor codes for the pending codebook-0 token, then the next one.

        Reads `active`; writes `frame_codes` (the 16 codes of this frame) and `finished` (EOS was sampled).
        `kv_len` must exceed every active slot's position. The sampling flags may be False only when no row
        in [0, b) samples (a host-side shortcut for greedy decoding on the CPU).
        """
        act = self.active[:b]
        rows = self._arange_slots[:b]
        code0 = self.code0[:b]
        sub = SamplerRows(
            do_sample=self.sub_do_sample[:b], temperature=self.sub_temperature[:b], top_k=self.sub_top_k[:b],
            top_p=self.sub_top_p[:b], seed=self.seed[:b], counter=torch.zeros_like(code0),
        )
        counter_base = (self.n_sampled[:b] - 1) * self.num_groups

        embeds = [self.codec_embedding(code0)]
        codes = [code0]
        x = torch.stack([self.past_hidden[:b], embeds[0]], dim=1)
        for j in range(self.num_groups - 1):
            hidden = self._predictor_forward(x, b, start=0 if j == 0 else j + 1)
            sub.counter = counter_base + j + 1
            code = warp_and_sample(self.p_heads[j](hidden), sub, predictor_sampling)
            codes.append(code)
            embeds.append(self.p_embeddings[j](code))
            x = embeds[-1].unsqueeze(1)
        self.frame_codes[:b] = torch.stack(codes, dim=1)

        step = self.step_idx[:b]
        text_id = self.text_ids[rows, step.clamp(max=self.max_text_tokens - 1)]
        text_id = torch.where(step < self.text_len[:b], text_id, torch.full_like(text_id, self.tts_pad_id))
        x = torch.stack(embeds, dim=1).sum(1) + self.text_track_embeddings(text_id)

        write_pos = torch.where(act, self.pos[:b], torch.full_like(code0, self.max_seq_len)).unsqueeze(1)
        mask = (torch.arange(kv_len, device=self.device).unsqueeze(0) <= write_pos).view(b, 1, 1, kv_len)
        hidden = self._talker_forward(x.unsqueeze(1), rows.unsqueeze(1), write_pos, slice(0, b), kv_len, mask)[:, 0]
        new_code0 = self._sample_code0(self.codec_head(hidden), rows, talker_sampling)
        self._after_code0(rows, new_code0, hidden, act)
        self.pos[:b] += act.long()
        self.step_idx[:b] += act.long()
        self.finished[:b] = act & (new_code0 == self.eos_id)
