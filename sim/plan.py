"""`splitserve plan`: which fleet serves a trace best under its SLOs, searched with the simulator.

    trace (Mooncake JSONL, or bench's workload flags), model, GPU kind and count, TTFT / ITL SLOs
      --(candidates: colocated workers at each TP degree; disaggregated pools at each P:D split
         in the range the trace's prefill and decode work set, each role's TP degree; step
         token budgets; KV-tier sizes)-->
      --(each run on the virtual clock with the real router, scheduler and block pool,
         sim/fleet.py, on every core)-->
      the Pareto front of (goodput per GPU, SLO attainment), the best candidate, the best
      colocated one and the ratio of their goodputs --> a table, a plot, a plan file

Two measures per candidate, as DistServe measures fleets:
- goodput per GPU: the highest arrival rate (the trace's, its times scaled) at which at least
  `TARGET_ATTAINMENT` of the requests meet both SLOs, over the candidate's GPUs: how much of
  this traffic a GPU of this fleet carries;
- SLO attainment at the trace's own rate: how well it serves the traffic as it comes.
The best is the candidate of the highest goodput per GPU among those whose attainment is
within `ATTAINMENT_SLACK` of the best attainment any candidate reached.

Pruning, so that an hour of trace on 8 GPUs is planned in minutes on two cores:
- the split: the prefill share of the work (the GPU time the cost model prices the trace's
  prompts at, against its outputs' at a decode batch of 32) names the split that balances
  the pools; the search tries the splits whose prefill share of the GPUs is within a factor
  `SPLIT_SPREAD` of it (at least the three nearest), not all of them;
- the degrees: by default the two smallest TP degrees the model fits at (`auto_tps`);
- two stages (`staged`): every candidate's goodput is found on the trace's first
  `SCREEN_REQUESTS` requests (a bisection: about six runs), and the `KEEP` of the most (and
  the colocated one of the most) serve the whole trace once, at its rate, for attainment.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.config import SchedulerConfig
from loadgen import report
from loadgen.workload import WorkloadRequest
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from sim.cost_model import GPUS, MODELS, ModelShape, Roofline
from sim.fleet_types import FleetConfig

DECODE_BATCH = 32
"""The decode batch a split's work share assumes (a decode token's GPU time is its step over this)."""
SPLIT_SPREAD = 2.0
ATTAINMENT_SLACK = 0.01
SCREEN_REQUESTS = 600
KEEP = 6
TARGET_ATTAINMENT = 0.9
"""The share of requests within both SLOs a fleet must hold for a rate to count as served (DistServe's 90 %)."""
BISECT_STEPS = 4
MIN_SPAN_S = 60.0
"""A rate is tried over at least this long (the requests repeated to fill it)."""
MAX_EXTEND = 4
"""...with at most this many times the screen's requests: a higher rate is not tried, and a
goodput that reaches it is marked `capacity_capped` (a lower bound)."""
MIN_MULTIPLE, MAX_MULTIPLE = 1 / 64, 64.0
TPS = (1, 2, 4, 8)
PLAN_VERSION = 1


@dataclass(frozen=True, order=True)
class Candidate:
    """One fleet to try: its pools, their TP degrees, its step budget and KV tier."""

    mode: Literal["colocated", "disaggregated"]
    prefill: int
    """Prefill workers (0 colocated)."""
    decode: int
    """Decode workers (colocated: the workers, each prefilling its own requests)."""
    prefill_tp: int
    decode_tp: int
    max_num_batched_tokens: int
    kv_store_gib: float = 0.0

    @property
    def num_gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        tier = f", tier {self.kv_store_gib:g} GiB" if self.kv_store_gib else ""
        if self.mode == "colocated":
            return f"colocated {self.decode}x TP{self.decode_tp}, budget {self.max_num_batched_tokens}{tier}"
        return (f"disaggregated {self.prefill}P(TP{self.prefill_tp}):{self.decode}D(TP{self.decode_tp}), "
                f"budget {self.max_num_batched_tokens}{tier}")


@dataclass(frozen=True)
class Space:
    """What the search may vary."""

    num_gpus: int
    tps: tuple[int, ...] = (1, 2, 4, 8)
    budgets: tuple[int, ...] = (2048, 8192)
    kv_store_gibs: tuple[float, ...] = (0.0,)
    modes: tuple[str, ...] = ("colocated", "disaggregated")


def fits(model: ModelShape, gpu: str, tp: int, max_model_len: int) -> bool:
    """A worker of `tp` GPUs holds the weights and one request of the longest context."""
    try:
        return Roofline(model, GPUS[gpu], tp).kv_capacity_tokens() >= max_model_len
    except ValueError:
        return False


def auto_tps(model: ModelShape, gpu: str, max_model_len: int, num_gpus: int) -> tuple[int, ...]:
    """The two smallest degrees of TPS the model fits at within `num_gpus` (a wider one only
    spends GPUs on collectives a model this size does not need)."""
    return tuple(t for t in TPS if t <= num_gpus and fits(model, gpu, t, max_model_len))[:2]


def prefill_share(model: ModelShape, gpu: str, items: Sequence[WorkloadRequest], chunk: int) -> float:
    """The prefill share of the trace's GPU time on one GPU: its prompts in chunks of `chunk`
    against its outputs at a decode batch of DECODE_BATCH (the first 500 requests)."""
    hw = Roofline(model, GPUS[gpu], 1)
    head = list(items[:500])
    prefill_s = sum(hw.step_s([(min(chunk, len(i.prompt) - s), s)]) for i in head
                    for s in range(0, len(i.prompt), chunk))
    mean_ctx = sum(len(i.prompt) + i.max_tokens / 2 for i in head) / max(len(head), 1)
    decode_s = sum(i.max_tokens for i in head) * hw.step_s([(1, int(mean_ctx))] * DECODE_BATCH) / DECODE_BATCH
    return prefill_s / max(prefill_s + decode_s, 1e-12)


def candidates(space: Space, model: ModelShape, gpu: str, max_model_len: int, share: float,
               spread: float | None = SPLIT_SPREAD) -> list[Candidate]:
    """The pruned grid (module docstring): every TP that fits and divides the GPUs; for
    disaggregation, the splits near `share` at each pair of degrees, using all the GPUs a
    pair can (`spread` None: every split, the exhaustive grid)."""
    tps = [t for t in space.tps if t <= space.num_gpus and fits(model, gpu, t, max_model_len)]
    out: list[Candidate] = []
    for budget in space.budgets:
        for gib in space.kv_store_gibs:
            if "colocated" in space.modes:
                out += [Candidate("colocated", 0, space.num_gpus // t, t, t, budget, gib)
                        for t in tps if space.num_gpus % t == 0]
            if "disaggregated" not in space.modes:
                continue
            for p_tp in tps:
                for d_tp in tps:
                    splits = [(p, (space.num_gpus - p * p_tp) // d_tp) for p in range(1, space.num_gpus // p_tp + 1)]
                    splits = [(p, d) for p, d in splits if d >= 1]
                    if not splits:
                        continue
                    def distance(pd: tuple[int, int]) -> float:
                        return abs(math.log(max(pd[0] * p_tp, 1e-9) / max(share * space.num_gpus, 1e-9)))
                    near = sorted(splits, key=distance)
                    keep = set(near) if spread is None else \
                        {pd for pd in near if distance(pd) <= math.log(spread)} | set(near[:3])
                    out += [Candidate("disaggregated", p, d, p_tp, d_tp, budget, gib) for p, d in sorted(keep)]
    return sorted(set(out))


def fleet_config(c: Candidate, model: ModelShape, gpu: str, max_model_len: int, seed: int) -> FleetConfig:
    d_hw, p_hw = Roofline(model, GPUS[gpu], c.decode_tp), Roofline(model, GPUS[gpu], c.prefill_tp)
    block_tokens = FleetConfig.block_size * model.kv_bytes_per_token
    return FleetConfig(
        num_prefill=c.prefill, num_decode=c.decode, num_blocks=d_hw.kv_capacity_tokens() // FleetConfig.block_size,
        max_model_len=max_model_len, gpus_per_worker=c.decode_tp,
        prefill_gpus_per_worker=c.prefill_tp if c.mode == "disaggregated" and c.prefill_tp != c.decode_tp else None,
        prefill_num_blocks=p_hw.kv_capacity_tokens() // FleetConfig.block_size
        if c.mode == "disaggregated" and c.prefill_tp != c.decode_tp else None,
        routing=RoutingConfig(mode=c.mode), admission=AdmissionConfig(), seed=seed,
        scheduler=SchedulerConfig(max_num_batched_tokens=c.max_num_batched_tokens),
        kv_store_blocks=int(c.kv_store_gib * 2**30 // block_tokens))


@dataclass(frozen=True)
class Job:
    """One candidate's run, as a worker process takes it: `capacity` finds the highest rate it
    holds the SLOs at (bisection on the arrival rate), `attainment` serves the trace as it is."""

    candidate: Candidate
    model: str
    quantization: tuple[bool, bool]
    gpu: str
    max_model_len: int
    ttft_slo_s: float
    itl_slo_s: float
    seed: int
    kind: Literal["capacity", "attainment"] = "attainment"
    target: float = TARGET_ATTAINMENT
    min_span_s: float = MIN_SPAN_S
    """A rate is tried over at least this long (a test's short trace may lower it)."""


_ITEMS: list[WorkloadRequest] = []
"""The requests, set once per worker process (`_init`), not sent with every job."""


def _init(items: list[WorkloadRequest]) -> None:
    global _ITEMS
    _ITEMS = items


def at_rate(items: Sequence[WorkloadRequest], multiple: float) -> list[WorkloadRequest]:
    """The requests arriving `multiple` times as fast (the same requests, the same order)."""
    return [dataclasses.replace(i, at_s=(i.at_s or 0.0) / multiple) for i in items]


def repeated(items: Sequence[WorkloadRequest], n: int) -> list[WorkloadRequest]:
    """The first `n` of the requests played end to end again and again, each pass one mean gap
    after the last ended (as `sim.arrivals.trace_items` repeats a trace file)."""
    out, first, last = list(items[:n]), items[0].at_s or 0.0, items[-1].at_s or 0.0
    step = (last - first) * len(items) / max(len(items) - 1, 1)
    k = 1
    while len(out) < n:
        out += [dataclasses.replace(i, at_s=(i.at_s or 0.0) + k * step) for i in items[:n - len(out)]]
        k += 1
    return out


def trace_rate(items: Sequence[WorkloadRequest]) -> float:
    span = (items[-1].at_s or 0.0) - (items[0].at_s or 0.0)
    return (len(items) - 1) / span if span > 0 else float(len(items))


def evaluate(job: Job, items: list[WorkloadRequest] | None = None) -> dict[str, Any]:
    """One candidate simulated (module docstring): its capacity per GPU, or its attainment and
    latencies at the trace's own rate."""
    from sim.fleet import Fleet  # the fleet pulls the router's and engine's modules: in the worker

    items = items if items is not None else _ITEMS
    model = MODELS[job.model].in_fp8(*job.quantization)
    c = job.candidate
    cfg = fleet_config(c, model, job.gpu, job.max_model_len, job.seed)
    d_hw = Roofline(model, GPUS[job.gpu], c.decode_tp)
    p_hw = Roofline(model, GPUS[job.gpu], c.prefill_tp) if cfg.prefill_gpus_per_worker else None

    def served(requests: list[WorkloadRequest], multiple: float) -> dict[str, Any]:
        run = Fleet(cfg, d_hw, at_rate(requests, multiple), p_hw).run().run
        return report.summarize(run, job.ttft_slo_s, job.itl_slo_s)

    out: dict[str, Any] = {"candidate": dataclasses.asdict(c), "label": c.label, "num_gpus": c.num_gpus}
    if job.kind == "capacity":
        span, capped = (items[-1].at_s or 0.0) - (items[0].at_s or 0.0), []
        highest = MAX_EXTEND * span / job.min_span_s  # the highest multiple the screen can try

        def holds(m: float) -> bool:
            """Served at `m` times the rate, over at least `min_span_s` (the requests repeated to
            fill it: a burst shorter than its requests' own service says nothing of a steady
            rate); a rate that would take more than MAX_EXTEND times the requests is not tried."""
            need = math.ceil(len(items) * job.min_span_s * m / span) if span > 0 else len(items)
            if need > MAX_EXTEND * len(items):
                capped.append(m)
                return False
            return served(repeated(items, max(need, len(items))), m)["slo_attainment"] >= job.target

        multiple = capacity(holds)
        rps = multiple * trace_rate(items)
        return {**out, "capacity_multiple": round(multiple, 3), "capacity_rps": round(rps, 3),
                "goodput_per_gpu": round(rps / c.num_gpus, 4),
                "capacity_capped": bool(capped) and multiple * 2 ** (2 / 2 ** BISECT_STEPS) >= highest}
    s = served(items, 1.0)
    return {**out, "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
            "ttft_p50_ms": s["ttft_ms"].get("p50"), "ttft_p99_ms": s["ttft_ms"].get("p99"),
            "itl_p50_ms": s["itl_ms"].get("p50"), "itl_p99_ms": s["itl_ms"].get("p99"),
            "num_failed": s["num_failed"]}


def capacity(holds: Callable[[float], bool], steps: int = BISECT_STEPS) -> float:
    """The largest rate multiple at which `holds` (found within a factor 2**(1 / 2**steps)):
    doubling or halving from 1 to a bracket, then bisection of its logarithm; 0 where it
    does not hold at MIN_MULTIPLE."""
    if holds(1.0):
        lo, hi = 1.0, 2.0
        while holds(hi):
            if hi >= MAX_MULTIPLE:
                return hi
            lo, hi = hi, hi * 2
    else:
        lo, hi = 0.5, 1.0
        while not holds(lo):
            if lo <= MIN_MULTIPLE:
                return 0.0
            lo, hi = lo / 2, lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def search(jobs: Sequence[Job], items: list[WorkloadRequest], workers: int | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every job's result, in the jobs' order, on `workers` processes (default: every core)."""
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        out = []
        for j in jobs:
            out.append(evaluate(j, items))
            if progress:
                progress(out[-1])
        return out
    with ProcessPoolExecutor(max_workers=workers, initializer=_init, initargs=(items,)) as pool:
        results = []
        for f in [pool.submit(evaluate, j) for j in jobs]:
            results.append(f.result())
            if progress:
                progress(results[-1])
        return results


def ranked(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results in `best`'s order: within ATTAINMENT_SLACK of the top attainment at the
    trace's rate first, by goodput per GPU; then the rest by attainment."""
    top = max(r["slo_attainment"] for r in results)

    def key(r: dict[str, Any]) -> tuple[bool, float, float]:
        near = r["slo_attainment"] >= top - ATTAINMENT_SLACK
        return near, r["goodput_per_gpu"] if near else r["slo_attainment"], r["slo_attainment"]

    return sorted(results, key=key, reverse=True)


def staged(jobs: Sequence[Job], items: list[WorkloadRequest], screen: int = SCREEN_REQUESTS, keep: int = KEEP,
           workers: int | None = None, progress: Callable[[str, dict[str, Any]], None] | None = None,
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the finalists' results, every candidate's capacity): each candidate's capacity on the
    trace's first `screen` requests; the `keep` of the most (and the colocated one of the
    most) then serve the whole trace at its own rate; a finalist's result has both."""
    def stage(name: str) -> Callable[[dict[str, Any]], None] | None:
        return (lambda r: progress(name, r)) if progress else None

    capacities = search([dataclasses.replace(j, kind="capacity") for j in jobs], items[:screen], workers,
                        stage("capacity"))
    order = sorted(capacities, key=lambda r: -r["goodput_per_gpu"])
    colocated = [r for r in order if r["candidate"]["mode"] == "colocated"]
    chosen = {r["label"] for r in order[:keep]} | ({colocated[0]["label"]} if colocated else set())
    finals = [dataclasses.replace(j, kind="attainment") for j in jobs if j.candidate.label in chosen]
    by_label = {r["label"]: r for r in capacities}
    results = [{**by_label[r["label"]], **r} for r in search(finals, items, workers, stage("attainment"))]
    return results, capacities


def pareto(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results no other beats on both goodput per GPU and attainment, by goodput."""
    rs = list(results)
    front = [r for r in rs if not any(
        o["goodput_per_gpu"] >= r["goodput_per_gpu"] and o["slo_attainment"] >= r["slo_attainment"]
        and (o["goodput_per_gpu"], o["slo_attainment"]) != (r["goodput_per_gpu"], r["slo_attainment"]) for o in rs)]
    return sorted(front, key=lambda r: (-r["goodput_per_gpu"], -r["slo_attainment"]))


def best(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The highest goodput per GPU among the results within ATTAINMENT_SLACK of the best attainment."""
    return ranked(results)[0]


def plan_file(results: Sequence[dict[str, Any]], meta: dict[str, Any],
              capacities: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What `serve --plan` reads: the best candidate, with the search's context, its front and
    every candidate's goodput (`capacities`)."""
    chosen = best(results)
    colocated = [r for r in results if r["candidate"]["mode"] == "colocated"]
    best_colocated = best(colocated) if colocated else None
    gain = chosen["goodput_per_gpu"] / best_colocated["goodput_per_gpu"] \
        if best_colocated and best_colocated["goodput_per_gpu"] > 0 else None
    return {"version": PLAN_VERSION, **meta, "best": chosen, "best_colocated": best_colocated,
            "gain_over_colocated": round(gain, 3) if gain is not None else None, "front": pareto(results),
            "num_candidates": len(capacities) or len(results),
            "goodput_per_gpu": {r["label"]: r["goodput_per_gpu"] for r in capacities}}


def read_plan(path: str | Path) -> Candidate:
    """The candidate a plan file names (raises ValueError, saying what is wrong)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--plan {path}: not a plan file ({e})") from None
    if not isinstance(data, dict) or data.get("version") != PLAN_VERSION or "best" not in data:
        raise ValueError(f"--plan {path}: not a plan file of version {PLAN_VERSION} (write one with splitserve plan)")
    try:
        return Candidate(**data["best"]["candidate"])
    except TypeError as e:
        raise ValueError(f"--plan {path}: its best candidate is malformed ({e})") from None
