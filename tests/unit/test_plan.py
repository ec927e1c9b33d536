"""`splitserve plan` (sim/plan.py): the pruned grid, the front and the best, a plan file
round-tripping into serve's pools, the capacity bisection (the search itself, on the
simulator: tests/integration/test_plan.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from sim.cost_model import LLAMA3_70B, LLAMA3_8B
from loadgen.workload import WorkloadRequest
from sim.plan import (Candidate, Space, ahead, at_rate, best, candidates, capacity, fits, fleet_config, pareto,
                      plan_file, read_plan, repeated, sliced, unit_gpus)


def test_the_grid_holds_every_degree_that_fits_and_the_splits_near_the_work_s_share() -> None:
    grid = candidates(Space(8, tps=(1,), budgets=(2048,)), LLAMA3_8B, "h100-sxm", 8192, share=0.5)
    assert [c for c in grid if c.mode == "colocated"] == [Candidate("colocated", 0, 8, 1, 1, 2048)]
    assert [(c.prefill, c.decode) for c in grid if c.mode == "disaggregated"] == [(2, 6), (3, 5), (4, 4), (5, 3),
                                                                                  (6, 2), (7, 1)]
    few = candidates(Space(8, tps=(1,), budgets=(2048,)), LLAMA3_8B, "h100-sxm", 8192, share=0.05)
    assert [(c.prefill, c.decode) for c in few if c.mode == "disaggregated"] == [(1, 7), (2, 6), (3, 5)]
    every = candidates(Space(8, tps=(1,), budgets=(2048,)), LLAMA3_8B, "h100-sxm", 8192, share=0.05, spread=None)
    assert len([c for c in every if c.mode == "disaggregated"]) == 7
    # a 70B fits on no single H100 and not on two at a 128k context; TP 2 prefill with TP 4 decode on 8
    assert not fits(LLAMA3_70B, "h100-sxm", 1, 8192) and fits(LLAMA3_70B, "h100-sxm", 4, 131072)
    big = candidates(Space(8, tps=(1, 2, 4, 8), budgets=(2048,)), LLAMA3_70B, "h100-sxm", 131072, share=0.5)
    assert {c.decode_tp for c in big} == {4, 8} and all(c.num_gpus <= 8 for c in big)
    assert Candidate("disaggregated", 1, 1, 4, 4, 2048) in big and Candidate("colocated", 0, 2, 4, 4, 2048) in big


def test_a_large_fleet_is_planned_as_equal_units_each_serving_its_prefix_groups() -> None:
    assert unit_gpus(4, (1, 2)) == 4 and unit_gpus(8, (1, 2)) == 8 and unit_gpus(16, (1, 2)) == 8
    assert unit_gpus(64, (1, 2)) == 8 and unit_gpus(64, (4, 8)) == 32 and unit_gpus(12, (1,)) == 12
    unit = candidates(Space(16, tps=(1,), budgets=(2048,)), LLAMA3_8B, "h100-sxm", 8192, share=0.5)
    fleet = candidates(Space(64, tps=(1,), budgets=(2048,), unit_gpus=16), LLAMA3_8B, "h100-sxm", 8192, share=0.5)
    assert [(c.mode, c.prefill * 4, c.decode * 4) for c in unit] == [(c.mode, c.prefill, c.decode) for c in fleet]
    assert all(c.num_gpus == 64 for c in fleet)
    # on 16 GPUs the splits within 2x of 8 prefill workers, kept 1.15x apart from the nearest out
    assert [(c.prefill, c.decode) for c in unit if c.mode == "disaggregated"] == [
        (4, 12), (5, 11), (6, 10), (8, 8), (10, 6), (12, 4), (14, 2)]  # 7 and 9 are 1.14x from 8, 11 1.1x from 10
    both = candidates(Space(8, tps=(1,), budgets=(2048,), speculation=(False, True)), LLAMA3_8B, "h100-sxm", 8192,
                      share=0.5)
    one = candidates(Space(8, tps=(1,), budgets=(2048,)), LLAMA3_8B, "h100-sxm", 8192, share=0.5)
    assert sorted(both) == sorted(one + [dataclasses.replace(c, speculative=True) for c in one])
    assert fleet_config(both[-1], LLAMA3_8B, "h100-sxm", 8192, 0, 0.6).spec_acceptance == 0.6
    assert {fleet_config(c, LLAMA3_8B, "h100-sxm", 8192, 0).speculative is None for c in both} == {True, False}
    with pytest.raises(ValueError, match="do not divide"):
        candidates(Space(64, unit_gpus=24), LLAMA3_8B, "h100-sxm", 8192, share=0.5)
    # a unit's share: whole prefix groups (the same first tokens), about a quarter, at their own times
    items = [WorkloadRequest([1000 + i % 50] * 16 + [i], 4, at_s=float(i)) for i in range(400)]  # 50 groups of 8
    quarter = sliced(items, 4)
    groups = {i.prompt[0] for i in quarter}
    assert all(sum(i.prompt[0] == g for i in quarter) == 8 for g in groups)  # each group whole
    assert 0.1 < len(quarter) / len(items) < 0.4 and sliced(items, 1) == items
    assert [i.at_s for i in quarter] == sorted(i.at_s for i in quarter)
    assert len(sliced(items, 4, key_tokens=17)) != len(quarter)  # by request, not by group


def result(label: str, goodput: float, attainment: float, mode: str = "disaggregated") -> dict:
    c = Candidate(mode, 0 if mode == "colocated" else 1, 1, 1, 1, 2048)  # type: ignore[arg-type]
    return {"label": label, "candidate": c.__dict__ | {}, "goodput_per_gpu": goodput, "slo_attainment": attainment}


def test_the_front_the_best_and_the_plan_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rs = [result("a", 1.0, 0.99), result("b", 1.2, 0.90), result("c", 0.9, 0.98), result("d", 1.1, 0.985),
          result("e", 0.8, 0.995, "colocated"), result("f", 1.05, 0.95, "colocated")]
    assert [r["label"] for r in pareto(rs)] == ["b", "d", "a", "e"]
    assert best(rs)["label"] == "d"  # the best goodput within 0.01 of the top attainment (0.995)
    plan = plan_file(rs, {"num_gpus": 8})
    assert plan["best"]["label"] == "d" and plan["best_colocated"]["label"] == "e"
    assert plan["gain_over_colocated"] == round(1.1 / 0.8, 3)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert read_plan(path) == Candidate("disaggregated", 1, 1, 1, 1, 2048)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="not a plan file of version 1"):
        read_plan(path)


def test_serve_takes_the_plan_s_pools(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cluster.cli import _apply_plan, _autoscale_config, build_parser

    rs = [result("a", 1.0, 0.99)]
    rs[0]["candidate"] = Candidate("disaggregated", 3, 5, 2, 1, 8192).__dict__ | {}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_file(rs, {})))
    args = build_parser().parse_args(["serve", "--plan", str(path)])
    _apply_plan(args)
    assert (args.num_prefill, args.num_decode, args.mode, args.prefill_tp, args.decode_tp,
            args.max_num_batched_tokens) == (3, 5, "disaggregated", 2, 1, 8192)
    assert args.speculative == "off"
    rs[0]["candidate"]["speculative"] = True
    path.write_text(json.dumps(plan_file(rs, {})))
    speculating = build_parser().parse_args(["serve", "--plan", str(path)])
    _apply_plan(speculating)
    assert speculating.speculative == "ngram"
    scaled = build_parser().parse_args(["serve", "--plan", str(path), "--autoscale", "--predictive-scaling"])
    _apply_plan(scaled)
    config = _autoscale_config(scaled)
    assert config.pd_ratio == 3 / 5 and config.predictive and config.startup_s == 30.0  # the plan's ratio kept
    apart = build_parser().parse_args(["serve", "--plan", str(path), "--autoscale", "--independent-pools"])
    _apply_plan(apart)
    assert _autoscale_config(apart).pd_ratio is None and not _autoscale_config(apart).predictive
    ahead = {**plan_file(rs, {}), "autoscale": {"predictive_ahead": True}}
    path.write_text(json.dumps(ahead))
    forecast = build_parser().parse_args(["serve", "--plan", str(path), "--autoscale"])
    _apply_plan(forecast)
    assert _autoscale_config(forecast).predictive  # the plan found it ahead on its trace


def test_predictive_scaling_is_ahead_where_it_holds_the_target_or_serves_as_well_for_less() -> None:
    def arm(attainment: float, per_gpu_hour: float) -> dict:
        return {"slo_attainment": attainment, "goodput_per_gpu_hour": per_gpu_hour}

    # benchmarks/sim/sim_autoscale.py's shapes: sinusoid (better and cheaper), ramp and bursts
    # (the target held where reactive misses it, at a higher price per good request)
    assert ahead(arm(0.801, 5519), arm(0.960, 8630), 0.9)
    assert ahead(arm(0.857, 10432), arm(1.0, 9179), 0.9) and ahead(arm(0.863, 6847), arm(0.987, 4847), 0.9)
    assert ahead(arm(0.95, 5000), arm(0.945, 5200), 0.9)  # as good, cheaper
    assert not ahead(arm(0.95, 5000), arm(0.99, 4000), 0.9)  # both hold it: predictive only dearer
    assert not ahead(arm(0.80, 5000), arm(0.85, 4000), 0.9)  # neither holds it, predictive dearer
    assert not ahead(arm(0.0, 0.0), arm(0.0, 0.0), 0.9) and not ahead(arm(0.99, 1604.7), arm(0.99, 1604.7), 0.9)


def test_capacity_is_the_largest_rate_multiple_that_holds_within_its_precision() -> None:
    for true in (0.3, 1.0, 1.7, 5.0):
        got = capacity(lambda m, true=true: m <= true)
        assert true / 2 ** (1 / 16) <= got <= true
    assert capacity(lambda m: True) == 64.0 and capacity(lambda m: False) == 0.0


def test_requests_repeat_end_to_end_and_scale_in_time() -> None:
    items = [WorkloadRequest([i], 4, at_s=t) for i, t in enumerate((0.0, 1.0, 3.0))]
    assert [(r.prompt, r.at_s) for r in repeated(items, 7)] == [
        ([0], 0.0), ([1], 1.0), ([2], 3.0), ([0], 4.5), ([1], 5.5), ([2], 7.5), ([0], 9.0)]
    assert [r.at_s for r in at_rate(items, 2.0)] == [0.0, 0.5, 1.5] and repeated(items, 2) == items[:2]


def test_the_searchs_processes_are_spawned_and_an_exception_kills_them_at_once() -> None:
    """A fork of a process holding threads (a Ray driver's, gRPC's) copies their locks, held,
    without them: a forked worker of a pytest process stalled, and the pool's shutdown waited
    on it past the test's timeout. The workers are spawned; a search left by an exception (a
    timeout, ^C) kills them instead of waiting."""
    import os
    import time
    from pathlib import Path

    from sim.plan import _Runner

    with pytest.raises(KeyboardInterrupt), _Runner([], 2) as run:
        assert run.pool is not None and run.workers == 2
        pid = run.pool.submit(os.getpid).result(timeout=60)
        assert pid != os.getpid() and b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()
        run.pool.submit(time.sleep, 600)
        began = time.monotonic()
        raise KeyboardInterrupt
    assert time.monotonic() - began < 30  # not the 600 s sleep (a slowed machine took over 5)

    def gone() -> bool:  # reaped, or a zombie not yet reaped
        try:
            return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
