"""Does `splitserve plan` rank fleets as the real cluster does? Four fleets of held workers
(each engine step held to a floor, an emulated accelerator: on two cores a worker more is
capacity more, as a GPU more is) serve one workload on this machine and in the simulator
with the CPU-fitted, calibrated cost model (benchmarks/sim/sim_validation.py); each one's
goodput per worker is found the way `plan` finds it (sim/plan.py: the rate bracketed within
2x, then bisected), on the real cluster and in the Fleet, and the two rankings compared.

Workload: a quarter 1,024-token prompts with 8 tokens out, the rest 64 with 48 out (the
validation's `mixed`), Poisson at multiples of --base-rate, each rate over --span-s of
arrivals with prompts of its own (no run finds another's in the prefix cache).
Fleets: colocated 2, disaggregated 1P:1D, colocated 3, disaggregated 1P:2D.

One JSON line per fleet and measure, then the rankings (real, simulated, whether they agree,
pairs closer than 10 % counted as ties).

    ./dev python benchmarks/sim/plan_validate.py [--span-s 30] [--steps 2]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.` imports

from benchmarks.sim.sim_validate import COLOCATED, FLOOR, PD, VOCAB, fitted  # noqa: E402
from benchmarks.sim.sim_validation import Arm, fleet_config, fresh_cluster  # noqa: E402
from loadgen import report  # noqa: E402
from loadgen.runner import Run, run  # noqa: E402
from loadgen.workload import WorkloadRequest  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402
from sim.arrivals import Shape, arrival_times, timed  # noqa: E402
from sim.cpu_fit import CpuCost  # noqa: E402
from sim.fleet import Fleet  # noqa: E402
from sim.plan import bracket, refine  # noqa: E402

FLEETS = (
    Arm("colocated 2", 0, 2, RoutingConfig(mode="colocated"), step_floor=FLOOR),
    Arm("disaggregated 1P:1D", 1, 1, RoutingConfig(mode="disaggregated"), step_floor=FLOOR),
    Arm("colocated 3", 0, 3, RoutingConfig(mode="colocated"), step_floor=FLOOR),
    Arm("disaggregated 1P:2D", 1, 2, RoutingConfig(mode="disaggregated"), step_floor=FLOOR),
)
TIE = 0.10
"""Goodputs within this fraction of each other rank as a tie (the real cluster's run-to-run spread)."""


def workload(rate: float, span_s: float, seed: int) -> list[WorkloadRequest]:
    """The mixed workload at `rate` over `span_s`, prompts drawn from `seed` (a run's own)."""
    rng = random.Random(seed)
    n = max(8, math.ceil(rate * span_s))
    items = [WorkloadRequest([rng.randrange(3, VOCAB) for _ in range(1024)], 8) if rng.random() < 0.25 else
             WorkloadRequest([rng.randrange(3, VOCAB) for _ in range(64)], 48) for _ in range(n)]
    return timed(items, arrival_times(n, Shape(rate=rate), seed))


def goodput(holds: Callable[[float], bool], steps: int) -> float:
    """The largest rate multiple that holds, as `plan` finds it (bracket, then bisection)."""
    return refine(holds, *bracket(holds), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-rate", type=float, default=2.0, help="requests/s at multiple 1")
    ap.add_argument("--span-s", type=float, default=30.0, help="seconds of arrivals per rate tried")
    ap.add_argument("--steps", type=int, default=2, help="bisection steps after the bracket (2: within 19 %%)")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=50.0)
    ap.add_argument("--target", type=float, default=0.9)
    args = ap.parse_args()
    began = time.perf_counter()
    model, _, costs = fitted(0)
    print(json.dumps({"bench": "plan_validate_fit", "fit_and_calibration_s": round(time.perf_counter() - began, 1)}),
          flush=True)
    found = {arm.name: measured(arm, model, costs, args) for arm in FLEETS}
    rankings = {kind: sorted(found, key=lambda name: -found[name][kind]) for kind in ("real", "sim")}
    pairs = []
    names = list(found)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            verdicts = {kind: order(found[a][kind], found[b][kind]) for kind in ("real", "sim")}
            pairs.append({"a": a, "b": b, **verdicts, "agree": verdicts["real"] == verdicts["sim"] or "tie" in
                          verdicts.values()})
    print(json.dumps({"bench": "plan_validate_rankings", "real": rankings["real"], "sim": rankings["sim"],
                      "same_order": rankings["real"] == rankings["sim"], "pairs": pairs,
                      "pairs_agreeing": sum(p["agree"] for p in pairs), "num_pairs": len(pairs)}), flush=True)


def measured(arm: Arm, model: str, costs: dict[str, CpuCost], args: argparse.Namespace) -> dict[str, float]:
    """`arm`'s goodput per worker, real and simulated, each found as `plan` finds it (one JSON line)."""
    slo = (args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    # the floor holds the engine's step; what serving adds around it is the unheld arm's of the same mode
    cost = dataclasses.replace(costs[PD.name if arm.num_prefill else COLOCATED.name], floor=FLOOR)
    tried: dict[str, list[tuple[float, float]]] = {"real": [], "sim": []}

    def attained(kind: str, served: Callable[[list[WorkloadRequest]], Run], m: float) -> bool:
        items = workload(args.base_rate * m, args.span_s, seed=int(m * 1000))
        s = report.summarize(served(items), *slo)
        tried[kind].append((round(m, 3), s["slo_attainment"]))
        return s["slo_attainment"] >= args.target

    started = time.perf_counter()
    with fresh_cluster(model, arm) as cluster:
        def real(items: list[WorkloadRequest]) -> Run:
            return asyncio.run(run(cluster.address, items, timeout_s=600))

        real_m = goodput(lambda m: attained("real", real, m), args.steps)
    real_s = time.perf_counter() - started
    started = time.perf_counter()

    def simulated(items: list[WorkloadRequest]) -> Run:
        return Fleet(fleet_config(model, arm), cost, items).run().run

    sim_m = goodput(lambda m: attained("sim", simulated, m), args.steps)
    workers = arm.num_prefill + arm.num_decode
    found = {kind: round(m * args.base_rate / workers, 3) for kind, m in (("real", real_m), ("sim", sim_m))}
    print(json.dumps({"bench": "plan_validate", "fleet": arm.name, "workers": workers,
                      "goodput_per_worker_rps": found, "tried_multiple_attainment": tried,
                      "real_s": round(real_s, 1), "sim_s": round(time.perf_counter() - started, 1),
                      "slo_ms": [args.ttft_slo_ms, args.itl_slo_ms], "target": args.target}), flush=True)
    return found


def order(a: float, b: float) -> str:
    """Which of two goodputs is higher: "a", "b", or "tie" within TIE of the larger."""
    if abs(a - b) <= TIE * max(a, b, 1e-9):
        return "tie"
    return "a" if a > b else "b"


if __name__ == "__main__":
    main()
