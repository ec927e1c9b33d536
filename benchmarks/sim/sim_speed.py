"""How fast the simulator runs: --sim-hours of the Mooncake synthetic trace's own arrival
rate (3,993 requests in 1,022 s, repeated end to end) on --num-gpus H100s serving
Llama-3-8B, disaggregated (the default split of `splitserve simulate`). One JSON line:
simulated seconds per wall second, steps per wall second, and per tenth of the run the
wall time per step and the process's RSS: a step's cost should follow the step's batch, not
the run's history, and memory should stay flat.

    ./dev python benchmarks/sim/sim_speed.py [--sim-hours 1] [--num-gpus 64]
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from router.policy import RoutingConfig
from sim.arrivals import trace_items
from sim.cli import default_split
from sim.cost_model import H100_SXM, LLAMA3_8B, Roofline
from sim.fleet import Fleet, FleetConfig

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_RATE = 3993 / 1022.025


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim-hours", type=float, default=1.0)
    ap.add_argument("--num-gpus", type=int, default=64)
    args = ap.parse_args()
    hw = Roofline(LLAMA3_8B, H100_SXM)
    began = time.perf_counter()
    n = int(args.sim_hours * 3600 * TRACE_RATE)
    items = trace_items(TRACE, n, 512, 131071, 128256, 1.0)
    load_s = time.perf_counter() - began
    p, d = default_split(hw, items, args.num_gpus, 2048)
    cfg = FleetConfig(num_prefill=p, num_decode=d, num_blocks=hw.kv_capacity_tokens() // 16,
                      routing=RoutingConfig(mode="disaggregated"))
    fleet = Fleet(cfg, hw, items)
    span = items[-1].at_s or 1.0
    segments: list[dict[str, float]] = []
    mark = {"t": time.perf_counter(), "steps": 0, "next": span / 10}

    def progress(f: Fleet) -> None:
        if f.now >= mark["next"]:
            now = time.perf_counter()
            steps = f.stats["num_steps"] - mark["steps"]
            segments.append({"sim_s": round(f.now), "wall_s": round(now - mark["t"], 2), "steps": steps,
                             "us_per_step": round((now - mark["t"]) / max(steps, 1) * 1e6, 1),
                             "rss_mib": round(rss_mib())})
            mark.update(t=now, steps=f.stats["num_steps"], next=mark["next"] + span / 10)

    fleet.on_progress = progress
    started = time.perf_counter()
    result = fleet.run()
    wall = time.perf_counter() - started
    print(json.dumps({"bench": "sim_speed", "num_requests": n, "sim_s": round(fleet.now, 1), "wall_s": round(wall, 1),
                      "sim_s_per_wall_s": round(fleet.now / wall, 1), "steps": result.stats["num_steps"],
                      "steps_per_wall_s": round(result.stats["num_steps"] / wall), "load_s": round(load_s, 1),
                      "split": f"{p}P:{d}D", "segments": segments, **vars(args)}), flush=True)


if __name__ == "__main__":
    main()
