"""A `serve-ray` deployment under open-loop load while replicas fail, and while it scales out.

Two experiments against a running deployment (`--url`), with WebSocket clients in processes of their own as
in `benchmarks/serving/load.py` (open-loop Poisson arrivals, first audio timed at the client, a player that starts on
the first chunk):

- `faults`: arrivals at `--rate` for `--duration` s. At `--kill-core-at` s one replica's engine-core process is
  SIGKILLed; at `--kill-replica-at` s one replica's actor process (the Serve replica: its app, its sessions and
  its engine-core child). Each kill takes the oldest replica process. Reported per kill: the
  requests in flight then and how each ended (served, an error by its code, or hung: neither `done`, an error
  nor a close within `--hang-s`), the seconds until as many replicas as before report a healthy engine again
  (the capacity back), and the utterances each replica finished in between.
- `autoscale`: arrivals ramping linearly from `--rate` to `--ramp-to` over `--duration` s, against a deployment
  started with `--min-replicas 1 --max-replicas 2`. Reported: when the second replica first reports, when it
  finishes its first utterance, and first audio p50 / p95 and underruns per `--bin` seconds of arrivals.

The replicas' state comes from `/metrics/replicas` (each replica's `qwen3tts_engine_healthy`, sessions and
utterance counters, by replica id), polled every 0.5 s; the processes from `ps` (Serve names a replica's
process `ray::ServeReplica:APP:EngineReplica`; its engine core is its `spawn_main` child).

    python -m benchmarks.serving.ray_faults faults --url ws://127.0.0.1:8000 --rate 20 --duration 60 \\
        --kill-core-at 15 --kill-replica-at 35 --out faults.json
    python -m benchmarks.serving.ray_faults autoscale --url ws://127.0.0.1:8000 --rate 5 --ramp-to 40 --duration 120 \\
        --out autoscale.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.serving.load import UNDERRUN_S, ClientPlan, Record, client_process, error_key, pct

POLL_S = 0.5
REPLICA_PROCESS = re.compile(r"^ray::ServeReplica:[^ ]*EngineReplica")
_SAMPLE = re.compile(r'^(qwen3tts_[a-z_]+)\{(.*)\} (\S+)$')


@dataclass
class ReplicaView:
    """One poll of `/metrics/replicas`: per replica id, the figures the report needs."""

    at: float  # time.monotonic()
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)

    def healthy(self) -> set[str]:
        return {r for r, v in self.replicas.items() if v.get("qwen3tts_engine_healthy", 0.0) >= 1.0}


def poll_replicas(url: str) -> ReplicaView:
    view = ReplicaView(at=time.monotonic())
    base = url.replace("ws://", "http://").replace("wss://", "https://")
    with urllib.request.urlopen(base + "/metrics/replicas", timeout=5) as response:
        for line in response.read().decode().splitlines():
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            replica = re.search(r'replica="([^"]+)"', labels)
            if replica is None or name not in (
                "qwen3tts_engine_healthy", "qwen3tts_active_sessions", "qwen3tts_utterances_total"
            ):
                continue
            figures = view.replicas.setdefault(replica.group(1), {})
            figures[name] = figures.get(name, 0.0) + float(value)
    return view


class Poller:
    """`/metrics/replicas` every `POLL_S` on a thread, until stopped; a failed poll is skipped (and counted)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.views: list[ReplicaView] = []
        self.failed_polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def latest(self) -> ReplicaView | None:
        return self.views[-1] if self.views else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.views.append(poll_replicas(self.url))
            except OSError:
                self.failed_polls += 1
            self._stop.wait(POLL_S)


def replica_processes() -> dict[int, list[int]]:
    """Each Serve engine replica's process id -> its engine-core child processes (empty with a core thread)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    parsed = []
    for line in rows.splitlines():
        pid, ppid, args = line.strip().split(None, 2) if len(line.split()) >= 3 else (*line.split(), "")
        parsed.append((int(pid), int(ppid), args))
    replicas = {pid: [] for pid, _, args in parsed if REPLICA_PROCESS.match(args)}
    for pid, ppid, args in parsed:
        if ppid in replicas and "spawn_main" in args:
            replicas[ppid].append(pid)
    return replicas


def replica_to_kill() -> int:
    """A replica process to kill: the oldest (lowest pid). Serve's metrics name replicas by id, not process,
    so the most loaded one cannot be picked; under even routing any one carries about half the sessions."""
    replicas = replica_processes()
    if not replicas:
        raise RuntimeError("no Serve engine replica process found (ps shows no ray::ServeReplica:...EngineReplica)")
    return min(replicas)


def run_clients(args: argparse.Namespace, start_at: float, ramp_to: float | None) -> list[Record]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    clients = [
        context.Process(target=client_process, args=(ClientPlan(
            args.url, "ws", args.rate / args.clients, args.duration, seed=7919 * (i + 1), voice=args.voice,
            language=args.language, frames=args.frames, api_key=args.api_key, start_at=start_at, hang_s=args.hang_s,
            ramp_to=None if ramp_to is None else ramp_to / args.clients,
        ), results))
        for i in range(args.clients)
    ]
    for c in clients:
        c.start()
    records: list[Record] = []
    for _ in clients:
        records += [Record(**r) for r in results.get(timeout=args.duration + args.hang_s + 60)]
    for c in clients:
        c.join()
    return records


def ended_at(record: Record) -> float | None:
    """When the server was done with a request (its error, or its last audio received), or None if never."""
    if record.failed_at is not None:
        return record.failed_at
    if record.done_s is not None:
        return record.started + record.done_s
    return None


def outcome(record: Record) -> str:
    if record.error is None:
        return "served"
    key = error_key(record.error)
    return "hung" if key == "Hung" else key


def first_audio_figures(records: list[Record]) -> dict[str, object]:
    served = [r for r in records if r.error is None and r.first_audio_s is not None]
    first = [1000 * r.first_audio_s for r in served]  # type: ignore[operator]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[outcome(r)] = errors.get(outcome(r), 0) + 1
    return {
        "requests": len(records),
        "served": len(served),
        "first_audio_ms": {"p50": pct(first, 50), "p95": pct(first, 95), "p99": pct(first, 99)},
        "underrun_streams": sum(r.stall_s > UNDERRUN_S for r in served),
        "errors": errors,
    }


def capacity_back(views: list[ReplicaView], after: float, healthy_before: set[str]) -> tuple[float | None, set[str]]:
    """When as many replicas report a healthy engine as before, once the loss has shown: the first poll after
    `after` with fewer healthy replicas or another set of them (a dead replica's last report stays in the hub for
    a few seconds, `ray/metrics.py`), then the first with as many again. Its time and set; None if never."""
    lost = False
    for view in views:
        if view.at <= after:
            continue
        healthy = view.healthy()
        if not lost:
            lost = len(healthy) < len(healthy_before) or healthy != healthy_before
        if lost and len(healthy) >= len(healthy_before):
            return view.at, healthy
    return None, set()


def finished_between(views: list[ReplicaView], start: float, end: float) -> dict[str, float]:
    """Utterances each replica finished between two times (counter deltas between the nearest polls)."""
    before = next((v for v in reversed(views) if v.at <= start), None)
    after = next((v for v in reversed(views) if v.at <= end), None)
    if before is None or after is None:
        return {}
    return {
        replica: figures.get("qwen3tts_utterances_total", 0.0)
        - before.replicas.get(replica, {}).get("qwen3tts_utterances_total", 0.0)
        for replica, figures in after.replicas.items()
    }


def kill_report(kind: str, at: float, pid: int, records: list[Record], poller: Poller) -> dict[str, object]:
    views = poller.views
    before = next((v for v in reversed(views) if v.at <= at), None)
    healthy_before = before.healthy() if before else set()
    back_at, healthy_after = capacity_back(views, at, healthy_before)
    in_flight = [r for r in records if r.started <= at and ((end := ended_at(r)) is None or end > at)]
    outcomes: dict[str, int] = {}
    for r in in_flight:
        outcomes[outcome(r)] = outcomes.get(outcome(r), 0) + 1
    window_end = back_at if back_at is not None else at + 60.0
    return {
        "kind": kind,
        "pid": pid,
        "at_s": at - poller.views[0].at if views else None,
        "healthy_replicas_before": sorted(healthy_before),
        "in_flight": len(in_flight),
        "in_flight_outcomes": outcomes,
        "capacity_back_s": None if back_at is None else back_at - at,
        "healthy_replicas_after": sorted(healthy_after),
        "utterances_finished_until_back": finished_between(views, at, window_end),
        "arrivals_until_back": first_audio_figures([r for r in records if at <= r.started < window_end]),
    }


def run_faults(args: argparse.Namespace) -> dict[str, object]:
    poller = Poller(args.url).start()
    start_at = time.monotonic() + 3.0
    kills: list[tuple[str, float, int]] = []

    def kill(kind: str, delay: float) -> None:
        time.sleep(max(0.0, start_at + delay - time.monotonic()))
        replica = replica_to_kill()
        cores = replica_processes().get(replica, [])
        pid = cores[0] if kind == "engine-core" and cores else replica
        if kind == "engine-core" and not cores:
            raise RuntimeError("the replica has no engine-core process (--engine-core process is needed)")
        os.kill(pid, signal.SIGKILL)
        kills.append((kind, time.monotonic(), pid))
        print(f"[{time.strftime('%H:%M:%S')}] SIGKILL {kind} {pid}", flush=True)

    killers = [threading.Thread(target=kill, args=(kind, delay), daemon=True) for kind, delay in
               (("engine-core", args.kill_core_at), ("replica", args.kill_replica_at)) if delay is not None]
    for k in killers:
        k.start()
    records = run_clients(args, start_at, None)
    for k in killers:
        k.join()
    time.sleep(args.settle)  # the last kill's capacity may come back after the load ended
    poller.stop()
    report: dict[str, object] = {
        "rate_per_s": args.rate, "duration_s": args.duration, "hang_s": args.hang_s,
        "all": first_audio_figures(records),
        "before_first_kill": first_audio_figures([r for r in records if not kills or r.started < kills[0][1]]),
        "kills": [kill_report(kind, at, pid, records, poller) for kind, at, pid in kills],
        "hung": sum(outcome(r) == "hung" for r in records),
        "failed_polls": poller.failed_polls,
    }
    return report


def run_autoscale(args: argparse.Namespace) -> dict[str, object]:
    poller = Poller(args.url).start()
    start_at = time.monotonic() + 3.0
    records = run_clients(args, start_at, args.ramp_to)
    time.sleep(args.settle)
    poller.stop()
    views = poller.views
    first = views[0].replicas.keys() if views else set()
    appeared = next(((v.at, r) for v in views for r in v.replicas if r not in first), None)
    took_traffic = None
    if appeared is not None:
        took_traffic = next((v.at for v in views if v.replicas.get(appeared[1], {}).get("qwen3tts_utterances_total", 0) > 0), None)
    bins = []
    t = start_at
    while t < start_at + args.duration:
        in_bin = [r for r in records if t <= r.started < t + args.bin]
        rate = args.rate + (args.ramp_to - args.rate) * (t + args.bin / 2 - start_at) / args.duration
        bins.append({"from_s": t - start_at, "rate_per_s": rate, **first_audio_figures(in_bin)})
        t += args.bin
    return {
        "rate_from_per_s": args.rate, "rate_to_per_s": args.ramp_to, "duration_s": args.duration,
        "replicas_at_start": sorted(first),
        "second_replica_reported_s": None if appeared is None else appeared[0] - start_at,
        "second_replica_first_utterance_s": None if took_traffic is None else took_traffic - start_at,
        "all": first_audio_figures(records),
        "bins": bins,
        "hung": sum(outcome(r) == "hung" for r in records),
        "failed_polls": poller.failed_polls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=("faults", "autoscale"))
    parser.add_argument("--url", required=True, help="the Serve endpoint, ws://host:port")
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals a second (autoscale: at the start)")
    parser.add_argument("--ramp-to", type=float, default=40.0, help="autoscale: arrivals a second at the end")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--kill-core-at", type=float, default=15.0, help="faults: seconds in (none: --kill-core-at -1)")
    parser.add_argument("--kill-replica-at", type=float, default=35.0, help="faults: seconds in (none: -1)")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a request not ended this long is hung")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds of polls after the last arrival")
    parser.add_argument("--bin", type=float, default=5.0, help="autoscale: seconds of arrivals per reported bin")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--voice")
    parser.add_argument("--language", default="english")
    parser.add_argument("--api-key")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name in ("kill_core_at", "kill_replica_at"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            setattr(args, name, None)
    report = run_faults(args) if args.experiment == "faults" else run_autoscale(args)
    report["experiment"] = args.experiment
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
