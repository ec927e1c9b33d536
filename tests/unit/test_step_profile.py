"""A decode worker's start-up profile of its decode steps (engine/step_profile.py) and how
routers read it (engine/core/step_model.py `profile_seconds`, `StepShape`)."""
from __future__ import annotations

import random

import msgpack
import pytest

from control.heartbeat import BadEntry, Heartbeat
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.core.step_model import StepShape, profile_seconds
from engine.step_profile import batch_sizes, profile_decode
from engine.model.tiny_model import make_tiny_model
from router.members import Members
from router.wait_forecast import WaitForecast
from tests.conftest import FakeClock
from tests.unit.helpers import heartbeat

# two batch sizes, each at mean contexts 10 and 110 per request: 1 ms + 1 µs a context token
# at 1 request; 3 ms + 0.5 µs per request-context token at 8
ROWS = ((1.0, 10.0, 0.00101), (1.0, 110.0, 0.00111), (8.0, 80.0, 0.00304), (8.0, 880.0, 0.00344))


def test_profile_is_read_per_batch_size_along_context_and_between_batch_sizes() -> None:
    assert profile_seconds(ROWS, 1, 60) == pytest.approx(0.00106)  # 1 request, 60 tokens: on its line
    assert profile_seconds(ROWS, 8, 8 * 60) == pytest.approx(0.003 + 8 * 0.5e-6 * 60)  # 0.00324
    # 4.5 requests of 60 tokens: halfway between the two
    assert profile_seconds(ROWS, 4.5, 4.5 * 60) == pytest.approx((0.00106 + 0.00324) / 2)
    # past the largest batch, the last segment's slope continues: 8 -> 15 adds as much as 1 -> 8
    assert profile_seconds(ROWS, 15, 15 * 60) == pytest.approx(0.00324 + (0.00324 - 0.00106))
    assert profile_seconds(ROWS, 0.5, 10) == pytest.approx(0.00102)  # half a request of 20 tokens: one request of 20
    # a context shorter than any profiled is extrapolated along the line, never below zero
    # (0 to within the fit's ridge, engine/core/fit.py)
    assert profile_seconds(((1.0, 10.0, 0.001), (1.0, 110.0, 0.011)), 1, 0) == pytest.approx(0.0, abs=1e-9)


def test_a_shape_prefers_the_profile_and_falls_back_to_the_line() -> None:
    assert StepShape((0.001, 0.0001, 0.0)).seconds(10, 0) == pytest.approx(0.002)
    assert StepShape((0.001, 0.0001, 0.0), ROWS).seconds(1, 60) == pytest.approx(0.00106)
    assert not StepShape() and StepShape(profile=ROWS)


def test_the_forecast_reads_a_concave_profile_at_the_bursts_load(clock: FakeClock) -> None:
    # concave: 1 ms alone, 3 ms at 16, 8 ms at 64 (a line through 1 and 16 would say 13.7 ms at 64)
    rows = ((1.0, 100.0, 0.001), (16.0, 1600.0, 0.003), (64.0, 6400.0, 0.008))
    f = WaitForecast(clock)
    f.set_step_model(StepShape(profile=rows), 1)
    f._samples.append((16.0, 1600.0, 0.006))  # the router measured twice the profile at 16
    f._rescale()
    assert f.per_token_s(64, 6400) == pytest.approx(2 * 0.008)
    assert f.per_token_s(128, 12800) == pytest.approx(2 * (0.008 + 64 * 0.005 / 48))


def test_batch_sizes_double_up_to_the_largest() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("m")))


def _engine(model_dir: str, num_blocks: int = 256, max_num_seqs: int = 16) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, role="decode",
                                  cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))


def test_profile_runs_real_decode_steps_and_leaves_the_engine_as_it_found_it(model_dir: str) -> None:
    engine = _engine(model_dir)
    rows = profile_decode(engine, budget_s=30.0)
    # every batch size at a short (8 tokens) and a long context (1024, or what 256 blocks hold
    # with 9 steps to go); KV tokens are those the middle timed step reads (context + 5)
    assert [(n, kv) for n, kv, _ in rows] == [
        (1.0, 13.0), (1.0, 1029.0), (2.0, 2 * 13.0), (2.0, 2 * 1029.0), (4.0, 4 * 13.0), (4.0, 4 * 1019.0),
        (8.0, 8 * 13.0), (8.0, 8 * 507.0), (16.0, 16 * 13.0), (16.0, 16 * 251.0)]
    assert all(s > 0 for _, _, s in rows)
    # nothing of it stays: every block free, nothing cached or published, no counts, no step samples
    assert engine.block_pool.num_free_blocks == 256
    assert engine.take_kv_events() == [] and engine.num_prompt_tokens == 0
    assert engine.step_model.num_steps == 0 and not engine.has_unfinished()
    # the profile's first prompt (seed 0) is served from scratch, not from its garbage KV
    prompt = [random.Random(0).randrange(engine.model_config.vocab_size) for _ in range(8)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [done] = engine.generate([prompt], params)
    [fresh] = _engine(model_dir).generate([prompt], params)
    assert done.token_ids == fresh.token_ids and done.num_cached_tokens == 0


def test_the_budget_and_the_pool_bound_the_profile(model_dir: str) -> None:
    assert profile_decode(_engine(model_dir), budget_s=0.0) == ()
    small = profile_decode(_engine(model_dir, num_blocks=8, max_num_seqs=128), budget_s=30.0)
    assert [n for n, _, _ in small][-1] == 4.0  # 8 requests of 8 tokens and 9 steps would need 16 blocks


def test_heartbeats_carry_profiles_and_routers_average_equal_grids() -> None:
    def beat(worker_id: str, profile: list[float]) -> Heartbeat:
        return heartbeat(worker_id, "decode", address=f"{worker_id}:1", state="serving", model_id="m",
                         block_size=16, vocab_size=512, max_model_len=2048, num_total_blocks=64, step_profile=profile)

    flat = [x for row in ROWS for x in row]
    assert Heartbeat.from_wire(beat("decode-0", flat).to_wire()).step_profile == flat
    for bad in ([1.0, 2.0], [0.0, 1.0, 0.001], [1.0, 10.0, -0.5], [True, 1.0, 2.0]):
        with pytest.raises(BadEntry, match="step_profile"):
            Heartbeat.from_wire(msgpack.packb({**msgpack.unpackb(beat("d", flat).to_wire()), "step_profile": bad}))
    members = Members(("*",))
    doubled = [x * 2 if i % 3 == 2 else x for i, x in enumerate(flat)]
    members.update({"decode-0": beat("decode-0", flat), "decode-1": beat("decode-1", doubled)})
    shape, n = members.decode_step_model()
    assert n == 2 and shape is not None and shape.linear is None
    assert [s for _, _, s in shape.profile] == pytest.approx([1.5 * s for _, _, s in ROWS])
    other = Members(("*",))  # different grids (other pool sizes): the first worker's, by id
    other.update({"decode-1": beat("decode-1", flat[:6]), "decode-0": beat("decode-0", flat)})
    assert other.decode_step_model()[0].profile == ROWS  # type: ignore[union-attr]


def test_a_profile_of_overlapped_steps_keeps_its_books_apart_from_the_engines(model_dir: str) -> None:
    """The GPU default runs decode steps overlapped (engine/model/overlap.py): the profile's
    scratch requests are launched ahead and land in the scratch scheduler and KV books, and
    the engine's own are as they were (its pool all free, nothing in flight), then it serves."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, role="decode", overlap=True,
                                    cache=CacheConfig(block_size=16, num_blocks=256),
                                    scheduler=SchedulerConfig(max_num_seqs=4)))
    real = engine.overlap
    rows = profile_decode(engine, budget_s=30.0)
    assert [n for n, _, _ in rows] == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0] and all(s > 0 for _, _, s in rows)
    assert engine.overlap is real and real.current is None and real.num_guessed_rows == 0
    assert engine.block_pool.num_free_blocks == 256 and not engine.scheduler.in_flight
    assert engine.block_pool.check_invariants().num_in_use == 0 and not engine.has_unfinished()
    prompt = [random.Random(0).randrange(engine.model_config.vocab_size) for _ in range(8)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [done] = engine.generate([prompt], params)
    [fresh] = _engine(model_dir).generate([prompt], params)
    assert done.token_ids == fresh.token_ids
