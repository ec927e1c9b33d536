"""`splitserve plan`: which fleet serves a trace best under its SLOs, searched with the simulator.

    trace (Mooncake JSONL, or bench's workload flags), model, GPU kind and count, TTFT / ITL SLOs
      --(candidates: colocated workers at each TP degree; disaggregated pools at each P:D split
         in the range the trace's prefill and decode work set, each role's TP degree; step
         token budgets; KV-tier sizes; speculation off and on at the traffic's acceptance)-->
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
- a fleet of more than a node (`UNIT_GPUS`) is planned as equal units, one simulated on its
  share of the trace (`sliced`: whole prefix groups), as DistServe replicates a placement;
- a rate's run stops as soon as its verdict is settled (`loadgen.report.SloVerdict`: enough
  requests met both SLOs, or too many missed one), so an overloaded rate costs its first
  misses, not its whole queue;
- three stages (`staged`), the first two at multiples of the rate of the trace's first
  `SCREEN_REQUESTS` requests, each run on the requests from the trace's start that fill
  `MIN_SPAN_S` of arrivals at that rate: every candidate's rate bracketed within a factor 2
  (doubling or halving from the trace's);
  then, highest brackets first, bisected to 4 % (`BISECT_STEPS`) unless its bracket tops out
  at or below the `KEEP`-th goodput already found (it cannot be a finalist: `refined`); the
  `KEEP` of the most (and the colocated one of the most) then serve the whole trace once, at
  its rate, for attainment.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from control.autoscaler import AutoscaleConfig
from engine.config import SchedulerConfig, SpeculativeConfig
from loadgen import report
from loadgen.workload import WorkloadRequest
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from sim.cost_model import GPUS, MODELS, ModelShape, Roofline
from sim.fleet_types import FleetConfig

DECODE_BATCH = 32
"""The decode batch a split's work share assumes (a decode token's GPU time is its step over this)."""
SPLIT_SPREAD = 2.0
SPLIT_STEP = 1.15
"""Kept splits differ by at least this factor in prefill workers (8 GPUs keep every one)."""
UNIT_GPUS = 8
"""Fleets larger than this (a node) are planned as equal units (`unit_gpus`), one simulated."""
ATTAINMENT_SLACK = 0.01
SCREEN_REQUESTS = 600
KEEP = 3
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
    speculative: bool = False
    """Decode workers speculate (prompt lookup, the engine's priced policy; `serve --speculative ngram`)."""

    @property
    def num_gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        extra = (f", tier {self.kv_store_gib:g} GiB" if self.kv_store_gib else "") + \
            (", speculative" if self.speculative else "")
        if self.mode == "colocated":
            return f"colocated {self.decode}x TP{self.decode_tp}, budget {self.max_num_batched_tokens}{extra}"
        return (f"disaggregated {self.prefill}P(TP{self.prefill_tp}):{self.decode}D(TP{self.decode_tp}), "
                f"budget {self.max_num_batched_tokens}{extra}")


@dataclass(frozen=True)
class Space:
    """What the search may vary."""

    num_gpus: int
    tps: tuple[int, ...] = (1, 2, 4, 8)
    budgets: tuple[int, ...] = (2048, 8192)
    kv_store_gibs: tuple[float, ...] = (0.0,)
    modes: tuple[str, ...] = ("colocated", "disaggregated")
    speculation: tuple[bool, ...] = (False,)
    """Speculative decoding off and/or on (its acceptance is the workload's: `Job.spec_acceptance`)."""
    unit_gpus: int | None = None
    """The fleet as `num_gpus // unit_gpus` equal units of this many GPUs, each serving its share
    of the trace (`sliced`), one simulated (None: one unit of them all)."""

    @property
    def replicas(self) -> int:
        unit = self.unit_gpus or self.num_gpus
        if unit < 1 or self.num_gpus % unit:
            raise ValueError(f"{unit} GPUs per unit do not divide {self.num_gpus} GPUs")
        return self.num_gpus // unit


def unit_gpus(num_gpus: int, tps: Sequence[int]) -> int:
    """The unit a fleet is planned as: all of it up to UNIT_GPUS GPUs; past that the smallest
    divisor of its GPUs of at least UNIT_GPUS that holds four workers of its widest degree."""
    if num_gpus <= UNIT_GPUS:
        return num_gpus
    floor = max(UNIT_GPUS, 4 * max(tps, default=1))
    return next((u for u in range(floor, num_gpus + 1) if num_gpus % u == 0), num_gpus)


def sliced(items: Sequence[WorkloadRequest], replicas: int, key_tokens: int = 16) -> list[WorkloadRequest]:
    """The requests one of `replicas` equal units serves, at their own times: those whose
    prompt's first `key_tokens` fall to unit 0, so a group sharing a prefix stays whole, as a
    cache-aware router keeps it on the same workers (tuples of ints hash alike in every process)."""
    if replicas <= 1:
        return list(items)
    return [i for i in items if hash(tuple(i.prompt[:key_tokens])) % replicas == 0]


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
    pair can (`spread` None: every split, the exhaustive grid). With units (`Space.unit_gpus`),
    the grid of one unit, each candidate that unit times the units; the splits kept at least
    a factor SPLIT_STEP apart in prefill GPUs, from the nearest one out."""
    num_gpus, replicas = space.num_gpus // space.replicas, space.replicas
    tps = [t for t in space.tps if t <= num_gpus and fits(model, gpu, t, max_model_len)]
    out: list[Candidate] = []
    for budget in space.budgets:
        for gib in space.kv_store_gibs:
            if "colocated" in space.modes:
                out += [Candidate("colocated", 0, num_gpus // t, t, t, budget, gib)
                        for t in tps if num_gpus % t == 0]
            if "disaggregated" not in space.modes:
                continue
            for p_tp in tps:
                for d_tp in tps:
                    splits = [(p, (num_gpus - p * p_tp) // d_tp) for p in range(1, num_gpus // p_tp + 1)]
                    splits = [(p, d) for p, d in splits if d >= 1]
                    if not splits:
                        continue
                    def distance(pd: tuple[int, int]) -> float:
                        return abs(math.log(max(pd[0] * p_tp, 1e-9) / max(share * num_gpus, 1e-9)))
                    near = sorted(splits, key=distance)
                    keep = set(near) if spread is None else \
                        {pd for pd in near if distance(pd) <= math.log(spread)} | set(near[:3])
                    if spread is not None:
                        keep = _apart(sorted(keep), near[0])
                    out += [Candidate("disaggregated", p, d, p_tp, d_tp, budget, gib) for p, d in sorted(keep)]
    return sorted({dataclasses.replace(c, prefill=c.prefill * replicas, decode=c.decode * replicas, speculative=spec)
                   for c in out for spec in space.speculation})


def _apart(splits: list[tuple[int, int]], nearest: tuple[int, int]) -> set[tuple[int, int]]:
    """The splits (by prefill workers, ascending) at least SPLIT_STEP apart, from `nearest` out."""
    kept = {nearest}
    for side in ([pd for pd in reversed(splits) if pd[0] < nearest[0]], [pd for pd in splits if pd[0] > nearest[0]]):
        last = nearest[0]
        for pd in side:
            if max(pd[0], last) / min(pd[0], last) >= SPLIT_STEP:
                kept.add(pd)
                last = pd[0]
    return kept


def fleet_config(c: Candidate, model: ModelShape, gpu: str, max_model_len: int, seed: int,
                 spec_acceptance: float = 0.0) -> FleetConfig:
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
        kv_store_blocks=int(c.kv_store_gib * 2**30 // block_tokens),
        speculative=SpeculativeConfig(method="ngram") if c.speculative else None, spec_acceptance=spec_acceptance)


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
    kind: Literal["bracket", "capacity", "attainment", "scaling"] = "attainment"
    """`bracket`: the rates within a factor 2 of the highest it holds at (doubling or halving
    from the trace's); `capacity`: that rate by bisection (within `bracket`, else from scratch)."""
    bracket: tuple[float, float] | None = None
    bracket_capped: bool = False
    """The bracket's stage left a rate untried (MAX_EXTEND): its top may not be a failure."""
    target: float = TARGET_ATTAINMENT
    min_span_s: float = MIN_SPAN_S
    """A rate is tried over at least this long (a test's short trace may lower it)."""
    replicas: int = 1
    """The candidate is this many equal units, one simulated on its share (`sliced`) of the requests."""
    predictive: bool = False
    """`scaling`: the candidate's pools autoscaled within it (`autoscaled`), predictive or reactive."""
    spec_acceptance: float = 0.0
    """The workload's: the chance a speculative candidate's proposal is right if all before it were."""
    screen: int | None = None
    """`bracket` and `capacity`: the rate multiples are of the trace's first this many requests'
    rate, and a run takes the requests from the trace's start that fill `min_span_s` (None: all)."""


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
    """One candidate simulated (module docstring): by `job.kind`, its capacity per GPU
    (`_capacity`), its attainment and latencies at the trace's own rate, or its pools
    autoscaled over the trace."""
    from sim.cli import summary
    from sim.fleet import Fleet  # the fleet pulls the router's and engine's modules: in the worker

    items = items if items is not None else _ITEMS
    model = MODELS[job.model].in_fp8(*job.quantization)
    c = job.candidate
    unit = dataclasses.replace(c, prefill=c.prefill // job.replicas, decode=c.decode // job.replicas)
    cfg = fleet_config(unit, model, job.gpu, job.max_model_len, job.seed, job.spec_acceptance)
    d_hw = Roofline(model, GPUS[job.gpu], c.decode_tp)
    p_hw = Roofline(model, GPUS[job.gpu], c.prefill_tp) if cfg.prefill_gpus_per_worker else None
    if job.kind == "scaling":
        result = Fleet(dataclasses.replace(cfg, autoscale=autoscaled(unit, job)), d_hw, items, p_hw).run()
        s = summary(result, job.ttft_slo_s, job.itl_slo_s)
        return {"label": c.label, "predictive": job.predictive, "slo_attainment": s["slo_attainment"],
                "gpu_seconds": round(result.gpu_seconds * job.replicas, 1),
                "goodput_per_gpu_hour": s["goodput_per_gpu_hour"], "num_scale_actions": s["num_scale_actions"]}

    def held(requests: list[WorkloadRequest], multiple: float) -> bool:
        """Whether `target` of the requests meet the SLOs at `multiple` times their rate: the
        run stops as soon as that is settled (an overloaded rate is refused on its first misses)."""
        verdict = report.SloVerdict(len(requests), job.target, job.ttft_slo_s, job.itl_slo_s)
        result = Fleet(cfg, d_hw, at_rate(requests, multiple), p_hw, verdict).run()
        if result.decided is not None:
            return result.decided
        return report.summarize(result.run, job.ttft_slo_s, job.itl_slo_s)["slo_attainment"] >= job.target

    out: dict[str, Any] = {"candidate": dataclasses.asdict(c), "label": c.label, "num_gpus": c.num_gpus}
    if job.kind in ("bracket", "capacity"):
        return {**out, **_capacity(job, items, held)}
    s = report.summarize(Fleet(cfg, d_hw, items, p_hw).run().run, job.ttft_slo_s, job.itl_slo_s)
    return {**out, "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
            "ttft_p50_ms": s["ttft_ms"].get("p50"), "ttft_p99_ms": s["ttft_ms"].get("p99"),
            "itl_p50_ms": s["itl_ms"].get("p50"), "itl_p99_ms": s["itl_ms"].get("p99"),
            "num_failed": s["num_failed"]}


def _capacity(job: Job, items: list[WorkloadRequest],
              held: Callable[[list[WorkloadRequest], float], bool]) -> dict[str, Any]:
    """`bracket`: the rates within 2x of the highest that `held`; `capacity`: that rate by
    bisection (within `job.bracket`, else from scratch); both as goodput per GPU."""
    c = job.candidate
    head = items[:job.screen or len(items)]  # the rate multiples are of these requests' rate
    span, capped = (head[-1].at_s or 0.0) - (head[0].at_s or 0.0), []
    highest = MAX_EXTEND * span / job.min_span_s  # the highest multiple the screen can try

    def holds(m: float) -> bool:
        """Served at `m` times the rate, over at least `min_span_s`: the trace's requests from
        its start that fill it (repeated where the trace is shorter: a burst shorter than its
        requests' own service says nothing of a steady rate); a rate that would take more
        than MAX_EXTEND times the screen's requests is not tried."""
        need = math.ceil(len(head) * job.min_span_s * m / span) if span > 0 else len(head)
        if need > MAX_EXTEND * len(head):
            capped.append(m)
            return False
        need = max(need, len(head))
        return held(items[:need] if need <= len(items) else repeated(items, need), m)

    rate = trace_rate(head) * job.replicas  # the fleet's: its units' together
    if job.kind == "bracket":
        lo, hi = bracket(holds)
        return {"bracket": (lo, hi), "bracket_capped": bool(capped),
                "goodput_per_gpu_below": round(hi * rate / c.num_gpus, 4),
                **_goodput(lo, c, rate, bool(capped) and lo * 2 >= highest)}
    multiple = refine(holds, *(job.bracket or bracket(holds)))
    capped_now = (bool(capped) or job.bracket_capped) and multiple * 2 ** (2 / 2 ** BISECT_STEPS) >= highest
    return _goodput(multiple, c, rate, capped_now)


def autoscaled(unit: Candidate, job: Job) -> AutoscaleConfig:
    """The unit's pools scaled by the autoscaler between one worker and the plan's, at its P:D
    ratio, on the job's SLOs; forecasting a start-up ahead where `job.predictive`."""
    return AutoscaleConfig(prefill_min=min(unit.prefill, 1), prefill_max=unit.prefill, decode_min=1,
                           decode_max=unit.decode, ttft_slo_ms=job.ttft_slo_s * 1e3, itl_slo_ms=job.itl_slo_s * 1e3,
                           pd_ratio=unit.prefill / unit.decode if unit.prefill else None,
                           predictive=job.predictive, startup_s=FleetConfig.startup_s)


def scaling(job: Job, items: list[WorkloadRequest], workers: int | None = None) -> dict[str, Any]:
    """The candidate of `job` autoscaled within its pools over the whole trace, reactive and
    predictive (control/forecast.py), and whether predictive is ahead (`ahead`); `serve --plan
    --autoscale` scales predictively where it is."""
    reactive, predictive = search([dataclasses.replace(job, kind="scaling", predictive=p) for p in (False, True)],
                                  sliced(items, job.replicas), workers)
    return {"reactive": reactive, "predictive": predictive,
            "predictive_ahead": ahead(reactive, predictive, job.target)}


def ahead(reactive: dict[str, Any], predictive: dict[str, Any], target: float) -> bool:
    """Predictive scaling holds `target` attainment where reactive does not, or as much
    attainment (within ATTAINMENT_SLACK) at more goodput per GPU-hour (alike is not ahead)."""
    holds = predictive["slo_attainment"] >= target > reactive["slo_attainment"]
    return holds or (predictive["slo_attainment"] >= reactive["slo_attainment"] - ATTAINMENT_SLACK
                     and predictive["goodput_per_gpu_hour"] > reactive["goodput_per_gpu_hour"])


def _goodput(multiple: float, c: Candidate, rate: float, capped: bool) -> dict[str, Any]:
    rps = multiple * rate
    return {"capacity_multiple": round(multiple, 3), "capacity_rps": round(rps, 3),
            "goodput_per_gpu": round(rps / c.num_gpus, 4), "capacity_capped": capped}


def capacity(holds: Callable[[float], bool], steps: int = BISECT_STEPS) -> float:
    """The largest rate multiple at which `holds` (found within a factor 2**(1 / 2**steps)):
    doubling or halving from 1 to a bracket, then bisection of its logarithm; 0 where it
    does not hold at MIN_MULTIPLE."""
    return refine(holds, *bracket(holds), steps)


def bracket(holds: Callable[[float], bool]) -> tuple[float, float]:
    """(lo, hi = 2 lo): it holds at lo and not at hi, by doubling or halving from 1; (MAX_MULTIPLE,
    MAX_MULTIPLE) where it holds there, (0, MIN_MULTIPLE) where it does not hold at MIN_MULTIPLE."""
    if holds(1.0):
        lo, hi = 1.0, 2.0
        while holds(hi):
            if hi >= MAX_MULTIPLE:
                return hi, hi
            lo, hi = hi, hi * 2
    else:
        lo, hi = 0.5, 1.0
        while not holds(lo):
            if lo <= MIN_MULTIPLE:
                return 0.0, lo
            lo, hi = lo / 2, lo
    return lo, hi


def refine(holds: Callable[[float], bool], lo: float, hi: float, steps: int = BISECT_STEPS) -> float:
    """The largest multiple in [lo, hi) at which `holds` (it holds at lo, not at hi), by `steps`
    bisections of the bracket's logarithm."""
    if lo <= 0 or lo >= hi:
        return lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


class _Runner:
    """Jobs on `workers` processes (in this one where there is one), each answer a future.
    The processes are spawned, never forked: a fork copies a process's locks but not the
    threads holding them (a Ray driver's, gRPC's), and a forked worker of a pytest process
    that held a Ray node stalled; the executor's shutdown then waited on it forever, past the
    test's timeout, until CI's 90 minutes ran out. Left by an exception (a timeout, ^C),
    the workers are killed, not waited for."""

    def __init__(self, items: list[WorkloadRequest], workers: int) -> None:
        self.items, self.workers = items, workers
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init, initargs=(items,)) if workers > 1 else None

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self.pool is None:
            return
        if kind is None:
            self.pool.shutdown(cancel_futures=True)
            return
        processes = list((getattr(self.pool, "_processes", None) or {}).values())  # (3.14: terminate_workers)
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.kill()

    def submit(self, job: Job) -> Future[dict[str, Any]]:
        if self.pool is not None:
            return self.pool.submit(evaluate, job)
        done: Future[dict[str, Any]] = Future()
        done.set_result(evaluate(job, self.items))
        return done


def _runner_for(runner: _Runner | None, items: list[WorkloadRequest], workers: int | None,
                num_jobs: int) -> contextlib.AbstractContextManager[_Runner]:
    """The caller's runner (left open), or one of this call's own."""
    return contextlib.nullcontext(runner) if runner is not None else _Runner(items, _workers(workers, num_jobs))


def _workers(workers: int | None, num_jobs: int) -> int:
    return max(1, min(workers or os.cpu_count() or 1, num_jobs))


def search(jobs: Sequence[Job], items: list[WorkloadRequest], workers: int | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None,
           runner: _Runner | None = None) -> list[dict[str, Any]]:
    """Every job's result, in the jobs' order, on `workers` processes (default: every core), or
    on `runner`'s (one of the caller's, over the same `items`)."""
    with _runner_for(runner, items, workers, len(jobs)) as run:
        results = []
        for f in [run.submit(j) for j in jobs]:
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


def refined(jobs: Sequence[Job], brackets: Sequence[dict[str, Any]], items: list[WorkloadRequest], keep: int,
            workers: int | None = None, progress: Callable[[dict[str, Any]], None] | None = None,
            runner: _Runner | None = None) -> list[dict[str, Any]]:
    """Each candidate's goodput within its bracket, by bisection, highest brackets first; a
    candidate whose bracket tops out at or below the `keep`-th goodput found (and, colocated,
    below the best colocated one) cannot be a finalist and keeps its bracket's lower end
    (`capacity_refined` false). The finalists are those `staged` would pick from every
    candidate bisected."""
    order = sorted(zip(jobs, brackets), key=lambda jb: -jb[1]["goodput_per_gpu_below"])
    found: dict[str, dict[str, Any]] = {}

    def beaten(job: Job, b: dict[str, Any]) -> bool:
        if b["bracket_capped"]:
            return False
        top = b["goodput_per_gpu_below"]  # it did not hold there
        fine = sorted((r["goodput_per_gpu"] for r in found.values() if r["capacity_refined"]), reverse=True)
        colocated = [r["goodput_per_gpu"] for r in found.values()
                     if r["capacity_refined"] and r["candidate"]["mode"] == "colocated"]
        return len(fine) >= keep and top <= fine[keep - 1] and (
            job.candidate.mode != "colocated" or bool(colocated) and top <= max(colocated))

    def record(r: dict[str, Any]) -> None:
        found[r["label"]] = r
        if progress:
            progress(r)

    pending: dict[Future[dict[str, Any]], dict[str, Any]] = {}
    queue = list(reversed(order))
    with _runner_for(runner, items, workers, len(jobs)) as run:
        while queue or pending:
            while queue and len(pending) < run.workers:
                job, b = queue.pop()
                if beaten(job, b):
                    record({**b, "capacity_refined": False})
                    continue
                pending[run.submit(dataclasses.replace(job, kind="capacity", bracket=b["bracket"],
                                                          bracket_capped=b["bracket_capped"]))] = b
            for f in wait(list(pending), return_when=FIRST_COMPLETED).done if pending else ():
                record({**pending.pop(f), **f.result(), "capacity_refined": True})
    return [found[j.candidate.label] for j in jobs]


def staged(jobs: Sequence[Job], items: list[WorkloadRequest], screen: int = SCREEN_REQUESTS, keep: int = KEEP,
           workers: int | None = None, progress: Callable[[str, dict[str, Any]], None] | None = None,
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the finalists' results, every candidate's capacity): each candidate's rate (a multiple of
    the trace's first `screen` requests' rate) bracketed, then bisected where it can still be a finalist
    (`refined`); the `keep` of the most goodput (and the colocated one of the most) then serve
    the whole trace at its own rate; a finalist's result has both."""
    def stage(name: str) -> Callable[[dict[str, Any]], None] | None:
        return (lambda r: progress(name, r)) if progress else None

    items = sliced(items, jobs[0].replicas if jobs else 1)  # one unit's share: every job's units are alike
    screened = [dataclasses.replace(j, screen=screen) for j in jobs]
    with _Runner(items, _workers(workers, len(jobs))) as runner:  # one set of processes for the three stages
        brackets = search([dataclasses.replace(j, kind="bracket") for j in screened], items, workers,
                          stage("bracket"), runner)
        capacities = refined(screened, brackets, items, keep, workers, stage("capacity"), runner)
        order = sorted(capacities, key=lambda r: -r["goodput_per_gpu"])
        colocated = [r for r in order if r["candidate"]["mode"] == "colocated"]
        chosen = {r["label"] for r in order[:keep]} | ({colocated[0]["label"]} if colocated else set())
        finals = [dataclasses.replace(j, kind="attainment") for j in jobs if j.candidate.label in chosen]
        by_label = {r["label"]: r for r in capacities}
        results = [{**by_label[r["label"]], **r} for r in search(finals, items, workers, stage("attainment"), runner)]
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



def plan_scales_ahead(path: str | Path) -> bool:
    """Whether the plan file found predictive scaling ahead of reactive on its trace (`scaling`)."""
    data = json.loads(Path(path).read_text())
    return bool((data.get("autoscale") or {}).get("predictive_ahead"))