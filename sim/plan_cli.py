"""`splitserve plan`: the search of sim/plan.py from the command line.

  splitserve plan --trace FILE --num-gpus 8 --ttft-slo-ms 2000 --itl-slo-ms 50 --out plan.json
  splitserve plan --rate 4 --prompt-len 8192 --output-len 128 --num-gpus 64 --model llama-3-70b --tp 4,8

Prints the Pareto front (goodput per GPU against SLO attainment) as a table, names the best
candidate and how its goodput per GPU compares with the best colocated one, writes the plan
file (`--out`, for `serve --plan`) and, with `--plot`, the front as a PNG. One JSON line per
candidate on stdout as it finishes (`{"bench": "plan", ...}`), then the plan itself.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from sim.cost_model import MODELS
from sim.plan import KEEP, SCREEN_REQUESTS, TARGET_ATTAINMENT, TPS


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def add_parser(sub: Any) -> None:
    from sim.cli import add_hardware_flags, add_workload_flags

    s = sub.add_parser("plan", help="which fleet serves a trace best under its SLOs: colocated or disaggregated, "
                       "the P:D split, TP per role, step budget, KV tier, searched with the simulator")
    add_workload_flags(s)
    f = add_hardware_flags(s)
    f.add_argument("--num-gpus", type=int, default=8)
    f.add_argument("--max-model-len", type=int, default=131072)
    f.add_argument("--unit-gpus", type=int, default=None,
                   help="plan the fleet as equal units of this many GPUs, one simulated on its share of the trace "
                        "(default: all of them up to a node of 8, else the smallest divisor of at least 8 that holds "
                        "four workers of the widest TP degree)")
    g = s.add_argument_group("search")
    g.add_argument("--tp", type=_ints, default=None,
                   help="TP degrees to try per role, comma-separated (default: the two smallest the model fits at)")
    g.add_argument("--budgets", type=_ints, default=(2048, 8192),
                   help="step token budgets (max_num_batched_tokens, also the prefill chunk) to try")
    g.add_argument("--kv-store-gib", type=_floats, default=(0.0,), help="KV-tier sizes per node to try (GiB)")
    g.add_argument("--modes", default="colocated,disaggregated", help="colocated, disaggregated, or both")
    g.add_argument("--spec-acceptance", type=float, default=None, metavar="P",
                   help="also try speculative decoding (prompt lookup, the engine's priced policy), each proposal "
                        "right with probability P if all before it were: the traffic's own (default: not tried)")
    g.add_argument("--screen-requests", type=int, default=SCREEN_REQUESTS,
                   help="goodput is searched at multiples of the rate of the trace's first this many requests "
                        "(each run on the requests that fill 60 s at that rate), the best --keep serve all of it")
    g.add_argument("--keep", type=int, default=KEEP, help="candidates that run on the whole trace (and the best "
                                                          "colocated one)")
    g.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    o = s.add_argument_group("SLOs and output")
    o.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    o.add_argument("--itl-slo-ms", type=float, default=50.0)
    o.add_argument("--target-attainment", type=float, default=TARGET_ATTAINMENT,
                   help="the share of requests within both SLOs at which a rate counts as served (goodput)")
    o.add_argument("--out", type=Path, default=Path("plan.json"), help="the plan file (for serve --plan)")
    o.add_argument("--plot", type=Path, metavar="PNG", help="goodput per GPU against attainment, the front marked")
    o.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from sim.plan import plan_file, scaling, staged, trace_rate

    items, share, tps, jobs = _jobs(args)
    console = Console(stderr=True)
    span = (items[-1].at_s or 0) - (items[0].at_s or 0)
    console.print(f"plan: {len(items)} requests ({trace_rate(items):.2f}/s) over {span:.0f} s, prefill "
                  f"{share:.0%} of the work; {len(jobs)} candidates on {args.num_gpus} x {args.gpu}")
    if jobs[0].replicas > 1:
        console.print(f"each candidate as {jobs[0].replicas} equal units of {args.num_gpus // jobs[0].replicas} "
                      f"GPUs, one simulated on its share of the requests (their prefix groups kept whole)")
    start = time.monotonic()
    screened = min(args.screen_requests, len(items))
    with Progress(console=console, transient=True) as bar:
        tasks = {"bracket": bar.add_task(f"goodput within 2x on the first {screened} requests", total=len(jobs)),
                 "capacity": bar.add_task("goodput within 4 % where it may be a finalist", total=len(jobs)),
                 "attainment": bar.add_task(f"the finalists on all {len(items)}", total=min(len(jobs), args.keep + 1))}

        def done(stage: str, result: dict[str, Any]) -> None:
            print(json.dumps({"bench": "plan", "stage": stage, **result}), flush=True)
            bar.advance(tasks[stage])

        results, capacities = staged(jobs, items, args.screen_requests, args.keep, args.workers, done)
    meta = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "gpu": args.gpu, "num_gpus": args.num_gpus, "ttft_slo_ms": args.ttft_slo_ms,
            "itl_slo_ms": args.itl_slo_ms, "num_requests": len(items), "prefill_share": round(share, 3),
            "target_attainment": args.target_attainment, "tps": list(tps), "screen_requests": screened,
            "unit_gpus": args.num_gpus // jobs[0].replicas, "spec_acceptance": args.spec_acceptance,
            "search_s": round(time.monotonic() - start, 1)}
    plan = plan_file(results, meta, capacities)
    chosen = next(j for j in jobs if j.candidate.label == plan["best"]["label"])
    with console.status("the best autoscaled over the whole trace, reactive and predictive"):
        plan["autoscale"] = scaling(chosen, items, args.workers)
    meta["search_s"] = plan["search_s"] = round(time.monotonic() - start, 1)
    _report(console, plan)
    args.out.write_text(json.dumps(plan, indent=1))
    console.print(f"plan written to {args.out} (serve --plan {args.out}); searched in {meta['search_s']} s")
    if args.plot:
        _plot(results, plan, args.plot)
    short = {k: v for k, v in plan.items() if k not in ("front", "goodput_per_gpu")}
    print(json.dumps({"bench": "plan", "plan": short}), flush=True)
    return 0


def _jobs(args: argparse.Namespace) -> tuple[list[Any], float, tuple[int, ...], list[Any]]:
    """(the requests, the prefill share of their work, the TP degrees tried, a job per candidate)."""
    from sim.cli import workload
    from sim.plan import Job, Space, auto_tps, candidates, prefill_share, unit_gpus

    fp8 = (args.quantization == "fp8", args.kv_cache_dtype == "fp8")
    model = MODELS[args.model].in_fp8(*fp8)
    items = workload(args)
    share = prefill_share(model, args.gpu, items, max(args.budgets))
    tps = args.tp or auto_tps(model, args.gpu, args.max_model_len, args.num_gpus)
    if args.spec_acceptance is not None and not 0.0 <= args.spec_acceptance <= 1.0:
        raise SystemExit(f"--spec-acceptance is a probability, not {args.spec_acceptance}")
    space = Space(args.num_gpus, tps, args.budgets, args.kv_store_gib, tuple(args.modes.split(",")),
                  (False, True) if args.spec_acceptance is not None else (False,),
                  args.unit_gpus or unit_gpus(args.num_gpus, tps))
    try:
        grid = candidates(space, model, args.gpu, args.max_model_len, share)
    except ValueError as e:
        raise SystemExit(f"--unit-gpus: {e}") from None
    if not grid:
        raise SystemExit(f"no candidate: {args.model} fits at none of TP {tps or TPS} within {args.num_gpus} GPUs "
                         f"and a {args.max_model_len}-token context")
    return items, share, tps, [Job(c, args.model, fp8, args.gpu, args.max_model_len, args.ttft_slo_ms / 1e3,
                                   args.itl_slo_ms / 1e3, args.seed, target=args.target_attainment,
                                   replicas=space.replicas, spec_acceptance=args.spec_acceptance or 0.0) for c in grid]


def _report(console: Any, plan: dict[str, Any]) -> None:
    """The front as a table, and the best against the best colocated."""
    from rich.table import Table

    table = Table(title="the Pareto front: goodput per GPU against SLO attainment at the trace's rate")
    for name in ("candidate", "goodput req/s/GPU", "attainment", "TTFT p99 ms", "ITL p99 ms"):
        table.add_column(name)
    for r in plan["front"]:
        at_least = ">= " if r.get("capacity_capped") else ""  # the highest rate tried held: a lower bound
        table.add_row(r["label"], f"{at_least}{r['goodput_per_gpu']:.3f}", f"{r['slo_attainment']:.3f}",
                      f"{r['ttft_p99_ms'] or 0:.0f}", f"{r['itl_p99_ms'] or 0:.1f}")
    console.print(table)
    b, c = plan["best"], plan["best_colocated"]
    versus = f"; the best colocated, {c['label']}: {c['goodput_per_gpu']:.3f} ({plan['gain_over_colocated']}x)" \
        if c and plan["gain_over_colocated"] else ""
    console.print(f"best: {b['label']}: {b['goodput_per_gpu']:.3f} req/s per GPU at attainment "
                  f"{b['slo_attainment']:.3f}{versus}")
    if plan.get("autoscale"):
        r, p = plan["autoscale"]["reactive"], plan["autoscale"]["predictive"]
        verdict = "ahead (serve --plan --autoscale scales ahead)" if plan["autoscale"]["predictive_ahead"] \
            else "not ahead (serve --plan --autoscale scales on what has arrived)"
        console.print(f"autoscaled within it: reactive attainment {r['slo_attainment']:.3f} in {r['gpu_seconds']:.0f} "
                      f"GPU-s, predictive {p['slo_attainment']:.3f} in {p['gpu_seconds']:.0f}: predictive {verdict}")


def _plot(results: list[dict[str, Any]], plan: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for mode, marker in (("colocated", "s"), ("disaggregated", "o")):
        rs = [r for r in results if r["candidate"]["mode"] == mode]
        ax.scatter([r["slo_attainment"] for r in rs], [r["goodput_per_gpu"] for r in rs], marker=marker,
                   alpha=0.5, label=mode)
    front = plan["front"]
    ax.plot([r["slo_attainment"] for r in front], [r["goodput_per_gpu"] for r in front], "k--", label="front")
    ax.scatter([plan["best"]["slo_attainment"]], [plan["best"]["goodput_per_gpu"]], s=160, facecolors="none",
               edgecolors="red", label="best")
    ax.set_xlabel("SLO attainment")
    ax.set_ylabel("goodput (req/s per GPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
