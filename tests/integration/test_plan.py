"""`splitserve plan` end to end: the pruned search finds the configuration the exhaustive
search over the same grid finds (the simulator, on a small synthetic trace), and a plan file
written by the command starts a cluster of its pools (`serve --plan`, the tiny model on CPU)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.workload import synthetic
from sim.arrivals import Shape, arrival_times, timed
from sim.cost_model import LLAMA3_8B
from sim.plan import Job, Space, best, candidates, prefill_share, sliced, staged
from tests.integration.test_cli import STARTUP_BUDGET_S, _wait_for_line

CLI = [sys.executable, "-m", "cluster.cli"]

pytestmark = pytest.mark.timeout(300)


def test_the_pruned_search_finds_what_the_exhaustive_one_finds() -> None:
    items = timed(synthetic(80, 3000, 200, 0.3, 4, 1024, 128256, seed=3), arrival_times(80, Shape(rate=12.0), seed=3))
    share = prefill_share(LLAMA3_8B, "h100-sxm", items, 8192)
    space = Space(6, tps=(1,), budgets=(8192,))

    def found(spread: float | None, keep: int) -> tuple[dict, list[dict]]:
        grid = candidates(space, LLAMA3_8B, "h100-sxm", 8192, share, spread)
        # a rate tried over 2 s of arrivals at least (the trace spans 6.6 s): a short test's floor
        jobs = [Job(c, "llama-3-8b", (False, False), "h100-sxm", 8192, 1.0, 0.05, 0, min_span_s=2.0) for c in grid]
        results, capacities = staged(jobs, items, screen=len(items), keep=min(keep, len(jobs)), workers=2)
        return best(results), capacities

    # pruned: the splits near the work's share, one finalist (and the best colocated), the
    # bisection skipped where a bracket tops out below it; exhaustive: every split, every
    # candidate bisected and served whole
    (pruned, few), (exhaustive, every) = found(2.0, 1), found(None, 99)
    assert (len(few), len(every)) == (5, 6) and pruned["label"] == exhaustive["label"], (pruned, exhaustive)
    assert pruned["slo_attainment"] >= 0.9 and not any(r["capacity_capped"] for r in every)
    assert len({r["goodput_per_gpu"] for r in every}) > 2  # the candidates' goodputs differ: a real ranking
    assert all(r["capacity_refined"] for r in every)
    fine = {r["label"]: r["goodput_per_gpu"] for r in every}
    for r in few:  # a bisected candidate's goodput is the exhaustive one's; a skipped one's is below it
        assert r["goodput_per_gpu"] == fine[r["label"]] if r["capacity_refined"] else \
            r["goodput_per_gpu"] <= fine[r["label"]] < r["goodput_per_gpu_below"]
    assert not all(r["capacity_refined"] for r in few)  # the pruning skipped some


def test_a_fleet_of_units_plans_as_one_unit_on_its_share_of_the_trace() -> None:
    items = timed(synthetic(120, 3000, 100, 0.5, 8, 1024, 128256, seed=5), arrival_times(120, Shape(rate=16.0), seed=5))
    share = prefill_share(LLAMA3_8B, "h100-sxm", items, 8192)

    def plan(num_gpus: int, unit: int, requests: list) -> list[dict]:
        space = Space(num_gpus, tps=(1,), budgets=(8192,), modes=("colocated",), unit_gpus=unit)
        jobs = [Job(c, "llama-3-8b", (False, False), "h100-sxm", 8192, 1.0, 0.05, 0, min_span_s=2.0,
                    replicas=space.replicas) for c in candidates(space, LLAMA3_8B, "h100-sxm", 8192, share)]
        return staged(jobs, requests, screen=len(requests), keep=9, workers=1)[0]

    [fleet], [unit] = plan(8, 4, items), plan(4, 4, sliced(items, 2))
    assert fleet["label"] == "colocated 8x TP1, budget 8192" and unit["label"] == "colocated 4x TP1, budget 8192"
    assert 0 < len(sliced(items, 2)) < len(items)
    for key in ("goodput_per_gpu", "capacity_multiple", "slo_attainment", "ttft_p99_ms"):  # the same runs
        assert fleet[key] == unit[key], key
    assert fleet["capacity_rps"] == pytest.approx(2 * unit["capacity_rps"], rel=1e-3)


def test_a_plan_file_starts_a_cluster_of_its_pools(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    out = subprocess.run(CLI + ["plan", "--rate", "8", "--num-requests", "60", "--prompt-len", "2000",
                                "--output-len", "100", "--num-gpus", "2", "--tp", "1", "--budgets", "2048",
                                "--max-model-len", "8192", "--screen-requests", "60", "--spec-acceptance", "0.8",
                                "--out", str(plan)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["label"] for r in lines if r.get("stage") == "capacity"} == {
        "colocated 2x TP1, budget 2048", "disaggregated 1P(TP1):1D(TP1), budget 2048",
        "colocated 2x TP1, budget 2048, speculative", "disaggregated 1P(TP1):1D(TP1), budget 2048, speculative"}
    written = json.loads(plan.read_text())
    chosen = written["best"]["candidate"]
    scaled = written["autoscale"]  # the best autoscaled over the trace, both ways, and the verdict
    assert scaled["reactive"]["label"] == scaled["predictive"]["label"] == written["best"]["label"]
    assert not scaled["reactive"]["predictive"] and scaled["predictive"]["predictive"]
    assert 0 < scaled["reactive"]["gpu_seconds"] and isinstance(scaled["predictive_ahead"], bool)
    assert lines[-1]["plan"]["best"] == written["best"] and "best:" in out.stderr
    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path / "cache")}
    serve = subprocess.Popen(CLI + ["serve", "--plan", str(plan), "--model", "tiny", "--port", "0", "--http-port",
                                    "0"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ready = _wait_for_line(serve, "ready in", STARTUP_BUDGET_S)
        assert f"{chosen['prefill']} prefill, {chosen['decode']} decode on cpu" in ready, ready
        assert f"mode {chosen['mode']}" in ready, ready
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
