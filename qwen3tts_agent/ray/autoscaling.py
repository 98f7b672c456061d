"""Autoscaling on the engines' own load (`serve-ray --autoscale-on engine-load`), through Serve's custom
autoscaling metrics and policy.

Why not Serve's default signal: Serve counts a WebSocket session as one ongoing request while it is open, and a
session is open while its audio is generated, a fraction of its playing time while the replica keeps up. Ongoing
requests therefore stay far below any sensible target until the replica has already fallen behind; in a measured
5 -> 40 req/s ramp Serve upscaled only once every stream was underrunning
(benchmarks/results/2026-12-05-h100-ray-1gpu-b, "Autoscaling").

The pieces:

- `engine_load`: one replica's load at one moment, as a utilization of its capacity (`EngineReplica` samples it
  whenever Serve polls its routing stats, every `routing_stats_period_s`).
- `LoadMeter`: the time-weighted mean of those samples between two reads, which `EngineReplica.
  record_autoscaling_stats` hands to Serve as the custom metric `ENGINE_LOAD_METRIC`. Serve asks for it every
  `look_back_period_s` / 5 (or every `metrics_interval_s`, 10 s, if shorter), pushes it to its controller every
  `metrics_interval_s`, and averages it per replica over `look_back_period_s` (`AutoscalingContext.
  aggregated_metrics`).
- `engine_load_policy`: the replica count that brings the mean load to the target, a pure function of the
  context; `EngineLoadPolicy` is its callable form that Serve instantiates with the target (`POLICY`).

Delays: Serve wraps every deployment's policy, custom ones included, in `ray.serve.autoscaling_policy.
_apply_autoscaling_config`, which applies `upscaling_factor`/`downscaling_factor`, `upscale_delay_s`,
`downscale_delay_s` (and `downscale_to_zero_delay_s`) to the count the policy returns, exactly as for its
default policy; the controller then clips it to min/max. So the policy here returns the count it wants now and
applies no delay of its own: a delay here as well would wait out each delay twice (Serve's timer starts only
once this policy's wish has changed).

This module imports nothing heavy: Serve pickles it by value and the controller unpickles it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

ENGINE_LOAD_METRIC = "engine_load"
DEFAULT_TARGET_ENGINE_LOAD = 0.6
POLICY = "qwen3tts_agent.ray.autoscaling:EngineLoadPolicy"


def engine_load(
    *, busy: int, capacity: int, sessions: int, max_sessions: int, overloaded: bool, available: bool = True
) -> float:
    """One replica's load now: the larger of the shares of its two limits in use, 1.0 or more when it refuses.

    - `busy / capacity`: utterances synthesizing or waiting for a slot (engine streams generating, streams
      queued in the engine, utterances queued at the server's admission) over its synthesis slots
      (`--max-active-streams`, else the engine's `max_streams`). This is what the device works on: it rises as
      soon as arrivals outpace the replica, seconds before streams underrun, unlike ongoing requests. Above 1
      when utterances wait for a slot.
    - `sessions / max_sessions`: WebSocket sessions open over `--max-sessions`. A session holds no slot while
      it is silent, but the replica refuses the next session at its limit just as it refuses an utterance
      without a slot, so a replica near its session limit needs help as much as one near its slots.
    - An engine refusing new streams because it runs behind real time (`overloaded`) is at least full (1.0)
      whatever its counts say: its slots are not what limits it then, its device is.
    - A replica not ready or whose engine is down offers no capacity: 1.0, as full as a full one, so it does not
      dilute its peers' load while they carry its share (Serve replaces it after three failed health checks).
    """
    if not available:
        return 1.0
    load = busy / capacity if capacity > 0 else 0.0
    if max_sessions > 0:
        load = max(load, sessions / max_sessions)
    if overloaded:
        load = max(load, 1.0)
    return load


class LoadMeter:
    """Time-weighted mean of a replica's load samples between two reads (`take`).

    Serve records the custom metric every few seconds (`look_back_period_s` / 5); one sample at that moment
    would catch the engine's load, which moves with every utterance that starts or ends, at a random point.
    The replica samples it more often (with each routing-stats poll) and reports the mean since the last read.
    Each sample holds until the next one. Times are `time.monotonic()` seconds. Thread-safe: Serve runs a
    replica's sync methods (both callers) on a thread pool.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # start of the current window
        self._last: tuple[float, float] | None = None  # (load, time) of the latest sample
        self._area = 0.0  # load x seconds since `_since`, up to the latest sample

    def observe(self, load: float, now: float) -> None:
        with self._lock:
            self._observe(load, now)

    def _observe(self, load: float, now: float) -> None:
        if self._last is None:
            self._since = now
        else:
            value, at = self._last
            self._area += value * max(0.0, now - at)
        self._last = (load, now)

    def take(self, load: float, now: float) -> float:
        """The mean load since the last `take` (or the first sample), this sample included; starts a new window."""
        with self._lock:
            self._observe(load, now)
            assert self._since is not None
            span = now - self._since
            mean = self._area / span if span > 0 else load
            self._since, self._area = now, 0.0
            return mean


def desired_replicas(
    loads: Iterable[float], target_engine_load: float, *, min_replicas: int, max_replicas: int
) -> int:
    """Replicas to run so that the replicas' mean load is at most the target: the load summed over the replicas
    (in replicas' worth of capacity), divided by the target, rounded up, within min..max."""
    total = sum(loads)
    wanted = math.ceil(round(total / target_engine_load, 6))  # round: 1.2 / 0.6 is 2.0000000000000004
    return max(min_replicas, min(max_replicas, wanted))


def engine_load_policy(
    ctx: AutoscalingContext, target_engine_load: float = DEFAULT_TARGET_ENGINE_LOAD
) -> tuple[int, dict[str, Any]]:
    """The replica count for the replicas' reported engine load (a pure function of the context).

    Reads `ctx.aggregated_metrics[ENGINE_LOAD_METRIC]` (each running replica's load averaged over
    `look_back_period_s`), `ctx.running_replicas`, `ctx.target_num_replicas` and
    `ctx.capacity_adjusted_min_replicas`/`max_replicas`. Returns (count, {}): the count that brings the mean
    load to `target_engine_load` or below (`desired_replicas`). A running replica that has not reported yet
    has just started and carries no streams: it adds nothing to the sum. With no report at all (a deployment
    just started, or scaled to zero) it holds the current target; Serve's wrapper scales a deployment at zero
    replicas up on requests waiting at its proxies. Serve's wrapper applies the delays (module docstring).
    """
    metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    reported = metrics.get(ENGINE_LOAD_METRIC) or {}
    loads = [reported[replica] for replica in ctx.running_replicas if replica in reported]
    if not loads:
        return ctx.target_num_replicas, {}
    return desired_replicas(
        loads, target_engine_load,
        min_replicas=ctx.capacity_adjusted_min_replicas, max_replicas=ctx.capacity_adjusted_max_replicas,
    ), {}


def check_target(target_engine_load: float) -> None:
    if not 0.0 < target_engine_load <= 1.0:
        raise ValueError(f"target_engine_load must be above 0 and at most 1, got {target_engine_load}")


class EngineLoadPolicy:
    """`engine_load_policy` with its target, as Serve's `AutoscalingPolicy(policy_function=POLICY,
    policy_kwargs={"target_engine_load": ...})`: Serve passes `policy_kwargs` only to a policy that is a class
    (it instantiates it once and calls the instance on every autoscaling tick), not to a plain function."""

    def __init__(self, target_engine_load: float = DEFAULT_TARGET_ENGINE_LOAD) -> None:
        check_target(target_engine_load)
        self.target_engine_load = target_engine_load

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        return engine_load_policy(ctx, self.target_engine_load)
