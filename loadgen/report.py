"""A run's summary: latency percentiles, throughput, prefix hit rate, goodput and SLO attainment.

Goodput is DistServe's: requests per second that met both SLOs, TTFT within `ttft_slo` and
TPOT (the request's mean time per output token after the first) within `itl_slo`. Failed
requests meet neither; attainment is the share of all sent requests that met both. The table
prints exactly the summary's numbers (the JSON line's), rounded the same way.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from loadgen.runner import Outcome, Run

QUANTILES = (50, 90, 99)

CUT = "CUT"
"""The code of a request still streaming when a run's `duration_s` ended (neither met nor failed)."""


def pct(values: list[float], q: int) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def _ms(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (x := pct(values, q)) is None else round(x * 1e3, 1) for q in QUANTILES}


def met_slos(o: Outcome, ttft_slo_s: float, itl_slo_s: float) -> bool:
    tpot = o.tpot_s
    return o.ok and o.ttft_s is not None and o.ttft_s <= ttft_slo_s and (tpot is None or tpot <= itl_slo_s)


def attainment(good: int, num_requests: int) -> float:
    """The share of the requests that met both SLOs, as the summary reports it."""
    return round(good / num_requests, 4) if num_requests else 0.0


class SloVerdict:
    """Whether `num_requests` will reach `target` attainment, known as soon as the outcomes
    seen so far settle it: met once enough met both SLOs, missed once too many cannot. The
    verdict is the one `summarize` would give the whole run (`attainment(...) >= target`).
    A request is counted when it ends, or when its first token comes past the TTFT SLO."""

    def __init__(self, num_requests: int, target: float, ttft_slo_s: float, itl_slo_s: float) -> None:
        self.ttft_slo_s, self.itl_slo_s = ttft_slo_s, itl_slo_s
        self.need = next((k for k in range(max(0, math.floor(target * num_requests) - 1), num_requests + 1)
                          if attainment(k, num_requests) >= target), num_requests + 1)
        """The fewest requests meeting both SLOs that reach the target."""
        self.may_miss = num_requests - self.need
        self.num_met = self.num_missed = 0
        self._missed: set[int] = set()

    @property
    def decided(self) -> bool | None:
        """True: the target is reached whatever the rest do; False: it cannot be; None: not yet."""
        if self.num_met >= self.need:
            return True
        return False if self.num_missed > self.may_miss else None

    def first_token(self, o: Outcome) -> None:
        if o.ttft_s is not None and o.ttft_s > self.ttft_slo_s and id(o) not in self._missed:
            self._missed.add(id(o))
            self.num_missed += 1

    def ended(self, o: Outcome) -> None:
        if id(o) in self._missed:
            return
        if met_slos(o, self.ttft_slo_s, self.itl_slo_s):
            self.num_met += 1
        else:
            self._missed.add(id(o))
            self.num_missed += 1


def summarize(run: Run, ttft_slo_s: float, itl_slo_s: float) -> dict[str, Any]:
    """The run's figures over the requests that ended; those a `duration_s` cut while they
    streamed (`CUT`) are counted apart (`num_cut`), neither met nor failed."""
    ended = [o for o in run.outcomes if o.code != CUT]
    ok = [o for o in ended if o.ok]
    elapsed = max(run.elapsed_s, 1e-9)
    errors: dict[str, int] = {}
    for o in ended:
        if not o.ok:
            errors[o.code] = errors.get(o.code, 0) + 1
    good = sum(met_slos(o, ttft_slo_s, itl_slo_s) for o in ended)
    prompt = sum(o.num_prompt for o in ok)
    return {
        "num_requests": len(ended), "num_ok": len(ok), "num_failed": len(ended) - len(ok),
        "num_cut": len(run.outcomes) - len(ended), "errors": errors, "elapsed_s": round(run.elapsed_s, 3),
        "ttft_ms": _ms([o.ttft_s for o in ok if o.ttft_s is not None]),
        "itl_ms": _ms([x for o in ok for x in o.itls_s]),
        "e2e_ms": _ms([o.e2e_s for o in ok]),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(sum(o.num_out for o in ok) / elapsed, 1),
        "prompt_tokens_per_s": round(prompt / elapsed, 1),
        "prefix_hit_rate": round(sum(o.num_cached for o in ok) / prompt, 4) if prompt else 0.0,
        "goodput_rps": round(good / elapsed, 3),
        "slo_attainment": attainment(good, len(ended)),
        "ttft_slo_ms": round(ttft_slo_s * 1e3, 1), "itl_slo_ms": round(itl_slo_s * 1e3, 1),
    }


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(summary: dict[str, Any], title: str = "splitserve bench") -> Table:
    t = Table(title=title)
    t.add_column("latency (ms)")
    for q in QUANTILES:
        t.add_column(f"p{q}", justify="right")
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("end to end", "e2e_ms")):
        t.add_row(name, *(_cell(summary[key][f"p{q}"]) for q in QUANTILES))
    return t


def totals(summary: dict[str, Any]) -> Table:
    t = Table(show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    s = summary
    cut = s.get("num_cut", 0)  # (a run saved before --duration-s has none)
    rows = [("requests", f"{s['num_ok']} ok / {s['num_requests'] + cut} sent"),
            ("throughput", f"{s['requests_per_s']} req/s, {s['output_tokens_per_s']} output tok/s"),
            ("prefix hit rate", f"{s['prefix_hit_rate']:.1%}"),
            ("goodput", f"{s['goodput_rps']} req/s (TTFT <= {s['ttft_slo_ms']} ms, TPOT <= {s['itl_slo_ms']} ms)"),
            ("SLO attainment", f"{s['slo_attainment']:.1%}")]
    rows += [(f"failed: {code}", str(n)) for code, n in sorted(s["errors"].items())]
    rows += [("cut by --duration-s", str(cut))] if cut else []
    for r in rows:
        t.add_row(*r)
    return t


def show(summary: dict[str, Any], console: Console) -> None:
    console.print(table(summary))
    console.print(totals(summary))
