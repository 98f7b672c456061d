"""The engine core: one thread owns the model and steps every live request together, frame by frame.

Requests reach it only as typed messages (`engine/messages.py`) that it applies between frames, and it
answers only through an `OutputSink` (audio chunks, endings), so a cancel takes effect at the next frame
boundary, a new request joins the running batch at the next step, and nothing here knows of streams,
event loops or sockets. The same core runs on a thread of the caller's process (`Engine`) or in a
process of its own (`engine/process/supervisor.py`).

Each turn of the loop: apply messages; admit waiting requests and prefill their prompts on a lane of their
own (so a new stream's prompt runs beside the step in flight, not behind it; `engine/core/prompt_lane.py`); feed
newly final text; queue
the frame steps now due and read the ones that completed, starting the decodes of the chunks that are due
(`engine/core/launcher.py`); hand decoded audio out. The loop never blocks on the device while work is
queued: it polls, waiting on its message queue in between, so a request that arrives is seen at once.

Faults stay as small as they can: a bad message or a prompt that cannot be built fails its request only;
a failed prefill fails its batch; a failed step fails the requests in flight. If steps keep failing, or
the device reports a fault that poisons its context, the loop stops, ends every request with
`EngineDeadError`, and whoever owns the core decides whether to restart it.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...backends import create_codec, create_runner
from ...errors import (
    EngineClosedError,
    EngineDeadError,
    Qwen3TTSAgentError,
)
from ...kernels import common as kernel_common
from ...models.compat import OfficialModule
from ..audio import AudioPipeline, cpu_thread_split
from ..messages import (
    AbortRequest,
    AddRequest,
    AppendText,
    ChunkOutput,
    CloseInput,
    CoreRequest,
    ErrorInfo,
    FinishOutput,
    OutputSink,
    PromptSpec,
)
from ..runner import (
    MAX_PREFILL_ROWS,
    FrameSteps,
    GraphedFrameStep,
    LanePriorities,
    Prefills,
    PromptBuilder,
    capture_beside,
    frame_batch_buckets,
    power_of_two_buckets,
    prefix_store_options,
)
from ..scheduler import ChunkPlan, PromptShape, RequestState, Scheduler, StepPacer
from ..types import ChunkTimings, FinishReason, SamplingParams
from .config import CoreConfig, CoreStats
from .late_trace import LateChunkTrace
from .launcher import StepLauncher
from .prompt_lane import PromptLane

logger = logging.getLogger(__name__)

# Consecutive failed steps after which the loop gives up (the device is not coming back by itself).
MAX_CONSECUTIVE_FAILURES = 3


class EngineCore:
    """The step loop over a `Scheduler`, a `ModelRunner` and an `AudioPipeline`."""

    def __init__(self, model: OfficialModule, role_ids: list[int], config: CoreConfig, sink: OutputSink) -> None:
        self.config = config
        self._sink = sink
        self.device = next(model.talker.parameters()).device
        self.prompts = PromptBuilder(model, role_ids)
        # on a CPU the codec has a thread and cores of its own beside the frame steps (engine/audio/pipeline.py); not
        # under Triton's interpreter (tests), which patches `triton.language` while it runs a kernel, so two
        # threads cannot interpret kernels at once
        self._step_threads, codec_threads = torch.get_num_threads(), 0
        if self.device.type == "cpu" and config.overlap_codec and not kernel_common.interpreting():
            self._step_threads, codec_threads = cpu_thread_split(self._step_threads)
        # one text-track token per frame at most, so a track never outgrows the cache
        self.runner = create_runner(
            model, config.backend, threads=self._step_threads, spare_threads=codec_threads, max_slots=config.max_streams,
            max_seq_len=config.max_seq_len, max_text_tokens=config.max_seq_len, top_k_cap=config.top_k_cap,
            fused_kernels=config.fused_kernels,
            **prefix_store_options(
                prefix_cache=config.prefix_cache, backend=config.backend, staged_prefill=config.staged_prefill
            ),
        )
        self.pacer = StepPacer(step_period_s=config.step_period_s)
        cuda = self.device.type == "cuda"
        graphed = cuda and config.use_cuda_graphs
        self.stats = CoreStats()
        lanes = LanePriorities.of_device() if cuda else None
        self.audio = AudioPipeline(
            model.speech_tokenizer.model.decoder, device=self.device, max_streams=config.max_streams,
            chunk_schedule=config.chunk_schedule, graphed=graphed, overlap=config.overlap_codec,
            make_codec=functools.partial(create_codec, backend=config.backend),
            hold_s=config.codec_hold_s, priorities=lanes, on_decode=self._count_decode, codec_threads=codec_threads,
        )
        self.runner.lend_codec_cores(self.audio.codec_thread_idle)
        self.scheduler = Scheduler(
            max_slots=config.max_streams, max_seq_len=config.max_seq_len, max_text_tokens=config.max_seq_len,
            max_prefill_rows=MAX_PREFILL_ROWS, eos_token_id=self.prompts.tts_eos_id, keep_codes=config.keep_codes,
            adapt_chunks=config.adapt_chunks, speculate=config.speculative_first_frame,
            decode_sizes=self.audio.decode_sizes, first_frame_slots=config.first_frame_slots,
            first_frame_load=config.first_frame_load, pace_load=config.pace_load if config.step_period_s else 0,
            clock_first_frame_load=config.clock_first_frame_load, shed_lateness_s=config.shed_lateness_s,
        )
        # Prompts run above the steps and the steps above the codec lane (engine/runner/lanes.py), so codec work only
        # fills the steps' gaps; the prompt lane is separate from the steps' stream, so a new prompt runs
        # beside the step in flight.
        self._step_stream: torch.cuda.Stream | None = None
        self._prefill_stream: torch.cuda.Stream | None = None
        if lanes is not None:
            self._step_stream = torch.cuda.Stream(self.device, priority=lanes.steps)
            self._prefill_stream = torch.cuda.Stream(self.device, priority=lanes.urgent)
            logger.info("lane priorities: prompts and early chunks %d, steps %d, later chunks %d",
                        self._prefill_stream.priority, self._step_stream.priority, lanes.background)
        self._specs: dict[str, PromptSpec] = {}
        self._sampling: dict[str, SamplingParams] = {}
        # decoded audio of a first frame run on a tentative token, until the token turns out final
        self._held: dict[str, list[tuple[ChunkPlan, np.ndarray]]] = {}
        kv_buckets = power_of_two_buckets(config.max_seq_len, start=min(128, config.max_seq_len))
        frame_graphs = (
            GraphedFrameStep(self.runner, frame_batch_buckets(config.max_streams), kv_buckets) if graphed else None
        )
        self.steps = FrameSteps(self.runner, frame_graphs, self.device, config.max_streams)
        self.prefills = Prefills(
            self.runner, self.prompts, graphed=graphed, max_streams=config.max_streams, kv_buckets=kv_buckets
        )
        self.prompt_lane = PromptLane(
            self.scheduler, self.runner, self.prefills, self.audio, self.pacer, self.stats, self._specs,
            self._sampling, stream=self._prefill_stream, guarded=self._guarded, end=self._end,
        )
        self._messages: queue.SimpleQueue[CoreRequest | _Control] = queue.SimpleQueue()
        self.loop_seconds: dict[str, float] = dict.fromkeys(("prompts", "launch", "collect", "deliver", "wait"), 0.0)
        self._late_trace = LateChunkTrace()  # each late chunk's story in the log (engine/core/late_trace.py)
        self.launcher = StepLauncher(
            self.scheduler, self.runner, self.steps, self.pacer, self.audio, self.stats, self._sampling,
            self._late_trace, first_audio_alone=config.first_audio_alone,
        )
        self._failures = 0
        self._stopping = False

    # ----------------------------------------------------------------- the caller's side (any thread)
    def submit(self, message: CoreRequest) -> None:
        self._messages.put(message)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the core's thread between steps (graph capture must not race device work)."""
        future: Future[Any] = Future()
        self._messages.put(_Control(fn, future))
        return future

    def stop(self) -> None:
        self._messages.put(_Control(None, None))

    def _count_decode(self, chunks: int, early: bool) -> None:
        self.stats.codec_decodes += 1
        self.stats.codec_chunks += chunks
        self.stats.early_codec_decodes += early

    def capture_graphs(self, progress: bool) -> None:
        """Capture every CUDA graph: frame, prefill and staged prefill on the core's thread, both codec lanes'
        beside them on a helper thread (`capture_beside`; their progress goes to the log only)."""

        def steps_and_prompts() -> None:
            if self.steps.graphs is not None:
                self.steps.graphs.capture(progress=progress)
            self.prefills.capture(progress)

        capture_beside(self.device, steps_and_prompts, lambda: self.audio.capture(progress=False))

    @property
    def graphs_captured(self) -> bool:
        return self.steps.graphs is None or self.steps.graphs.captured

    def open_requests(self) -> int:
        return len(self.scheduler.requests)

    # ----------------------------------------------------------------- the loop (the core's thread)
    def run(self) -> None:
        """Serve until `stop()`; ends every live request before returning, also when the loop dies."""
        torch.set_grad_enabled(False)
        if self.device.type == "cpu":
            # this thread's own count (the codec thread sets its own); PyTorch also makes it the count of
            # threads that start their first PyTorch work later
            torch.set_num_threads(self._step_threads)
        if self._step_stream is not None:
            torch.cuda.synchronize(self.device)  # state tensors were made on the loading thread's stream
            torch.cuda.set_stream(self._step_stream)
        failure: BaseException | None = None
        try:
            while not self._stopping:
                self._turn()
        except BaseException as exc:
            failure = exc
            logger.exception("engine core stopped")
            raise
        finally:
            error: Qwen3TTSAgentError = (
                EngineClosedError("engine is closed") if failure is None
                else EngineDeadError(f"the engine core stopped: {type(failure).__name__}: {failure}")
            )
            for request in self.scheduler.live():
                self._end(request, FinishReason.ERROR, error)
            self._drain_after_stop(error)
            self.audio.close()

    def _turn(self) -> None:
        started = time.perf_counter()
        self._apply_messages(block=False)
        if self._stopping:  # taken here, the stop must end the loop now: this turn's wait would outlast it
            return
        progressed = self.prompt_lane.run()
        started = self._timed("prompts", started)
        try:
            progressed |= self.launcher.launch()
            started = self._timed("launch", started)
            if self.launcher.collect():
                progressed = True
                self._failures = 0  # a step came through: the device works
            started = self._timed("collect", started)
            progressed |= self._deliver()
            started = self._timed("deliver", started)
        except Exception as exc:  # noqa: BLE001 - the core must outlive any one bad step
            self._step_failed(exc)
            return
        if not progressed:
            self._wait()
            self._timed("wait", started)

    def _wait(self) -> None:
        """Nothing moved this turn: wait for a message, briefly while the device works, else until one comes."""
        busy = bool(self.steps) or self.audio.busy or self.scheduler.has_runnable()
        self._apply_messages(block=True, timeout=self.config.poll_interval_s if busy else None)

    def _apply_messages(self, *, block: bool, timeout: float | None = None) -> None:
        try:
            message = self._messages.get(block=block, timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._apply(message)
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return

    def _apply(self, message: CoreRequest | _Control) -> None:
        if isinstance(message, _Control):
            if message.fn is None:
                self._stopping = True
                return
            assert message.future is not None
            try:
                message.future.set_result(message.fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                message.future.set_exception(exc)
            return
        request = self.scheduler.get(message.request_id) if not isinstance(message, AddRequest) else None
        try:
            if isinstance(message, AddRequest):
                self._add(message)
            elif request is None:
                return  # ended meanwhile (finished, failed, aborted): late text or a second cancel
            elif isinstance(message, AppendText):
                self.scheduler.append_text(request, message.token_ids, message.tentative)
                self._note_text(request)
                self._settle(request)
            elif isinstance(message, CloseInput):
                self.scheduler.close_input(request, message.token_ids)
                self._note_text(request)
                self._settle(request)
            elif isinstance(message, AbortRequest):
                self.stats.cancels += 1
                self._end(request, FinishReason.CANCELLED)
        except Exception as exc:  # noqa: BLE001 - one bad message fails its request only
            failed = request or self.scheduler.get(message.request_id)
            if failed is not None:
                self._end(failed, FinishReason.ERROR, exc)
            else:
                self._sink_finish(FinishOutput(message.request_id, FinishReason.ERROR, ErrorInfo.of(exc), exception=exc))

    def _add(self, message: AddRequest) -> None:
        spec = message.spec
        icl = spec.clone.ref_codes if spec.icl and spec.clone is not None else None
        shape = PromptShape(
            layout=spec.layout,
            icl_codec_len=None if icl is None else 1 + int(icl.shape[0]),
            ref_text_len=len(spec.ref_text_ids),
            icl_early_start=spec.icl_early_start,
        )
        request = RequestState(
            message.request_id, shape, message.chunk_schedule, message.submitted,
            max_frames=message.sampling.max_frames, runaway_guard=not message.sampling.ignore_eos,
            arrived=time.perf_counter(),
        )
        self.scheduler.add(request)
        self._specs[request.request_id] = spec
        self._sampling[request.request_id] = message.sampling
        self.stats.streams_started += 1

    def _note_text(self, request: RequestState) -> None:
        """Stamp when the text the first frame needs has arrived (for `StreamResult.text_wait`)."""
        if not request.text_ready and request.shape.first_frame_ready(len(request.text_ids), request.closed):
            request.text_ready = time.perf_counter()

    def _settle(self, request: RequestState) -> None:
        """New text may decide a speculated first frame: release its held audio, or start the request over."""
        right = self.scheduler.settle_speculation(request)
        if right is None:
            return
        held = self._held.pop(request.request_id, [])
        if right:
            for plan, pcm in held:
                self._deliver_chunk(plan, pcm)
            return
        self.stats.speculation_misses += 1
        self.audio.drop(request.request_id)  # its codec slot holds the wrong first frame's state
        self.prompt_lane.forget(request.request_id)
        self.scheduler.restart(request)

    # ----------------------------------------------------------------- audio
    def _deliver(self) -> bool:
        """Hand decoded chunks to their requests; end requests whose last chunk this was; launch the codec-lane
        decodes now due (a held chunk falls due by the clock alone)."""
        progressed = False
        for plan, pcm in self.audio.finished():
            progressed = True
            request = plan.request
            if not self.scheduler.is_live(request):
                continue  # cancelled, failed or restarted meanwhile: nothing more for it
            if request.speculated is not None:  # its first frame's text token may still change
                # the view keeps its decode's host buffer (one per decode, never reused) alive until delivery
                self._held.setdefault(request.request_id, []).append((plan, pcm))
                continue
            self._deliver_chunk(plan, pcm)
        return self.audio.pump(time.perf_counter(), self.scheduler.audio_streams()) or progressed

    def _deliver_chunk(self, plan: ChunkPlan, pcm: np.ndarray) -> None:
        request = plan.request
        now = time.perf_counter()
        late = self.scheduler.on_delivered(plan, now)
        if late is not None:
            self._late_trace.on_late(late)
        self.launcher.replan()
        timings = ChunkTimings(
            request.submitted, request.prefill_done, request.first_frame, now, request.admitted_at, request.arrived
        )
        output = ChunkOutput(
            request.request_id, pcm.copy(), plan.frame_start, plan.frame_start + plan.n_frames, plan.is_last, timings
        )
        try:
            self._sink.chunk(output)
        except Exception:  # noqa: BLE001 - a consumer's failure must not reach other streams
            logger.exception("output sink failed for request %s", request.request_id)
        if plan.is_last:
            self._end(request, request.finish_reason or FinishReason.EOS)

    def _step_failed(self, exc: Exception) -> None:
        """A step, a collect or a decode raised: fail what was in flight, and stop if the device is gone."""
        logger.exception("engine step failed; failing the requests in it")
        self.launcher.clear()
        self.audio.clear()
        self.scheduler.on_steps_abandoned()
        for request in self.scheduler.live():
            if request.slot is not None or request in self.scheduler.finishing:
                self._end(request, FinishReason.ERROR, exc)
        self._failures += 1
        if _poisons_device(exc) or self._failures >= MAX_CONSECUTIVE_FAILURES:
            raise EngineDeadError(f"giving up after {self._failures} failed steps: {type(exc).__name__}: {exc}") from exc

    # ----------------------------------------------------------------- endings
    def _end(self, request: RequestState, reason: FinishReason, error: BaseException | None = None) -> None:
        """End a request now and send its `FinishOutput` (exactly once)."""
        if not self.scheduler.is_live(request):
            return
        self.scheduler.finish(request, reason)
        rid = request.request_id
        self.audio.drop(rid)
        self._specs.pop(rid, None)
        self._sampling.pop(rid, None)
        self.prompt_lane.forget(rid)
        self._held.pop(rid, None)
        if error is not None:
            self.stats.errors += 1
            if not isinstance(error, Qwen3TTSAgentError):
                logger.error("request %s failed: %r", rid, error)
        self._sink_finish(FinishOutput(
            rid, reason, None if error is None else ErrorInfo.of(error), frames=request.frames,
            queue_wait=max(0.0, request.admitted_at - request.submitted) if request.admitted_at else 0.0,
            text_wait=request.text_wait(time.perf_counter()), codes=request.codes, exception=error,
        ))

    def _sink_finish(self, output: FinishOutput) -> None:
        try:
            self._sink.finish(output)
        except Exception:  # noqa: BLE001
            logger.exception("output sink failed to end request %s", output.request_id)

    def _drain_after_stop(self, error: Qwen3TTSAgentError) -> None:
        """Answer what is still queued after the loop stopped: requests end, calls fail."""
        while True:
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                self._sink_finish(FinishOutput(message.request_id, FinishReason.ERROR, ErrorInfo.of(error), exception=error))
            elif isinstance(message, _Control) and message.future is not None:
                message.future.set_exception(error)

    def _guarded(self, request: RequestState, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one request's piece of work; its failure fails that request only."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            self._end(request, FinishReason.ERROR, exc)
            return None

    def _timed(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.loop_seconds[phase] += now - since
        return now


@dataclass(frozen=True)
class _Control:
    """A call to run on the core's thread (`fn`), or the stop signal (`fn` None)."""

    fn: Callable[[], Any] | None
    future: Future[Any] | None


def _poisons_device(exc: BaseException) -> bool:
    """Whether an error leaves the CUDA context unusable (an illegal access, a launch failure: not an OOM)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))
