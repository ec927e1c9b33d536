"""What the benchmark scripts (serving_compare.py) run a workload with: `loadgen.runner` sends
it, and `summarize` gives one flat dict (TTFT / ITL / end-to-end percentiles, throughput,
transfer time, prefix hit rate) whose keys their JSON lines keep. For a person at a terminal
the command is `splitserve bench` (progress, table, goodput against SLOs, plots).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from loadgen.report import pct
from loadgen.runner import Outcome, run
from loadgen.workload import WorkloadRequest, synthetic

__all__ = ["WorkloadRequest", "run_load", "summarize", "synthetic"]


async def run_load(target: str, items: list[WorkloadRequest], rate: float | None, concurrency: int | None,
                   seed: int = 0, timeout_s: float = 300.0, per_request: Path | None = None) -> dict[str, object]:
    """Runs the workload (`loadgen.runner`); `per_request`: also write one JSON line per request there (in send
    order)."""
    result = await run(target, items, rate, concurrency, seed, timeout_s)
    if per_request is not None:
        with per_request.open("w") as f:
            for o in sorted(result.outcomes, key=lambda o: o.sent_s):
                f.write(json.dumps({"sent_s": round(o.sent_s, 3), "code": o.code, "route": o.route,
                                    "prompt": o.num_prompt, "cached": o.num_cached, "out": o.num_out,
                                    "ttft_ms": round((o.ttft_s or 0.0) * 1e3, 1), "e2e_ms": round(o.e2e_s * 1e3, 1),
                                    "itl_max_ms": round(max(o.itls_s, default=0.0) * 1e3, 1)}) + "\n")
    return summarize(result.outcomes, result.elapsed_s)


def summarize(outcomes: list[Outcome], elapsed_s: float) -> dict[str, object]:
    ok = [o for o in outcomes if o.ok]
    ms = lambda xs, q: round((pct(xs, q) or 0.0) * 1e3, 2)  # noqa: E731
    ttft, e2e = [o.ttft_s or 0.0 for o in ok], [o.e2e_s for o in ok]
    itl = [x for o in ok for x in o.itls_s]
    prompt = sum(o.num_prompt for o in ok)
    return {
        "num_requests": len(outcomes), "num_ok": len(ok),
        "errors": dict(Counter(o.code for o in outcomes if not o.ok)),
        "elapsed_s": round(elapsed_s, 3),
        **{f"ttft_p{q}_ms": ms(ttft, q) for q in (50, 95, 99)},
        **{f"itl_p{q}_ms": ms(itl, q) for q in (50, 95, 99)},
        "itl_max_ms": round(max(itl, default=float("nan")) * 1e3, 2),
        **{f"e2e_p{q}_ms": ms(e2e, q) for q in (50, 95, 99)},
        "transfer_p50_ms": ms([o.transfer_s for o in ok if o.transfer_s > 0], 50),  # remote prefills only
        "output_tokens_per_s": round(sum(o.num_out for o in ok) / elapsed_s, 2),
        "requests_per_s": round(len(ok) / elapsed_s, 3),
        "prefix_hit_rate": round(sum(o.num_cached for o in ok) / prompt, 4) if prompt else 0.0,
    }
