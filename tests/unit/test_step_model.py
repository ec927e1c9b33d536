"""The decode step-time model engines fit and routers forecast with (engine/step_model.py)."""
from __future__ import annotations

import random

import pytest

from control.heartbeat import BadEntry, Heartbeat
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.step_model import StepModel
from engine.tiny_model import make_tiny_model
from router.members import Members


def test_the_three_terms_are_recovered_from_noisy_steps() -> None:
    m, rng = StepModel(), random.Random(0)
    for _ in range(3000):
        n = rng.choice([1, 4, 16])
        k = n * rng.randint(200, 320)
        m.observe(n, k, 0.002 + 0.0003 * n + 1e-6 * k + rng.gauss(0, 1e-4))
    a, b, c = m.latest  # type: ignore[misc]
    assert (a, b, c) == (pytest.approx(0.002, rel=0.05), pytest.approx(0.0003, rel=0.05), pytest.approx(1e-6, rel=0.1))


def test_slopes_are_never_negative_and_one_load_is_predicted_where_it_was_seen() -> None:
    m = StepModel()
    for n, t in ((1, 0.01), (8, 0.005)):  # faster with more requests: noise, not physics
        for _ in range(50):
            m.observe(n, 100 * n, t)
    assert all(x >= 0 for x in m.latest)  # type: ignore[union-attr]
    same = StepModel()
    for _ in range(100):
        same.observe(4, 1000, 0.01)
    a, b, c = same.latest  # type: ignore[misc]
    assert a + 4 * b + 1000 * c == pytest.approx(0.01)


def test_an_engine_feeds_its_pure_decode_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model_dir=str(make_tiny_model(tmp_path / "m")),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    assert engine.step_model.latest is None
    engine.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.step_model.num_steps == 5  # the first step prefills; the five after decode
    assert all(x >= 0 for x in engine.step_model.latest)  # type: ignore[union-attr]


def test_heartbeats_carry_it_and_routers_average_the_serving_decode_workers() -> None:
    def beat(worker_id: str, model: list[float], state: str = "serving") -> Heartbeat:
        return Heartbeat(worker_id, "decode", address=f"{worker_id}:1", state=state, model_id="m",  # type: ignore[arg-type]
                         block_size=16, vocab_size=512, max_model_len=2048, num_total_blocks=64, step_model=model)

    wire = beat("decode-0", [0.001, 0.0002, 1e-6]).to_wire()
    assert Heartbeat.from_wire(wire).step_model == [0.001, 0.0002, 1e-6]
    for bad in ([1.0, 2.0], ["x", 1, 2], [True, 1.0, 2.0]):
        with pytest.raises(BadEntry, match="step_model"):
            Heartbeat.from_wire(Heartbeat("d", "decode", step_model=bad).to_wire())  # type: ignore[arg-type]
    members = Members()
    members.update({"decode-0": beat("decode-0", [0.001, 0.0002, 1e-6]), "decode-1": beat("decode-1", [0.003, 0.0004, 3e-6]),
                    "decode-2": beat("decode-2", []), "decode-3": beat("decode-3", [9.0, 9.0, 9.0], "draining")})
    model, n = members.decode_step_model()
    assert n == 3 and model == (pytest.approx(0.002), pytest.approx(0.0003), pytest.approx(2e-6))
    assert Members().decode_step_model() == (None, 0)
