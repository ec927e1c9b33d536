"""`splitserve simulate`: a fleet on a virtual clock (sim/fleet.py), summarised as `splitserve
bench` summarises a real run.

  splitserve simulate --trace FILE                  # disaggregated and colocated, 8 H100s, Llama-3-8B
  splitserve simulate --rate 4 --arrival sinusoid --num-requests 5000 --autoscale
  splitserve simulate --trace FILE --num-gpus 16 --prefill 10 --decode 6 --policy round_robin

Each configuration prints bench's table and, as its own stdout line, one JSON object:
{"bench": "simulate", "config": {...}, "results": {bench's summary keys, gpu_seconds,
num_scale_actions, ...}}. Without --prefill/--decode, the disaggregated split of --num-gpus
follows the workload: prefill workers in proportion to the prefill share of the GPU time the
cost model prices for it (the decode share at a batch of 32), at least one of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from loadgen import plots, report
from loadgen.workload import WorkloadRequest, synthetic
from control.autoscaler import AutoscaleConfig
from engine.config import SchedulerConfig
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from sim.arrivals import SHAPES, Shape, arrival_times, timed, trace_items
from sim.cost_model import GPUS, MODELS, Roofline
from sim.fleet_types import FleetConfig, FleetResult

DECODE_BATCH = 32
"""The decode batch the default split assumes (a decode worker's GPU time per token is its step over this)."""


def add_parser(sub: Any) -> None:
    s = sub.add_parser("simulate", help="a fleet on a virtual clock: splitserve's own router, scheduler, "
                       "block pool and autoscaler, the GPU priced by a cost model")
    add_workload_flags(s)
    f = add_hardware_flags(s)
    f.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per worker")
    f.add_argument("--prefill-tp", type=int, help="a prefill worker's degree where it differs from --tp "
                                                  "(disaggregated; needs --prefill and --decode)")
    f.add_argument("--num-gpus", type=int, default=8)
    f.add_argument("--mode", choices=("both", "disaggregated", "colocated"), default="both")
    f.add_argument("--prefill", type=int, help="prefill workers (disaggregated); default: from the workload")
    f.add_argument("--decode", type=int, help="decode workers (disaggregated)")
    f.add_argument("--policy", choices=("cache_aware", "round_robin"), default=RoutingConfig.policy)
    f.add_argument("--max-model-len", type=int, default=FleetConfig.max_model_len)
    f.add_argument("--max-num-batched-tokens", type=int, default=2048)
    f.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    f.add_argument("--admission-charge", choices=("expected", "max"), default=AdmissionConfig.charge_output,
                   help="what the router's admission charges for a request's output (serve's flag)")
    f.add_argument("--autoscale", action="store_true", help="pools from 1 worker each, up to --num-gpus in all")
    f.add_argument("--predictive", action="store_true",
                   help="--autoscale: also launch workers for the load forecast --startup-s ahead (serve's "
                        "--predictive-scaling)")
    f.add_argument("--startup-s", type=float, default=FleetConfig.startup_s,
                   help="a scaled-up worker serves this long after launch")
    f.add_argument("--kv-store-gib", type=float, default=0.0,
                   help="each node's shared KV store in host memory (the tier: a prefix its workers' pools evicted "
                        "is fetched over PCIe instead of computed); 0: none")
    f.add_argument("--kv-store-disk-gib", type=float, default=0.0,
                   help="each node store's spill on an SSD: what its memory evicts, read back at NVMe speed "
                        "before a fetch (with --kv-store-gib)")
    o = s.add_argument_group("output")
    o.add_argument("--ttft-slo-ms", type=float, default=AutoscaleConfig.ttft_slo_ms)
    o.add_argument("--itl-slo-ms", type=float, default=AutoscaleConfig.itl_slo_ms)
    o.add_argument("--plots", type=Path, metavar="DIR", help="bench's PNGs, one line per configuration")
    o.add_argument("--seed", type=int, default=FleetConfig.seed)
    s.set_defaults(func=_simulate)


def add_workload_flags(s: argparse.ArgumentParser) -> None:
    """The workload's flags (simulate and plan): a trace, or bench's synthetic one."""
    w = s.add_argument_group("workload")
    w.add_argument("--trace", type=Path, help="Mooncake-format JSONL, replayed at its own times")
    w.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies the trace's arrival times")
    w.add_argument("--trace-block-tokens", type=int, default=512,
                   help="tokens per trace hash block (512: the trace's own lengths)")
    w.add_argument("--num-requests", type=int, help="default: the trace's length, or 1000")
    w.add_argument("--rate", type=float, default=4.0, help="requests/s without --trace")
    w.add_argument("--arrival", choices=SHAPES, default="poisson")
    w.add_argument("--rate-to", type=float, help="ramp: the rate at the end")
    w.add_argument("--amplitude", type=float, default=0.5,
                   help="sinusoid: relative swing; burst: share of a period's requests")
    w.add_argument("--period-s", type=float, default=600.0, help="sinusoid and burst period")
    w.add_argument("--prompt-len", type=int, default=2048)
    w.add_argument("--output-len", type=int, default=256)
    w.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    w.add_argument("--num-prefixes", type=int, default=4)
    w.add_argument("--prefix-len", type=int, default=1024)


def add_hardware_flags(s: argparse.ArgumentParser) -> Any:
    """The model and GPU flags (simulate and plan); returns their group, "fleet"."""
    f = s.add_argument_group("fleet")
    f.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    f.add_argument("--gpu", choices=sorted(GPUS), default="h100-sxm")
    f.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: the projections' weights at one byte, on FP8 tensor cores (serve's flag)")
    f.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fp8: KV at one byte per element: twice the tokens per GPU, half the bytes moved")
    return f


def workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace:
        n = args.num_requests or sum(1 for _ in args.trace.open())
        return trace_items(args.trace, n, args.trace_block_tokens, args.max_model_len - 1, 128256,
                           args.trace_time_scale)
    n = args.num_requests or 1000
    items = synthetic(n, args.prompt_len, args.output_len, args.shared_prefix_fraction, args.num_prefixes,
                      args.prefix_len, 128256, args.seed)
    shape = Shape(args.arrival, args.rate, args.rate_to, args.amplitude, args.period_s)
    return timed(items, arrival_times(n, shape, args.seed))


def default_split(hw: Roofline, items: list[WorkloadRequest], num_workers: int, chunk: int) -> tuple[int, int]:
    """Prefill workers in proportion to the prefill share of the workload's GPU time."""
    prefill_s = sum(sum(hw.step_s([(min(chunk, len(i.prompt) - s), s)]) for s in range(0, len(i.prompt), chunk))
                    for i in items[:500])
    mean_ctx = sum(len(i.prompt) + i.max_tokens / 2 for i in items[:500]) / max(min(len(items), 500), 1)
    per_token = hw.step_s([(1, int(mean_ctx))] * DECODE_BATCH) / DECODE_BATCH
    decode_s = sum(i.max_tokens for i in items[:500]) * per_token
    p = round(num_workers * prefill_s / (prefill_s + decode_s))
    return min(max(p, 1), num_workers - 1), num_workers - min(max(p, 1), num_workers - 1)


def configs(args: argparse.Namespace, hw: Roofline, items: list[WorkloadRequest]) -> list[tuple[str, FleetConfig]]:
    def store_blocks(gib: float) -> int:
        return int(gib * 2**30 // (FleetConfig.block_size * hw.model.kv_bytes_per_token))

    workers = args.num_gpus // args.tp
    if workers < 1 or (args.mode != "colocated" and workers < 2):
        raise SystemExit(f"--num-gpus {args.num_gpus} at --tp {args.tp} is too few workers for --mode {args.mode}")
    base = FleetConfig(num_blocks=hw.kv_capacity_tokens() // 16, max_model_len=args.max_model_len,
                       gpus_per_worker=args.tp, startup_s=args.startup_s, seed=args.seed,
                       kv_store_blocks=store_blocks(args.kv_store_gib),
                       kv_store_disk_blocks=store_blocks(args.kv_store_disk_gib),
                       admission=AdmissionConfig(charge_output=args.admission_charge),
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                 max_num_seqs=args.max_num_seqs))
    out = []
    if args.prefill_tp and args.prefill_tp != args.tp:
        if not (args.prefill and args.decode):
            raise SystemExit("--prefill-tp needs --prefill and --decode (the pools' sizes at their degrees)")
        p_hw = Roofline(hw.model, hw.gpu, args.prefill_tp)
        if args.prefill * args.prefill_tp + args.decode * args.tp > args.num_gpus:
            raise SystemExit(f"{args.prefill} prefill x TP {args.prefill_tp} + {args.decode} decode x TP {args.tp} "
                             f"is more than --num-gpus {args.num_gpus}")
        cfg = dataclasses.replace(base, num_prefill=args.prefill, num_decode=args.decode,
                                  prefill_gpus_per_worker=args.prefill_tp,
                                  prefill_num_blocks=p_hw.kv_capacity_tokens() // 16,
                                  routing=RoutingConfig(mode="disaggregated", policy=args.policy))
        return [(f"disaggregated {args.prefill}P(TP{args.prefill_tp}):{args.decode}D(TP{args.tp})", cfg)]
    if args.mode in ("both", "disaggregated"):
        p, d = (args.prefill, args.decode) if args.prefill and args.decode else \
            default_split(hw, items, workers, args.max_num_batched_tokens)
        cfg = dataclasses.replace(base, num_prefill=p, num_decode=d,
                                  routing=RoutingConfig(mode="disaggregated", policy=args.policy))
        if args.autoscale:
            cfg = dataclasses.replace(cfg, num_prefill=1, num_decode=1, autoscale=AutoscaleConfig(
                prefill_min=1, prefill_max=workers - 1, decode_min=1, decode_max=workers - 1,
                ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, predictive=args.predictive,
                startup_s=args.startup_s))
        out.append((f"disaggregated {cfg.num_prefill}P:{cfg.num_decode}D", cfg))
    if args.mode in ("both", "colocated"):
        cfg = dataclasses.replace(base, num_prefill=0, num_decode=workers,
                                  routing=RoutingConfig(mode="colocated", policy=args.policy))
        if args.autoscale:
            cfg = dataclasses.replace(cfg, num_decode=1, autoscale=AutoscaleConfig(
                prefill_min=0, prefill_max=0, decode_min=1, decode_max=workers,
                ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, predictive=args.predictive,
                startup_s=args.startup_s))
        out.append((f"colocated {cfg.num_decode}", cfg))
    return out


def summary(result: FleetResult, ttft_slo_s: float, itl_slo_s: float) -> dict[str, Any]:
    s = report.summarize(result.run, ttft_slo_s, itl_slo_s)
    return {**s, "gpu_seconds": round(result.gpu_seconds, 1),
            "goodput_per_gpu_hour": round(s["goodput_rps"] * s["elapsed_s"] / max(result.gpu_seconds, 1e-9) * 3600, 1),
            "num_scale_actions": len(result.actions), **{k: v for k, v in result.stats.items()}}


def config_dict(cfg: FleetConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from sim.fleet import Fleet  # here: every `splitserve` command builds the parser above

    model = MODELS[args.model].in_fp8(args.quantization == "fp8", args.kv_cache_dtype == "fp8")
    hw = Roofline(model, GPUS[args.gpu], args.tp)
    items = workload(args)
    console = Console(stderr=True)
    runs = {}
    for label, cfg in configs(args, hw, items):
        p_hw = Roofline(hw.model, hw.gpu, cfg.prefill_gpus_per_worker) if cfg.prefill_gpus_per_worker else None
        result = Fleet(cfg, hw, items, p_hw).run()
        s = summary(result, args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
        console.print(report.table(s, title=f"splitserve simulate: {label}"))
        console.print(report.totals(s))
        run_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
        print(json.dumps({"bench": "simulate", "label": label, "config": {"args": run_args, "fleet": config_dict(cfg)},
                          "results": s}), flush=True)
        runs[label] = plots.records(result.run)
    if args.plots:
        plots.plot(runs, args.plots)
    return 0
