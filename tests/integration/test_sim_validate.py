"""The simulator against the real cluster, small: the CPU engine fitted, one workload through
a real LocalCluster (Ray, gRPC, Redis) and through the Fleet at the same arrival times.
The full comparison, with the serving overheads calibrated, is benchmarks/sim_validate.py;
here the bounds are generous (the uncalibrated model leaves out the processes' own costs)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import report
from bench.workload import synthetic
from engine.tiny_model import make_tiny_model
from router.policy import RoutingConfig
from sim.arrivals import Shape, arrival_times, timed
from sim.validate import Arm, compare, fit_engine, real_run, sim_run


@pytest.mark.timeout(300)
def test_the_fleet_and_the_real_cluster_agree_roughly_on_a_small_workload(tmp_path: Path) -> None:
    model = str(make_tiny_model(tmp_path / "tiny", arch="llama", seed=0))
    engine = fit_engine(model)
    assert engine.engine_s([(512, 0)]) > engine.engine_s([(1, 512)]) > 0  # a prefill chunk costs more than a decode
    items = timed(synthetic(24, 256, 24, 0.0, 0, 0, 500, seed=5), arrival_times(24, Shape(rate=4.0), seed=5))
    arm = Arm("disaggregated 1P:1D", 1, 1, RoutingConfig(mode="disaggregated"))
    real, simulated = real_run(model, arm, items), sim_run(model, arm, items, engine)
    assert [o.code for o in simulated.outcomes] == ["OK"] * 24 == [o.code for o in real.outcomes]
    assert [o.num_out for o in simulated.outcomes] == [o.num_out for o in real.outcomes]
    line = compare(real, simulated, 1.0, 0.05)
    ratios = line["sim_over_real"]
    # uncalibrated, the model leaves out the router's hops (5-9 ms here, measured by
    # benchmarks/sim_validate.py), more than a 256-token prefill: TTFT is bounded loosely
    assert 0.05 < ratios["ttft_ms_p50"] < 5 and 0.2 < ratios["itl_ms_p50"] < 5, line
    assert 0.8 < ratios["output_tokens_per_s"] < 1.25, line  # an open loop: both keep up with the arrivals
    assert report.summarize(simulated, 1.0, 0.05)["num_ok"] == 24
