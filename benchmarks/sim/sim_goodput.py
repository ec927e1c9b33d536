"""DistServe's experiment in the simulator (H100 SXM, Llama-3-8B, the Mooncake synthetic
trace at a scaled rate): for each fleet size, the highest request rate per GPU at which
--attainment of requests meet both SLOs (TTFT and mean time per output token), colocated
vs disaggregated at each P:D split tried, found by bisection on the rate. One JSON line per
(fleet size, configuration), then one line per fleet size with the best disaggregated split
over colocated. Each trial serves the trace's first --num-requests requests, their arrival
times scaled to the rate. With --tightest-at, DistServe's other measure instead: at that
rate per GPU, the smallest factor on both SLOs that each configuration holds.

    ./dev python benchmarks/sim/sim_goodput.py [--gpus 8,16] [--ttft-slo-ms 2000] [--itl-slo-ms 50]
    ./dev python benchmarks/sim/sim_goodput.py --gpus 8 --tightest-at 0.5   # the tightest SLO scale at 0.5 req/s/GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from loadgen import report
from loadgen.runner import Run
from router.policy import RoutingConfig
from sim.arrivals import trace_items
from sim.cost_model import H100_SXM, LLAMA3_8B, Roofline
from sim.fleet import Fleet, FleetConfig

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_RATE = 3993 / 1022.025


def served(hw: Roofline, cfg: FleetConfig, rate: float, n: int) -> Run:
    """The first `n` requests of the trace, its times scaled to `rate`: every fleet size and
    rate sees the same requests, so the same prefix sharing (a slice that grew with the rate
    gave larger fleets more of the trace's repeats, and more cache hits per GPU)."""
    return Fleet(cfg, hw, trace_items(TRACE, n, 512, 131071, 128256, TRACE_RATE / rate)).run().run


def bisect(lo: float, hi: float, steps: int, below: Callable[[float], bool]) -> tuple[float, float]:
    """Halves [lo, hi] in log space `steps` times around where `below(x)` turns false."""
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return lo, hi


def max_rate(hw: Roofline, cfg: FleetConfig, target: float, n: int, slo: tuple[float, float],
             lo: float, hi: float, steps: int) -> float:
    """The highest rate (requests/s) in [lo, hi] whose attainment is >= target, to hi/lo / 2**steps
    (hi itself when it holds there: widen the range)."""
    def holds(rate: float) -> bool:
        return report.summarize(served(hw, cfg, rate, n), *slo)["slo_attainment"] >= target
    if not holds(lo):
        return 0.0
    if holds(hi):
        return hi
    return bisect(lo, hi, steps, holds)[0]


def tightest_scale(hw: Roofline, cfg: FleetConfig, target: float, n: int, rate: float,
                   slo: tuple[float, float], steps: int = 20) -> float:
    """DistServe's "SLO scale": the smallest factor s for which `target` of the requests meet
    both s x TTFT and s x TPOT, at a fixed `rate` (one run; each s is a summary of it)."""
    run = served(hw, cfg, rate, n)

    def holds(scale: float) -> bool:
        return report.summarize(run, slo[0] * scale, slo[1] * scale)["slo_attainment"] >= target
    lo, hi = 1 / 64, 64.0
    if not holds(hi):
        return float("inf")
    return bisect(lo, hi, steps, lambda scale: not holds(scale))[1]


def arms(base: FleetConfig, g: int) -> dict[str, FleetConfig]:
    """Colocated on `g` workers, and disaggregated at P:D splits from 1:3 to 7:1."""
    out = {"colocated": dataclasses.replace(base, num_prefill=0, num_decode=g, routing=RoutingConfig(mode="colocated"))}
    for p in sorted({max(1, round(g * f)) for f in (0.25, 0.5, 0.625, 0.75, 0.875)} - {g}):
        out[f"{p}P:{g - p}D"] = dataclasses.replace(base, num_prefill=p, num_decode=g - p,
                                                     routing=RoutingConfig(mode="disaggregated"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=50.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--num-requests", type=int, default=1200, help="per trial: the trace's first N")
    ap.add_argument("--tightest-at", type=float, default=0.0,
                    help="requests/s per GPU: instead of the highest rate, the tightest SLO scale each holds at it")
    ap.add_argument("--steps", type=int, default=8, help="bisection steps on the rate (each halves the log range)")
    args = ap.parse_args()
    hw = Roofline(LLAMA3_8B, H100_SXM)
    slo = (args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    base = FleetConfig(num_blocks=hw.kv_capacity_tokens() // 16)
    for g in (int(x) for x in args.gpus.split(",")):
        if args.tightest_at:
            tightest(hw, base, g, slo, args)
            continue
        best: dict[str, float] = {}
        for name, cfg in arms(base, g).items():
            began = time.perf_counter()
            rate = max_rate(hw, cfg, args.attainment, args.num_requests, slo, 0.1 * g, 4.0 * g, args.steps)
            best[name] = rate
            print(json.dumps({**vars(args), "bench": "sim_goodput", "gpus": g, "config": name, "max_rate_rps": round(rate, 3),
                              "per_gpu": round(rate / g, 4), "wall_s": round(time.perf_counter() - began, 1)}), flush=True)
        disagg = {k: v for k, v in best.items() if k != "colocated"}
        top = max(disagg, key=lambda k: disagg[k])
        print(json.dumps({"bench": "sim_goodput_summary", "gpus": g, "colocated_per_gpu": round(best["colocated"] / g, 4),
                          "best_split": top, "disaggregated_per_gpu": round(disagg[top] / g, 4),
                          "disaggregated_over_colocated": round(disagg[top] / best["colocated"], 3)
                          if best["colocated"] else None}), flush=True)


def tightest(hw: Roofline, base: FleetConfig, g: int, slo: tuple[float, float], args: argparse.Namespace) -> None:
    scales = {}
    for name, cfg in arms(base, g).items():
        began = time.perf_counter()
        scale = scales[name] = tightest_scale(hw, cfg, args.attainment, args.num_requests, args.tightest_at * g, slo)
        print(json.dumps({**vars(args), "bench": "sim_tightest_slo", "gpus": g, "config": name, "rate_rps": args.tightest_at * g,
                          "slo_scale": round(scale, 3), "ttft_ms": round(slo[0] * scale * 1e3, 1),
                          "tpot_ms": round(slo[1] * scale * 1e3, 2), "wall_s": round(time.perf_counter() - began, 1)}),
              flush=True)
    disagg = {k: v for k, v in scales.items() if k != "colocated"}
    top = min(disagg, key=lambda k: disagg[k])
    print(json.dumps({"bench": "sim_tightest_slo_summary", "gpus": g, "colocated_scale": round(scales["colocated"], 3),
                      "best_split": top, "disaggregated_scale": round(disagg[top], 3),
                      "colocated_over_disaggregated": round(scales["colocated"] / disagg[top], 3)}), flush=True)


if __name__ == "__main__":
    main()
