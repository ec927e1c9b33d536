"""The simulator against the real cluster here: the same workloads, at the same arrival
times, on the tiny llama (CPU) and in the Fleet with the CPU-fitted cost model and the same
configuration (benchmarks/sim/sim_validation.py says how the model is fitted and calibrated). One JSON line
per workload and arm (real and simulated summaries, sim / real for TTFT and ITL p50/p90/p99
and output throughput, and whether p50 is within 15 % and p99 within 30 %), then one line
with the rankings: for each pair of arms, which is better on TTFT p50, ITL p99 and goodput,
real and simulated, and whether they agree.

Workloads (--num-requests each, default 200):
  overhead  low rate (2/s), 128-token prompts, 32 tokens out: 1P:1D
  mixed     a quarter 1024-token prompts with 8 out, the rest 64 with 48 out, 4/s:
            1P:1D disaggregated vs 2 colocated
  prefix    every prompt starts with one of 24 prefixes of 1,000 tokens (prompts 550-1,650),
            4/s, 16k tokens of KV a worker: 2P:2D cache-aware vs round-robin
  trace     the Mooncake trace's first requests, lengths / 64, its own times: 1P:1D
  autoscale 128-token prompts, 48 out, a sinusoid of 0.2-3.2/s over 120 s; every engine step
            held to 10 ms + 0.2 ms a token + 6 ms a request (an emulated accelerator: on two
            cores a worker more is no capacity more, and no autoscaler could win): fixed
            1P:3D vs autoscaled 1P with 1-3 D (start-up measured here first); worker-seconds
            and scale actions beside the summaries

    ./dev python benchmarks/sim/sim_validate.py [--workloads overhead,mixed,prefix,trace,autoscale] [--num-requests 200]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.` imports

from benchmarks.sim.sim_validation import (Arm, calibrate, compare, fit_engine, measure_startup,  # noqa: E402
                                           real_pooled_run, real_run, sim_pooled_run, within)
from loadgen import report  # noqa: E402
from loadgen.workload import WorkloadRequest, synthetic  # noqa: E402
from control.autoscaler import AutoscaleConfig  # noqa: E402
from engine.config import StepFloor  # noqa: E402
from engine.model.tiny_model import make_tiny_model  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402
from sim.arrivals import Shape, arrival_times, timed, trace_items  # noqa: E402
from sim.cpu_fit import CpuCost  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
VOCAB = 500
PD = Arm("disaggregated 1P:1D", 1, 1, RoutingConfig(mode="disaggregated"))
COLOCATED = Arm("colocated 2", 0, 2, RoutingConfig(mode="colocated"))
PREFIX_KV_BYTES = 8 * 2**20
"""16k tokens a worker for the prefix arms: their 24 prefixes (24k tokens) fit two prefill
workers' caches when each keeps its own, not one's."""
AWARE = Arm("cache-aware 2P:2D", 2, 2, RoutingConfig(mode="disaggregated"), PREFIX_KV_BYTES)
ROUND_ROBIN = Arm("round-robin 2P:2D", 2, 2, RoutingConfig(mode="disaggregated", policy="round_robin"),
                  PREFIX_KV_BYTES)
FLOOR = StepFloor(base_s=0.010, token_s=0.0002, seq_s=0.006)
"""A decode step of B requests takes 10 + 6.2·B ms: one decode worker holds about 2.4
requests/s of 48 tokens within 50 ms a token, and the peak (3.2/s) needs two; idle, a token
takes under half the budget, so a pool past the peak can shrink."""
FLOORED = Arm("held 1P:1D", 1, 1, RoutingConfig(mode="disaggregated"), step_floor=FLOOR)
FIXED = dataclasses.replace(FLOORED, name="fixed 1P:3D", num_decode=3)
SCALED = dataclasses.replace(FLOORED, name="autoscaled 1P:1-3D", autoscale=AutoscaleConfig(
    prefill_min=1, prefill_max=1, decode_min=1, decode_max=3, ttft_slo_ms=1000.0, itl_slo_ms=50.0,
    up_delay_s=2.0, down_delay_s=10.0, cooldown_s=5.0))


def fitted(seed: int) -> tuple[str, CpuCost, dict[str, CpuCost]]:
    """The tiny model (written to a temporary directory), its engine's fitted step cost, and
    what serving adds around it for the unheld 1P:1D and colocated arms, calibrated on the
    real cluster with 24 requests of their own."""
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama", seed=0))
    engine = fit_engine(model)
    rng = random.Random(seed + 9)
    calibration = [WorkloadRequest([rng.randrange(3, VOCAB) for _ in range(128)], 32) for _ in range(24)]
    return model, engine, calibrate(model, engine, calibration, PD, COLOCATED)


def workloads(n: int, seed: int) -> dict[str, tuple[list[WorkloadRequest], list[Arm]]]:
    rng = random.Random(seed)
    mixed = [WorkloadRequest([rng.randrange(3, VOCAB) for _ in range(1024)], 8) if rng.random() < 0.25 else
             WorkloadRequest([rng.randrange(3, VOCAB) for _ in range(64)], 48) for _ in range(n)]
    return {
        "overhead": (timed(synthetic(n, 128, 32, 0.0, 0, 0, VOCAB, seed), arrival_times(n, Shape(rate=2.0), seed)),
                     [PD]),
        "mixed": (timed(mixed, arrival_times(n, Shape(rate=4.0), seed + 1)), [PD, COLOCATED]),
        "prefix": (timed(synthetic(n, 1100, 16, 1.0, 24, 1000, VOCAB, seed + 2), arrival_times(n, Shape(rate=4.0), seed + 2)),
                   [AWARE, ROUND_ROBIN]),
        "trace": (trace_items(TRACE, n, 8, 1024, VOCAB, 1.0), [PD]),
        "autoscale": (timed(synthetic(n, 128, 48, 0.0, 0, 0, VOCAB, seed + 3),
                            arrival_times(n, Shape("sinusoid", rate=n / 120, amplitude=0.9, period_s=120.0), seed + 3)),
                      [FIXED, SCALED]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="overhead,mixed,prefix,trace,autoscale")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    slo = (args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    began = time.perf_counter()
    model, engine, costs = fitted(args.seed)
    costs[AWARE.name] = costs[ROUND_ROBIN.name] = costs[PD.name]
    startup_s = 0.0
    if "autoscale" in args.workloads.split(","):
        # the floor holds the engine's step; what serving adds around it is 1P:1D's (calibrating
        # on held engines would count their batches' longer steps as delivery delays)
        costs[FIXED.name] = costs[SCALED.name] = dataclasses.replace(costs[PD.name], floor=FLOOR)
        startup_s = measure_startup(model, FLOORED)
    print(json.dumps({"bench": "sim_validate_fit", "engine_coef": engine.coef,
                      **{name: {**{k: round(v, 8) for k, v in vars(c).items() if k not in ("coef", "delivery_s", "hops_s", "floor")},
                                "floor": dataclasses.asdict(c.floor) if c.floor else None,
                                **{f"{k}_ms_p50_p90_p99": [round((report.pct(xs, q) or 0.0) * 1e3, 3) for q in report.QUANTILES]
                                   for k, xs in (("hops", list(c.hops_s)), ("delivery", [x for d in c.delivery_s for x in d]))}}
                         for name, c in costs.items()},
                      "startup_s": round(startup_s, 2), "fit_and_calibration_s": round(time.perf_counter() - began, 1)}),
          flush=True)
    rankings = []
    for name in args.workloads.split(","):
        items, arms = workloads(args.num_requests, args.seed)[name]
        summaries = {}
        for arm in arms:
            pooled = arm.step_floor is not None  # the pools are read from the controller meanwhile
            real, real_pools = real_pooled_run(model, arm, items) if pooled else (real_run(model, arm, items), None)
            started = time.perf_counter()
            simulated, sim_pools = sim_pooled_run(model, arm, items, costs[arm.name], startup_s)
            sim_s = time.perf_counter() - started
            line = compare(real, simulated, *slo)
            if real_pools is not None:
                line["real"]["pools"], line["sim"]["pools"] = dataclasses.asdict(real_pools), dataclasses.asdict(sim_pools)
            summaries[arm.name] = line
            print(json.dumps({"bench": "sim_validate", "workload": name, "arm": arm.name, **line,
                              "within_target": within(line["sim_over_real"]), "sim_wall_s": round(sim_s, 2),
                              "num_requests": len(items)}), flush=True)
        if len(arms) == 2:
            a, b = (summaries[arm.name] for arm in arms)
            keys = ("ttft_p50", "itl_p99", "goodput_rps", *(("worker_s",) if "pools" in a["real"] else ()))
            rankings.append({"workload": name, "a": arms[0].name, "b": arms[1].name, **{
                key: {"real": better(a["real"], b["real"], key), "sim": better(a["sim"], b["sim"], key),
                      "a_ahead_real": gap(a["real"], b["real"], key), "a_ahead_sim": gap(a["sim"], b["sim"], key)}
                for key in keys}})
    for r in rankings:
        r["agree"] = all(v["real"] == v["sim"] for k, v in r.items() if isinstance(v, dict))
    print(json.dumps({"bench": "sim_validate_rankings", "rankings": rankings, "slo_ms": [args.ttft_slo_ms, args.itl_slo_ms]}),
          flush=True)


def better(a: dict, b: dict, key: str) -> str:  # type: ignore[type-arg]
    """Which arm wins on `key` ("a", "b", or "tie" within 10 %: the real cluster's own run-to-run spread
    here, the same workload twice, reached 30 % on TTFT p50)."""
    x, y, lower = _figures(a, b, key)
    if x is None or y is None or abs(x - y) <= 0.10 * max(abs(x), abs(y), 1e-9):
        return "tie"
    return "a" if (x < y) == lower else "b"


def gap(a: dict, b: dict, key: str) -> float | None:  # type: ignore[type-arg]
    """How much better a is than b on `key`, as a fraction of the larger (negative: worse): a
    ranking that agrees in direction but falls either side of the tie band shows here."""
    x, y, lower = _figures(a, b, key)
    if x is None or y is None:
        return None
    return round((y - x if lower else x - y) / max(abs(x), abs(y), 1e-9), 3)


def _figures(a: dict, b: dict, key: str) -> tuple[float | None, float | None, bool]:  # type: ignore[type-arg]
    """a's and b's figure for `key`, and whether lower is better."""
    if key == "goodput_rps":
        return a["goodput_rps"], b["goodput_rps"], False
    if key == "worker_s":
        return a["pools"]["worker_s"], b["pools"]["worker_s"], True
    k, q = key.rsplit("_", 1)
    return a[f"{k}_ms"][q], b[f"{k}_ms"][q], True


if __name__ == "__main__":
    main()
