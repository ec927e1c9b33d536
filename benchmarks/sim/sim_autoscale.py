"""Autoscaled vs fixed pools in the simulator under a rate that swings: 16 H100s serving
Llama-3-8B, a sinusoid of --rate requests/s +-80 % with a 300 s period, 2,048-token prompts
and 256-token answers. Arms: the fixed split `splitserve simulate` picks for the workload,
and the autoscaler from 1P:1D (up to 15 workers a pool) with its step capped at
--old-max-step (1: one worker per action, the policy before scale-ups were sized to the
deficit) and at its default, and the latter predictive too (launching for the load forecast
a start-up ahead, control/forecast.py). One JSON line per arm: bench's summary keys, GPU-seconds,
goodput per GPU-hour, scale actions and the largest pools; with --plots DIR, bench's PNGs
with every arm.

    ./dev python benchmarks/sim/sim_autoscale.py [--num-requests 18000] [--plots docs/sim]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--num-requests", type=int, default=18000)
    ap.add_argument("--old-max-step", type=int, default=1)
    ap.add_argument("--plots", type=Path)
    ap.add_argument("--arms", help="only the arms whose label holds one of these (comma-separated), e.g. predictive")
    args = ap.parse_args()
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    sim_args = parser.parse_args(["simulate", "--rate", str(args.rate), "--arrival", "sinusoid", "--amplitude", "0.8",
                                  "--period-s", "300", "--num-requests", str(args.num_requests), "--prompt-len",
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
