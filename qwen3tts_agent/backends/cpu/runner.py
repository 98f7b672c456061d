"""`CpuRunner`: the engine's `ModelRunner`, with the talker and the code predictor run as ONNX Runtime graphs.

Everything the engine sees stays as it is: the slot tables, the text track and the frame outputs are
`ModelRunner`'s own, and the draws between the graph calls give `engine.runner.sampling.sample`'s tokens bit for bit,
in fewer PyTorch ops (`draws`: right after a graph call every op is slow). What changes is where the bytes are read:
a talker step is one call of the talker graph over rows 0..b-1, a predictor step one call of the predictor
graph, and in the int8 and int4 formats each predictor head is one 8- or 4-bit GEMV. At batch 1 a frame reads
every weight of the talker once and the predictor's fifteen times, so its cost is set by memory bandwidth;
8-bit weights read a quarter of fp32's bytes, 4-bit ones an eighth.

The KV caches are `ModelRunner`'s tensors, handed to the graphs by pointer. Rows that are not active in a
step still run (fixed batch), writing their key at their own next position, which the row's next real token
overwrites before anything reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.runner import DEFAULT_TOP_K_CAP, ModelRunner, PrefillRow, SamplerRows, apply_repetition_penalty
from ...models.compat import OfficialModule
from .draws import Sampler
from .session import BoundSession, SpareCores

# Prompt tokens per talker-graph call: a longer prompt goes in pieces (each continuing the slot's cache), which
# bounds GroupQueryAttention's score buffer (heads x tokens x keys floats) at no measurable cost.
PREFILL_CHUNK = 256


class CpuRunner(ModelRunner):
    """A `ModelRunner` whose transformer stacks run from converted graphs in `folder` (see `store.prepare`)."""

    def __init__(
        self,
        model: OfficialModule,
        folder: Path,
        weight_format: str,
        *,
        max_slots: int,
        max_seq_len: int,
        max_text_tokens: int,
        top_k_cap: int = DEFAULT_TOP_K_CAP,
        threads: int | None = None,
        spare_threads: int = 0,
        spin: bool | None = None,
        shared_pool: bool | None = None,
    ) -> None:
        """`threads`: ONNX Runtime's intra-op threads (default: PyTorch's thread count). `spin`: let them
        busy-wait between ops (default: the QWEN3TTS_CPU_SPIN environment variable, else off). `shared_pool`:
        every graph on the process's one shared pool (`session.shared_pool`), whose threads spin between ops,
        instead of a pool per graph (default: QWEN3TTS_CPU_POOL=shared, which the engine-core process sets;
        once that pool exists, ONNX Runtime refuses any session with a pool of its own in the process, such
        as Pipecat's Silero VAD, so an in-process engine keeps a pool per graph). `spare_threads`: the codec's
        cores, which the graphs also run on while the codec is idle (`lend_codec_cores`), on a second copy of each
        graph; 0, a shared pool or QWEN3TTS_CPU_LEND=0 (no second copy in memory): never."""
        super().__init__(
            model, max_slots=max_slots, max_seq_len=max_seq_len, max_text_tokens=max_text_tokens,
            top_k_cap=top_k_cap, fused_kernels=False,
        )
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(f"the CPU backend runs float32 models on the CPU, not {self.dtype} on {self.device}")
        self.weight_format = weight_format
        threads = threads or torch.get_num_threads()
        if spin is None:
            spin = os.environ.get("QWEN3TTS_CPU_SPIN", "0") == "1"
        if shared_pool is None:
            shared_pool = os.environ.get("QWEN3TTS_CPU_POOL", "session") == "shared"
        if os.environ.get("QWEN3TTS_CPU_LEND", "1") == "0":
            spare_threads = 0
        self.threads, self.spin, self.shared_pool = threads, spin, shared_pool
        # what the engine's stats report per stack (`EngineStats.kernel_paths`)
        graphs = f"onnxruntime ({weight_format}{', shared pool' if shared_pool else ''})"
        self.kernel_paths = {"talker": graphs, "predictor": graphs, "codec": self.kernel_paths["codec"]}

        self.spare_cores = SpareCores()

        def session(path: Path) -> BoundSession:
            return BoundSession(
                path, threads, spin, shared=shared_pool, wide_threads=threads + spare_threads, spare=self.spare_cores
            )

        self._talker = session(folder / "talker.onnx")
        self._predictor = session(folder / "predictor.onnx")
        heads = sorted(folder.glob("head_*.onnx"), key=lambda p: int(p.stem.split("_")[1]))
        self._heads = {id(head): session(path) for head, path in zip(self.p_heads, heads, strict=False)}
        # GroupQueryAttention's rotary tables: cos and sin of each position's angles [positions, head_dim / 2]
        half = self.cos.shape[-1] // 2
        self._t_rope = (self.cos[:, :half].contiguous(), self.sin[:, half:].contiguous())
        self._p_rope = (self.p_cos[:, :half].contiguous(), self.p_sin[:, half:].contiguous())
        int32 = torch.int32
        self._t_seqlens = torch.zeros(max_slots, dtype=int32)
        self._t_total = torch.full((1,), max_seq_len + 1, dtype=int32)  # > 1: every one-token call is a decode step
        # predictor step `code` (1..15) attends positions 0..code: its lengths are constants, one row per step,
        # bound once (no fill between the graph calls)
        codes = torch.arange(1, self.num_groups, dtype=int32)
        self._p_seqlens = codes.view(-1, 1).repeat(1, max_slots)
        self._p_total = (codes + 1).view(-1, 1)
        self._t_out = torch.zeros(max_slots, 1, self.hidden_size)
        p_hidden = self.p_layers[0].w_o.shape[0]
        self._p_out = {t: torch.zeros(max_slots, t, p_hidden) for t in (1, 2)}
        self._talker_bindings: dict[int, object] = {}
        self._predictor_bindings: dict[tuple[int, int], object] = {}
        # the draws between the graph calls (`draws`), and the draw counters of a frame's codes 1..15
        self._code0_sampler = Sampler(self.vocab_size, top_k_cap, max_slots)
        self._code_sampler = Sampler(self.p_heads[0].out_features, top_k_cap, max_slots)
        self._codes = torch.arange(1, self.num_groups)
        self._code0_drawn = torch.zeros(max_slots, dtype=torch.int64)
        # the embeddings of a frame's codes 1..15, each the input of the next predictor step, summed after the
        # last (the ops between graph calls are the slow ones: the sum waits until the graphs are done)
        self._code_embeds = torch.zeros(self.num_groups - 1, max_slots, self.hidden_size)
        # the predictor heads' input (the normed hidden state) and logits: one pair for all fifteen, which run
        # one after the other and whose logits are sampled before the next head runs
        self._head_in = torch.zeros(max_slots, p_hidden)
        self._head_out = torch.zeros(max_slots, self.p_heads[0].out_features)
        self._head_bindings: dict[tuple[int, int], object] = {}

    def lend_codec_cores(self, codec_idle: Callable[[], bool]) -> None:
        """Run each graph call on the codec's cores too (`spare_threads`) when `codec_idle()` says so."""
        self.spare_cores.watch(codec_idle)

    # ----------------------------------------------------------------- bindings (made once per batch size)
    def _stack_inputs(self, caches: tuple[list[torch.Tensor], list[torch.Tensor]], rows: slice) -> dict[str, torch.Tensor]:
        bound = {}
        for i, (k, v) in enumerate(zip(*caches, strict=True)):
            bound[f"past_key_{i}"], bound[f"past_value_{i}"] = k[rows], v[rows]
        return bound

    @staticmethod
    def _presents(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The present caches: the same memory as the past ones (GroupQueryAttention's shared buffer)."""
        return {name.replace("past_", "present_"): t for name, t in inputs.items() if name.startswith("past_")}

    def _talker_binding(self, b: int) -> object:
        binding = self._talker_bindings.get(b)
        if binding is None:
            caches = self._stack_inputs((self.k_cache, self.v_cache), slice(0, b))
            inputs = {
                "x": self.talker_input[:b].view(b, 1, -1), "seqlens_k": self._t_seqlens[:b], "total_len": self._t_total,
                "cos": self._t_rope[0], "sin": self._t_rope[1], **caches,
            }
            binding = self._talker.bind(inputs, {"y": self._t_out[:b], **self._presents(caches)})
            self._talker_bindings[b] = binding
        return binding

    def _predictor_binding(self, b: int, code: int) -> object:
        """Step `code`: the first on 2 positions (the talker's state and codebook 0), then one each."""
        binding = self._predictor_bindings.get((b, code))
        if binding is None:
            t = 2 if code == 1 else 1
            x = self.p_input[:b] if t == 2 else self._code_embeds[code - 2, :b].view(b, 1, -1)
            caches = self._stack_inputs((self.pk_cache, self.pv_cache), slice(0, b))
            inputs = {
                "x": x, "seqlens_k": self._p_seqlens[code - 1, :b], "total_len": self._p_total[code - 1],
                "cos": self._p_rope[0], "sin": self._p_rope[1], **caches,
            }
            binding = self._predictor.bind(inputs, {"y": self._p_out[t][:b], **self._presents(caches)})
            self._predictor_bindings[(b, code)] = binding
        return binding

    # ----------------------------------------------------------------- the frame
    @contextlib.contextmanager
    def _torch_single_threaded(self) -> Iterator[None]:
        """PyTorch's ops between graph calls are tiny (sampling over a few thousand logits); with its own
        OpenMP team beside ONNX Runtime's pool, the two sets of threads fight for the cores."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def frame_step(self, b: int, kv_len: int, talker_sampling: bool = True, predictor_sampling: bool = True) -> None:
        with self._torch_single_threaded():
            super().frame_step(b, kv_len, talker_sampling, predictor_sampling)

    def predict_codes(self, b: int, sampling: bool = True) -> None:
        """The 15 predictor steps: one graph call each (the first on 2 positions), then one head and a draw.

        `ModelRunner._record_code`'s state, in fewer ops between the graph calls: the draws are
        `draws.FrameDraws` (the frame's noise computed at once), each code is drawn straight into
        `frame_codes` and its embedding gathered straight into the next step's bound input; the embeddings
        are summed, in the same order, after the last step."""
        rows = slice(0, b)
        # draw counters: codebook 0's (n_sampled - 1) * num_groups (drawn by the talker), then one more for each
        # of the frame's codes 1..15, as `ModelRunner._record_code` counts them
        counter = ((self.n_sampled[rows] - 1) * self.num_groups).unsqueeze(1) + self._codes
        draws = self._code_sampler.frame(
            SamplerRows(do_sample=self.sub_do_sample[rows], temperature=self.sub_temperature[rows],
                        top_k=self.sub_top_k[rows], top_p=self.sub_top_p[rows]),
            self.seed[rows], counter, sampling,
        )
        codes, embeds = self.frame_codes[rows], self._code_embeds[:, rows]
        codes[:, 0] = self.code0[rows]
        for code in range(1, self.num_groups):
            self._predictor.run(self._predictor_binding(b, code))
            hidden = self._p_out[2 if code == 1 else 1][rows, -1]
            logits = self._logits(hidden, self.p_norm, self.p_heads[code - 1], False)
            token = draws.draw(logits, code - 1, out=codes[:, code])
            torch.index_select(self.p_embeddings[code - 1].weight, 0, token, out=embeds[code - 1])
        self.p_step_input[rows] = embeds[-1]
        # the sum of the codes' embeddings, codebook 0's first; the last code's goes straight to the talker's
        # input, to which the text track's embedding is added
        total = self.embed_sum[rows]
        torch.add(self.p_input[rows, 1], embeds[0], out=total if self.num_groups > 2 else self.talker_input[rows])
        for code in range(2, self.num_groups):
            torch.add(total, embeds[code - 1], out=total if code < self.num_groups - 1 else self.talker_input[rows])
        step = self.step_idx[rows]
        text = self.text_embeds[self._arange_slots[rows], step.clamp(max=self.max_text_tokens - 1)]
        self.talker_input[rows] += torch.where((step < self.text_len[rows]).unsqueeze(1), text, self.pad_embed)
        self.write_pos[rows] = torch.where(self.active[rows], self.pos[rows], self.max_seq_len)

    def talker_step(self, b: int, kv_len: int, sampling: bool = True) -> None:
        """The talker graph on this frame's input rows; every row writes at its own position. Then
        `ModelRunner._record_code0`'s frame update in fewer ops: the norm once (for the head and the next
        predictor input), the slots as slices rather than index lists, the draw a `draws.FrameDraws`."""
        del kv_len  # each row attends over its own positions (seqlens_k), not a shared length
        rows = slice(0, b)
        self._t_seqlens[rows].copy_(self.pos[rows])
        self._talker.run(self._talker_binding(b))
        hidden = self.norm(self._t_out[rows, 0])
        code0 = self._draw_code0(self.codec_head(hidden), b, sampling)
        act = self.active[rows]
        self.code0[rows] = torch.where(act, code0, self.code0[rows])
        first = torch.stack([hidden, self.codec_embedding(code0)], dim=1)
        self.p_input[rows] = torch.where(act.view(-1, 1, 1), first, self.p_input[rows])
        slots = self._arange_slots[rows]
        self.seen[slots, code0] = self.seen[slots, code0] | act
        sampled = act.long()
        for counter in (self.pos, self.n_sampled, self.step_idx):
            counter[rows] += sampled
        self.finished[rows] = (act & (code0 == self.eos_id)).long()

    def _draw_code0(self, logits: torch.Tensor, b: int, sampling: bool) -> torch.Tensor:
        """`ModelRunner._sample_code0` for slots [0, b): the official processors, then the draw, whose counter
        is n_sampled * num_groups."""
        rows = slice(0, b)
        scores = apply_repetition_penalty(logits, self.seen[rows], self.repetition_penalty[rows])
        scores.masked_fill_(self.suppress, float("-inf"))
        scores[:, self.eos_id].masked_fill_((self.n_sampled[rows] < 2) | self.forbid_eos[rows], float("-inf"))
        draws = self._code0_sampler.frame(
            SamplerRows(do_sample=self.do_sample[rows], temperature=self.temperature[rows], top_k=self.top_k[rows],
                        top_p=self.top_p[rows]),
            self.seed[rows], (self.n_sampled[rows] * self.num_groups).unsqueeze(1), sampling,
        )
        return draws.draw(scores, 0, out=self._code0_drawn[rows])

    def _logits(self, x: torch.Tensor, norm: OfficialModule, head: nn.Linear, fused: bool = False) -> torch.Tensor:
        """head(norm(x)); a predictor head is a GEMV of its 8- or 4-bit graph in the int8 and int4 formats
        (`fused`: unused, no Triton here), whose logits are valid until the next head runs.

        There the norm is one `F.rms_norm` into the head's bound input (the official module's six ops cost
        more than the head itself at batch 1); the fp32 format keeps the official norm, for exact parity."""
        session = self._heads.get(id(head))
        if session is None:
            return head(norm(x))
        b = x.shape[0]
        self._head_in[:b] = F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        binding = self._head_bindings.get((id(head), b))
        if binding is None:
            binding = session.bind({"x": self._head_in[:b]}, {"y": self._head_out[:b]})
            self._head_bindings[(id(head), b)] = binding
        session.run(binding)
        return self._head_out[:b]

    # ----------------------------------------------------------------- prompts
    @torch.inference_mode()
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        """Each prompt piece is one talker-graph call on its slot's cache (pieces differ in length and start)."""
        with self._torch_single_threaded():
            self._prefill(rows)

    def _prefill(self, rows: Sequence[PrefillRow]) -> None:
        last_hidden = []
        for row in rows:
            if row.start + row.embeds.shape[0] > self.max_seq_len:
                raise ValueError(f"prompt of {row.start + row.embeds.shape[0]} positions exceeds max_seq_len={self.max_seq_len}")
            embeds = row.embeds.to(self.dtype)
            for offset in range(0, embeds.shape[0], PREFILL_CHUNK):
                out = self._prompt_piece(row.slot, row.start + offset, embeds[offset : offset + PREFILL_CHUNK])
            last_hidden.append(out[0, -1])
        self.finish_prefill(rows, self.norm(torch.stack(last_hidden)))

    def _prompt_piece(self, slot: int, start: int, embeds: torch.Tensor) -> torch.Tensor:
        """Talker graph on one slot's prompt tokens [t, hidden] at cache positions start..start+t-1."""
        t = embeds.shape[0]
        end = start + t
        caches = self._stack_inputs((self.k_cache, self.v_cache), slice(slot, slot + 1))
        out = torch.empty(1, t, self.hidden_size)
        inputs = {
            "x": embeds.reshape(1, t, -1).contiguous(),
            "seqlens_k": torch.tensor([end - 1], dtype=torch.int32),
            # a piece that starts the cache is a first prompt (total == t); a later one continues it
            "total_len": torch.tensor([end], dtype=torch.int32),
            "cos": self._t_rope[0], "sin": self._t_rope[1], **caches,
        }
        self._talker.run(self._talker.bind(inputs, {"y": out, **self._presents(caches)}))
        return out

