"""Autoscaled vs fixed pools in the simulator under a rate that swings: 16 H100s serving
Llama-3-8B, 2,048-token prompts and 256-token answers, arriving (--shape) as a sinusoid of
--rate requests/s +-80 % with a 300 s period (a day sped up), a ramp from a fifth of --rate
to 1.8x it over the run, or Poisson at --rate with a burst of a tenth of a period's requests
at once every 120 s (240 at the default rate: spikes a trend must not chase). Arms: the
fixed split `splitserve simulate` picks for the workload, and the autoscaler from 1P:1D (up
to 15 workers a pool) with its step capped at --old-max-step (1: one worker per action, the
policy before scale-ups were sized to the deficit) and at its default, and the latter
predictive too (launching for the load forecast a start-up ahead, control/forecast.py). One
JSON line per arm: bench's summary keys, GPU-seconds, goodput per GPU-hour, scale actions
and the largest pools; with --plots DIR, bench's PNGs with every arm.

    ./dev python benchmarks/sim/sim_autoscale.py [--shape sinusoid|ramp|burst] [--num-requests 18000] [--plots docs/sim]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from loadgen import plots
from sim import cli
from sim.cost_model import Roofline
from sim.fleet import Fleet

SHAPES = {
    "sinusoid": lambda rate: ["--rate", str(rate), "--arrival", "sinusoid", "--amplitude", "0.8", "--period-s", "300"],
    "ramp": lambda rate: ["--rate", str(rate / 5), "--rate-to", str(rate * 1.8), "--arrival", "ramp"],
    "burst": lambda rate: ["--rate", str(rate), "--arrival", "burst", "--amplitude", "0.1", "--period-s", "120"],
}
"""`simulate`'s arrival flags for each --shape."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="sinusoid")
    ap.add_argument("--num-requests", type=int, default=18000)
    ap.add_argument("--old-max-step", type=int, default=1)
    ap.add_argument("--plots", type=Path)
    ap.add_argument("--arms", help="only the arms whose label holds one of these (comma-separated), e.g. predictive")
    args = ap.parse_args()
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    sim_args = parser.parse_args(["simulate", *SHAPES[args.shape](args.rate), "--num-requests", str(args.num_requests),
                                  "--prompt-len",
                                  "2048", "--output-len", "256", "--num-gpus", "16", "--mode", "disaggregated"])
    hw = Roofline(cli.MODELS[sim_args.model], cli.GPUS[sim_args.gpu], sim_args.tp)
    items = cli.workload(sim_args)
    (fixed_label, fixed), = cli.configs(sim_args, hw, items)
    (_, auto), = cli.configs(argparse.Namespace(**{**vars(sim_args), "autoscale": True}), hw, items)
    assert auto.autoscale is not None
    arms = {f"fixed {fixed_label.split()[-1]}": fixed,
            f"autoscaled, max_step {args.old_max_step}": dataclasses.replace(
                auto, autoscale=dataclasses.replace(auto.autoscale, max_step=args.old_max_step)),
            f"autoscaled, sized (max_step {auto.autoscale.max_step})": auto,
            "autoscaled, sized and predictive": dataclasses.replace(auto, autoscale=dataclasses.replace(
                auto.autoscale, predictive=True, startup_s=auto.startup_s))}
    runs = {}
    for label, cfg in arms.items():
        if args.arms and not any(a in label for a in args.arms.split(",")):
            continue
        try:
            result = Fleet(cfg, hw, items).run()
        except RuntimeError as e:  # the simulator's own check: a run that can no longer move
            print(json.dumps({"bench": "sim_autoscale", "arm": label, "error": str(e)}), flush=True)
            continue
        s = cli.summary(result, sim_args.ttft_slo_ms / 1e3, sim_args.itl_slo_ms / 1e3)
        print(json.dumps({"bench": "sim_autoscale", "arm": label, **s,
                          "largest_pools": [max(p for _, p, _ in result.pool_sizes),
                                            max(d for _, _, d in result.pool_sizes)],
                          **vars(args), "plots": str(args.plots)}), flush=True)
        runs[label] = plots.records(result.run)
    if args.plots:
        plots.plot(runs, args.plots)


if __name__ == "__main__":
    main()
