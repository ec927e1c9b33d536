"""`splitserve bench` and `splitserve bench compare` (the parsers and what they run).

  splitserve bench [--target H:P] [--rate R | --concurrency C | --trace FILE] [workload flags]
                   [--ttft-slo-ms 2000] [--itl-slo-ms 100] [--output RUN.json] [--plots DIR]
  splitserve bench compare A.json B.json [--plots DIR]

While it runs, a progress bar (sent / done / failed, live TTFT p50) on stderr; at the end a
table on stdout and, as the last stdout line, the summary as one JSON line with the config.
A run in which every request failed says so and exits 1.

Every `splitserve` command builds this parser: what the two commands run (the client, rich,
the plots) is imported when one runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadgen.runner import Run
    from loadgen.workload import WorkloadRequest

PROGRESS_EVERY_S = 0.2
"""How often the progress bar is redrawn (each redraw reads every outcome so far)."""


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="load a running cluster: progress, latency table, goodput, JSON, plots")
    b.add_argument("--target", default="127.0.0.1:50051",
                   help="the router's gRPC HOST:PORT, or http://HOST:PORT for its OpenAI HTTP API")
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--rate", type=float, help="Poisson arrivals, requests/s")
    b.add_argument("--concurrency", type=int, help="closed loop with this many clients (default 8 without --rate)")
    b.add_argument("--prompt-len", type=int, default=128, help="mean prompt tokens (uniform +-50%%)")
    b.add_argument("--output-len", type=int, default=32, help="mean output tokens (uniform +-50%%)")
    b.add_argument("--shared-prefix-fraction", type=float, default=0.0, help="requests that start with a shared prefix")
    b.add_argument("--num-prefixes", type=int, default=4)
    b.add_argument("--prefix-len", type=int, default=96)
    b.add_argument("--trace", type=Path, help="Mooncake-format JSONL to replay, at its own arrival times")
    b.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per 512-token trace block: the "
                   "length scale (prompt and output lengths scale by it over 512)")
    b.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies the trace's arrival times")
    b.add_argument("--max-prompt-tokens", type=int, default=1024)
    b.add_argument("--vocab", type=int, default=512, help="token ids are drawn from [3, vocab)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    b.add_argument("--itl-slo-ms", type=float, default=100.0, help="SLO on each request's mean time per output token")
    b.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    b.add_argument("--duration-s", type=float, default=None,
                   help="end the run then: nothing is sent after it, requests still streaming are cut (counted "
                        "apart, num_cut) and what ended is reported")
    b.add_argument("--output", type=Path, help="save the summary and every request's record (for `bench compare`)")
    b.add_argument("--plots", type=Path, metavar="DIR", help="write ttft_cdf.png, itl_cdf.png, timeline.png here")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)
    c = b.add_subparsers(dest="bench_command").add_parser("compare", help="two saved runs side by side")
    c.add_argument("runs", type=Path, nargs=2, metavar="RUN.json")
    c.add_argument("--plots", type=Path, metavar="DIR", help="both runs on each chart")
    c.set_defaults(func=_compare)


def _items(args: argparse.Namespace) -> list[WorkloadRequest]:
    from loadgen.workload import from_trace, synthetic

    if args.trace:
        return from_trace(args.trace, args.num_requests, args.trace_block_tokens, args.max_prompt_tokens,
                          args.vocab, args.trace_time_scale)
    return synthetic(args.num_requests, args.prompt_len, args.output_len, args.shared_prefix_fraction,
                     args.num_prefixes, args.prefix_len, args.vocab, args.seed)


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from loadgen import plots, report
    from loadgen.runner import run

    if args.rate is None and args.concurrency is None and args.trace is None:
        args.concurrency = 8
    items = _items(args)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=args.no_progress) as bar:
        task = bar.add_task("starting", total=len(items))

        shown = [0.0]

        def show(r: Run, force: bool = False) -> None:
            """At most every PROGRESS_EVERY_S: the counts and the TTFT p50 walk every outcome so far."""
            if not force and time.monotonic() - shown[0] < PROGRESS_EVERY_S:
                return
            shown[0] = time.monotonic()
            ended = [o for o in r.outcomes if o.end_s]
            failed = sum(not o.ok for o in ended)
            ttft = report.pct([o.ttft_s for o in ended if o.ok and o.ttft_s is not None], 50)
            live = "-" if ttft is None else f"{ttft * 1e3:.0f} ms"
            bar.update(task, completed=len(ended), description=f"sent {len(r.outcomes)}  done {len(ended) - failed}  "
                                                               f"failed {failed}  TTFT p50 {live}")
        result = asyncio.run(run(args.target, items, args.rate, args.concurrency, args.seed, args.timeout_s,
                                 None if args.no_progress else show, args.duration_s))
        if not args.no_progress:
            show(result, force=True)
    summary = report.summarize(result, args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    report.show(summary, Console())
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    line = {"bench": "splitserve", "config": config, "results": summary}
    if args.output:
        args.output.write_text(json.dumps({**line, "requests": plots.records(result)}) + "\n")
    if args.plots:
        plots.plot({"run": plots.records(result)}, args.plots)
    print(json.dumps(line), flush=True)
    if summary["num_requests"] and summary["num_ok"] == 0:
        first = next(o for o in result.outcomes if not o.ok and o.code != report.CUT)
        print(f"all {summary['num_requests']} requests failed: {summary['errors']} "
              f"(first: {first.details[:200]})", file=sys.stderr)
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loadgen import plots, report

    saved = {}
    for path in args.runs:
        try:
            saved[path.stem if path.stem not in saved else str(path)] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"error: {path} is not a run saved by `splitserve bench --output`: {e}", file=sys.stderr)
            return 2
    console = Console()
    for label, run_ in saved.items():
        console.print(report.table(run_["results"], title=label))
    (a_label, a), (b_label, b) = [(k, v["results"]) for k, v in saved.items()]
    ratios = {key: round(b[key] / a[key], 3) if a[key] else None
              for key in ("requests_per_s", "output_tokens_per_s", "goodput_rps", "slo_attainment")}
    ratios |= {f"{key}_p{q}": round(b[key][f"p{q}"] / a[key][f"p{q}"], 3) if a[key][f"p{q}"] and b[key][f"p{q}"]
               else None for key in ("ttft_ms", "itl_ms", "e2e_ms") for q in report.QUANTILES}
    if args.plots:
        plots.plot({label: v.get("requests", []) for label, v in saved.items()}, args.plots)
    print(json.dumps({"bench": "compare", "a": a_label, "b": b_label, "b_over_a": ratios}), flush=True)
    return 0
