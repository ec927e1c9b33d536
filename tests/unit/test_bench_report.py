"""`loadgen.report`: nearest-rank percentiles and DistServe goodput on hand-made outcomes."""
from __future__ import annotations

from loadgen.report import CUT, pct, summarize
from loadgen.runner import Outcome, Run


def test_nearest_rank_percentiles() -> None:
    values = [float(x) for x in range(1, 11)]
    assert (pct(values, 50), pct(values, 90), pct(values, 99)) == (5.0, 9.0, 10.0)
    assert pct([], 50) is None and pct([3.0], 99) == 3.0


def test_goodput_counts_requests_that_met_both_slos_and_failures_meet_none() -> None:
    run = Run([
        Outcome(sent_s=0.0, end_s=1.0, ttft_s=0.5, itls_s=[0.05, 0.05], num_prompt=10, num_cached=5, num_out=3),
        Outcome(sent_s=0.0, end_s=2.0, ttft_s=1.5, itls_s=[0.05], num_prompt=10, num_out=2),  # TTFT over
        Outcome(sent_s=0.0, end_s=1.0, ttft_s=0.2, itls_s=[0.3, 0.01], num_prompt=10, num_out=3),  # TPOT 155 ms
        Outcome(sent_s=0.0, end_s=0.3, ttft_s=0.3, num_prompt=10, num_out=1),  # one token: no TPOT to miss
        Outcome(code="RESOURCE_EXHAUSTED", sent_s=0.0, end_s=0.01),
    ], elapsed_s=2.0)
    s = summarize(run, ttft_slo_s=1.0, itl_slo_s=0.1)
    assert (s["num_requests"], s["num_ok"], s["num_failed"], s["errors"]) == (5, 4, 1, {"RESOURCE_EXHAUSTED": 1})
    assert s["goodput_rps"] == 1.0 and s["slo_attainment"] == 0.4  # 2 of 5 in 2 s
    assert s["requests_per_s"] == 2.0 and s["output_tokens_per_s"] == 4.5
    assert s["prefix_hit_rate"] == 0.125
    assert s["ttft_ms"] == {"p50": 300.0, "p90": 1500.0, "p99": 1500.0}
    assert s["itl_ms"]["p50"] == 50.0


def test_requests_cut_by_the_runs_duration_are_counted_apart_neither_met_nor_failed() -> None:
    run = Run([
        Outcome(sent_s=0.0, end_s=1.0, ttft_s=0.5, itls_s=[0.05], num_prompt=10, num_out=2),
        Outcome(code="UNAVAILABLE", sent_s=0.5, end_s=0.6),
        Outcome(code=CUT, sent_s=1.5, end_s=2.0, ttft_s=0.2, itls_s=[0.01], num_prompt=10, num_out=1),
        Outcome(code=CUT, sent_s=1.9, end_s=2.0),
    ], elapsed_s=2.0)
    s = summarize(run, ttft_slo_s=1.0, itl_slo_s=0.1)
    assert (s["num_requests"], s["num_ok"], s["num_failed"], s["num_cut"]) == (2, 1, 1, 2)
    assert s["errors"] == {"UNAVAILABLE": 1} and s["slo_attainment"] == 0.5  # 1 of the 2 that ended
    assert s["ttft_ms"]["p50"] == 500.0 and s["output_tokens_per_s"] == 1.0  # the cut one's tokens not counted
    assert "cut by --duration-s" in [row[0] for row in totals_rows(s)]


def totals_rows(summary: dict) -> list[tuple[str, ...]]:
    from loadgen.report import totals

    t = totals(summary)
    return list(zip(*(col._cells for col in t.columns)))


def test_every_tool_reports_the_same_percentile() -> None:
    """loadgen/report.py's nearest rank is the one percentile: the load generator, the overload
    and chat benchmarks use it, so their p99s compare with `splitserve bench`'s."""
    import benchmarks.serving.load_gen
    import benchmarks.hostile.overload
    from loadgen.report import pct

    assert benchmarks.serving.load_gen.pct is pct and benchmarks.hostile.overload.pct is pct
    assert pct([0.1, 0.2, 0.3, 0.4], 50) == 0.2 and pct([0.1, 0.2, 0.3, 0.4], 99) == 0.4
    pct_ms = benchmarks.hostile.overload.pct_ms
    assert pct_ms([0.1, 0.2, 0.3, 0.4], 50) == 200.0 and pct_ms([], 99) is None
