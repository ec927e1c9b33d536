"""DistServe's experiment in the simulator (H100 SXM, Llama-3-8B, the Mooncake synthetic
trace at a scaled rate): for each fleet size, the highest request rate per GPU at which
--attainment of requests meet both SLOs (TTFT and mean time per output token), colocated
vs disaggregated at each P:D split tried, found by bisection on the rate. One JSON line per
(fleet size, configuration), then one line per fleet size with the best disaggregated split
over colocated.

    ./dev python benchmarks/sim_goodput.py [--gpus 8,16] [--ttft-slo-ms 2000] [--itl-slo-ms 50]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench import report
from router.policy import RoutingConfig
from sim.arrivals import trace_items
from sim.cost_model import H100_SXM, LLAMA3_8B, Roofline
from sim.fleet import Fleet, FleetConfig

TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_RATE = 3993 / 1022.025


def attainment(hw: Roofline, cfg: FleetConfig, rate: float, seconds: float, slo: tuple[float, float]) -> float:
    n = max(int(rate * seconds), 50)
    items = trace_items(TRACE, n, 512, 131071, 128256, TRACE_RATE / rate)
    return report.summarize(Fleet(cfg, hw, items).run().run, *slo)["slo_attainment"]


def max_rate(hw: Roofline, cfg: FleetConfig, target: float, seconds: float, slo: tuple[float, float],
             lo: float, hi: float, steps: int) -> float:
    """The highest rate (requests/s) in [lo, hi] whose attainment is >= target, to hi/lo / 2**steps."""
    if attainment(hw, cfg, lo, seconds, slo) < target:
        return 0.0
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if attainment(hw, cfg, mid, seconds, slo) >= target else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=50.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--seconds", type=float, default=60.0, help="of arrivals per trial")
    ap.add_argument("--steps", type=int, default=8, help="bisection steps on the rate (each halves the log range)")
    args = ap.parse_args()
    hw = Roofline(LLAMA3_8B, H100_SXM)
    slo = (args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    base = FleetConfig(num_blocks=hw.kv_capacity_tokens() // 16)
    for g in (int(x) for x in args.gpus.split(",")):
        arms = {"colocated": dataclasses.replace(base, num_prefill=0, num_decode=g, routing=RoutingConfig(mode="colocated"))}
        for p in sorted({max(1, round(g * f)) for f in (0.25, 0.5, 0.625, 0.75, 0.875)} - {g}):
            arms[f"{p}P:{g - p}D"] = dataclasses.replace(base, num_prefill=p, num_decode=g - p,
                                                          routing=RoutingConfig(mode="disaggregated"))
        best: dict[str, float] = {}
        for name, cfg in arms.items():
            began = time.perf_counter()
            rate = max_rate(hw, cfg, args.attainment, args.seconds, slo, 0.1 * g, 1.5 * g, args.steps)
            best[name] = rate
            print(json.dumps({"bench": "sim_goodput", "gpus": g, "config": name, "max_rate_rps": round(rate, 3),
                              "per_gpu": round(rate / g, 4), "wall_s": round(time.perf_counter() - began, 1),
                              **vars(args)}), flush=True)
        disagg = {k: v for k, v in best.items() if k != "colocated"}
        top = max(disagg, key=lambda k: disagg[k])
        print(json.dumps({"bench": "sim_goodput_summary", "gpus": g, "colocated_per_gpu": round(best["colocated"] / g, 4),
                          "best_split": top, "disaggregated_per_gpu": round(disagg[top] / g, 4),
                          "disaggregated_over_colocated": round(disagg[top] / best["colocated"], 3)
                          if best["colocated"] else None}), flush=True)


if __name__ == "__main__":
    main()
