"""The decode step-time model engines fit and routers forecast with (engine/core/step_model.py)."""
from __future__ import annotations

import random
import time

import msgpack
import pytest

from control.heartbeat import BadEntry, Heartbeat, TierSpeed
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.core.step_model import PrefillCost, StepModel
from engine.model.tiny_model import make_tiny_model
from router.members import Members
from tests.unit.helpers import heartbeat


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
    for i in range(100):
        same.observe(4 + 2 * (i % 2), 1000, 0.01)
    a, b, c = same.latest  # type: ignore[misc]
    assert a + 4 * b + 1000 * c == pytest.approx(0.01)


def test_an_engine_feeds_its_pure_decode_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model_dir=str(make_tiny_model(tmp_path / "m")),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    assert engine.step_model.latest is None
    for max_tokens in (8, 8, 3, 3):
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # a prefill, then seven decode steps (4, 4, 2, ... requests); the last ends them all: no period
    assert engine.step_model.num_steps == 6
    assert all(x >= 0 for x in engine.step_model.latest[1:])  # type: ignore[index]  # slopes; the intercept is free


def test_heartbeats_carry_it_and_routers_average_the_serving_decode_workers() -> None:
    def beat(worker_id: str, model: list[float], state: str = "serving") -> Heartbeat:
        return heartbeat(worker_id, "decode", address=f"{worker_id}:1", state=state, model_id="m",  # type: ignore[arg-type]
                         block_size=16, vocab_size=512, max_model_len=2048, num_total_blocks=64, step_model=model)

    wire = beat("decode-0", [0.001, 0.0002, 1e-6]).to_wire()
    assert Heartbeat.from_wire(wire).step_model == [0.001, 0.0002, 1e-6]
    for bad in ([1.0, 2.0], ["x", 1, 2], [True, 1.0, 2.0]):
        with pytest.raises(BadEntry, match="step_model"):
            Heartbeat.from_wire(msgpack.packb({**msgpack.unpackb(wire), "step_model": bad}))
    members = Members(("*",))
    members.update({"decode-0": beat("decode-0", [0.001, 0.0002, 1e-6]), "decode-1": beat("decode-1", [0.003, 0.0004, 3e-6]),
                    "decode-2": beat("decode-2", []), "decode-3": beat("decode-3", [9.0, 9.0, 9.0], "draining")})
    model, n = members.decode_step_model()
    assert n == 3 and model is not None and not model.profile
    assert model.linear == (pytest.approx(0.002), pytest.approx(0.0003), pytest.approx(2e-6))
    assert Members().decode_step_model() == (None, 0)


def test_no_model_until_the_batch_size_varied_and_no_kv_slope_until_kv_did() -> None:
    m = StepModel()
    for i in range(500):  # one request at a time: its own cost cannot be told from the step's
        m.observe(1, 300 + i % 200, 0.001 + 1e-6 * (300 + i % 200))
    assert m.latest is None  # asked about 50 requests, it could only make a slope up
    same_kv = StepModel()
    for i in range(500):
        n = 1 + i % 8
        same_kv.observe(n, 1000, 0.001 + 0.0002 * n)
    a, b, c = same_kv.latest  # type: ignore[misc]
    assert (a, b, c) == (pytest.approx(0.001, rel=1e-3), pytest.approx(0.0002, rel=1e-3), 0.0)


def test_an_engines_sample_is_the_whole_period_between_decode_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model_dir=str(make_tiny_model(tmp_path / "m")),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(2):
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.01)  # sending the tokens out, between steps, is part of what a client waits
    a, b, c = engine.step_model.latest  # type: ignore[misc]
    assert a + b + c * 30 >= 0.01 and a + 3 * b + c * 60 >= 0.01


def test_a_step_floor_holds_each_step_to_its_stated_time_and_changes_no_token(tiny_llama_dir: str) -> None:
    """StepFloor: 40 ms + 1 ms per token computed + 5 ms per request scheduled, at least;
    the engine's own steps on the tiny model take a few ms, so each lasts its floor."""
    from engine.config import StepFloor

    def run(floor: StepFloor | None) -> tuple[list[list[int]], list[float]]:
        engine = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, cache=CacheConfig(kv_cache_bytes=8 * 2**20),
                                        step_floor=floor))
        prompts = [[5 + i] * (10 + 7 * i) for i in range(3)]
        ids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
        times, out = [], {}
        while engine.has_unfinished():
            began = time.perf_counter()
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            times.append(time.perf_counter() - began)
        return [out[k] for k in ids], times

    plain, _ = run(None)
    held, times = run(StepFloor(base_s=0.04, token_s=0.001, seq_s=0.005))
    assert held == plain
    assert times[0] >= 0.04 + 0.001 * (10 + 17 + 24) + 0.005 * 3  # the three prompts in one step
    assert all(t >= 0.04 + 0.001 * 3 + 0.005 * 3 for t in times[1:])  # three decodes a step after
    with pytest.raises(ValueError):
        StepFloor(base_s=-0.01)


def test_the_prefill_cost_is_the_slope_of_a_steps_time_on_its_tokens() -> None:
    """0.004 s + 2e-5 s a token: one more prompt token costs 2e-5 s. Before the steps' sizes
    vary it is their seconds over their tokens (the step's own cost shared by its tokens)."""
    cost = PrefillCost()
    assert cost.token_s == 0.0
    cost.observe(0, 1.0)  # nothing computed: no sample
    assert cost.token_s == 0.0
    for _ in range(3):
        cost.observe(200, 0.004 + 200 * 2e-5)
    assert cost.token_s == pytest.approx(0.008 / 200)
    for n in (16, 64, 512, 2048) * 10:
        cost.observe(n, 0.004 + n * 2e-5)
    assert cost.token_s == pytest.approx(2e-5, rel=1e-3)


def test_an_engine_prices_its_prompt_tokens_and_heartbeats_carry_the_tiers_speed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(model_dir=str(make_tiny_model(tmp_path / "m")),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    engine.generate([[5, 6, 7, 8] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # decodes: not prefills
    seconds = engine.prefill_cost.token_s
    assert 0 < seconds < 1
    engine.generate([[5, 6, 7, 8] * 2], SamplingParams(max_tokens=1))
    assert engine.prefill_cost.token_s != seconds  # a second prefilling step, another size
    speed = TierSpeed(seconds, [0.002, 1e-4], [])
    wire = heartbeat("decode-0", "decode", address="decode-0:1", tier_speed=speed).to_wire()
    assert Heartbeat.from_wire(wire).tier_speed == speed
    for bad in ({"token_s": -1.0}, {"fetch": [0.002]}, {"far_fetch": [0.1, float("inf")]}, {"fetch": ["x", 1]}):
        with pytest.raises(BadEntry, match="tier_speed"):
            Heartbeat.from_wire(msgpack.packb({**msgpack.unpackb(wire), "tier_speed": {"token_s": 0.0, **bad}}))
    members = Members(("*",))
    members.update({"decode-0": Heartbeat.from_wire(wire)})
    assert members.tier_speed("decode-0") == speed and members.tier_speed("gone") == TierSpeed()
