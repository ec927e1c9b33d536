"""The simulator's pieces (sim/): the roofline by hand, and the real scheduler and block pool
driven on a virtual clock."""
from __future__ import annotations

import pytest

from engine.config import SchedulerConfig, SpeculativeConfig
from sim.cost_model import H100_SXM, LLAMA3_8B, LLAMA3_70B, Roofline
from sim.engine_sim import SimEngine


def test_llama3_8b_shapes_by_hand() -> None:
    m = LLAMA3_8B
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q/o, k/v (8 heads of 128), gated MLP
    assert m.layer_params == per_layer == 218_103_808
    assert m.matmul_params == 32 * per_layer + 128256 * 4096
    assert m.weight_bytes == 2 * (m.matmul_params + 128256 * 4096)  # about 16 GB in bf16
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_a_decode_step_is_on_the_memory_roof_and_a_prefill_on_the_compute_roof() -> None:
    r = Roofline(LLAMA3_8B, H100_SXM)
    m = LLAMA3_8B
    memory_s = (m.weight_bytes + 1024 * m.kv_bytes_per_token) / (3.35e12 * 0.8)  # weights + 1024 tokens of KV
    assert r.step_s([(1, 1023)]) == pytest.approx(0.0015 + memory_s)
    assert 7.4e-3 < r.step_s([(1, 1023)]) < 7.7e-3
    flops = 2 * 32 * m.layer_params * 2048 + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * 2048 * (0 + 2049 / 2)
    assert r.step_s([(2048, 0)]) == pytest.approx(0.0015 + flops / (989e12 * 0.6))
    assert 0.049 < r.step_s([(2048, 0)]) < 0.053
    batch = [(1, 1023)] * 64  # 64 decodes: still one weight read, 64x the KV
    assert r.step_s(batch) < 2 * r.step_s([(1, 1023)])


def test_tensor_parallel_divides_the_roofs_and_adds_all_reduces() -> None:
    one, four = Roofline(LLAMA3_70B, H100_SXM), Roofline(LLAMA3_70B, H100_SXM, tp=4)
    assert four.allreduce_s(1) == pytest.approx(2 * 80 * (2 * 3 / 4 * 8192 * 2 / 450e9 + 20e-6))
    assert four.step_s([(1, 1023)]) < one.step_s([(1, 1023)]) / 3
    with pytest.raises(ValueError, match="does not fit"):
        one.kv_capacity_tokens()  # 140 GB of weights on one 80 GB GPU
    assert four.kv_capacity_tokens() == int((4 * 80e9 * 0.9 - LLAMA3_70B.weight_bytes) // LLAMA3_70B.kv_bytes_per_token)
    assert Roofline(LLAMA3_8B, H100_SXM).transfer_s(1000, same_node=False) == pytest.approx(20e-6 + 1000 * 131072 / 50e9)


def test_the_real_scheduler_on_a_virtual_clock_gives_exact_step_times() -> None:
    steps: list[list[tuple[int, int]]] = []

    def cost(chunks, num_sampled):  # type: ignore[no-untyped-def]
        steps.append(list(chunks))
        return 0.001 * sum(n for n, _ in chunks) + 0.01  # 10 ms a step, 1 ms a token
    e = SimEngine(cost, num_blocks=64, block_size=4, vocab_size=1000,
                  scheduler=SchedulerConfig(max_num_batched_tokens=16))
    e.add("a", list(range(20)), max_tokens=3)  # 20 prompt tokens: chunks of 16 then 4 (chunked prefill)
    now, first_token_at = 0.0, None
    while e.has_work:
        result = e.step(now)
        now += result.duration_s
        if first_token_at is None and result.tokens:
            first_token_at = now
    assert steps == [[(16, 0)], [(4, 16)], [(1, 20)], [(1, 21)]]
    assert first_token_at == pytest.approx(0.026 + 0.014)  # TTFT: the two prefill chunks
    assert now == pytest.approx(0.026 + 0.014 + 2 * 0.011)
    assert e.pool.usage().num_in_use == 0


def test_speculation_runs_the_engine_s_policy_and_keeps_what_the_workload_s_acceptance_draws() -> None:
    hw = Roofline(LLAMA3_8B, H100_SXM)

    def served(batch: int, acceptance: float | None) -> tuple[int, float, SimEngine, list[int]]:
        e = SimEngine(hw.for_worker(), 4000, 16, 128256, speculative=None if acceptance is None else
                      SpeculativeConfig(method="ngram"), spec_acceptance=acceptance or 0.0)
        for i in range(batch):
            e.add(f"r{i}", list(range(i, i + 500)), max_tokens=200)
        now, steps, lengths = 0.0, 0, {}
        while e.has_work:
            result = e.step(now)
            now, steps = now + result.duration_s, steps + 1
            lengths.update(result.tokens)
        assert e.pool.usage().num_in_use == 0  # the proposals' blocks rolled back, every block home
        return steps, now, e, sorted(lengths.values())

    plain_steps, plain_s, _, plain_lengths = served(1, None)
    assert plain_steps == 200 and plain_lengths == [200]
    steps, seconds, e, lengths = served(1, 0.9)  # one request: a memory-bound step, proposals nearly free
    assert lengths == [200] and steps < plain_steps / 3 and seconds < plain_s / 3
    assert 0.75 < e.num_accepted / e.num_proposed <= 1.0
    _, seconds, e, _ = served(1, 0.0)  # nothing kept: the policy backs off, the run costs what a plain one does
    assert e.num_accepted == 0 and e.num_proposed < 60 and seconds < plain_s * 1.05
    # 64 decoding: more than the policy's 32-token budget, no proposals (but while the first few
    # decode before the rest are prefilled)
    _, seconds, e, lengths = served(64, 0.9)
    assert e.num_proposed < 0.01 * 64 * 200 and lengths == [200] * 64


def test_a_shared_prefix_hits_the_real_prefix_cache_and_runs_are_deterministic() -> None:
    def run() -> tuple[list[list[tuple[int, int]]], int]:
        seen: list[list[tuple[int, int]]] = []
        e = SimEngine(lambda chunks, k: seen.append(list(chunks)) or 0.01, num_blocks=64, block_size=4, vocab_size=1000)
        shared = list(range(100, 116))
        for i, tail in enumerate(([1, 2, 3], [4, 5, 6])):
            e.add(f"r{i}", shared + tail, max_tokens=2)
            now = 0.0
            while e.has_work:
                now += e.step(now).duration_s
        return seen, e.scheduler.requests.__len__()
    seen, left = run()
    assert seen[2] == [(3, 16)]  # the second request computes only its 3 uncached tokens
    assert left == 0 and run() == (seen, left)


def test_fp8_prices_the_bytes_it_saves_and_the_tensor_cores_it_runs_on() -> None:
    """FP8 weights: the projections at one byte (the embeddings and head stay 16-bit) on FP8
    tensor cores at twice the rate; FP8 KV: one byte per element, twice the tokens per GPU
    and half the bytes a hand-off or a store fetch moves."""
    from sim.cost_model import H100_SXM, LLAMA3_8B, Roofline

    base, w8, kv8 = (Roofline(LLAMA3_8B.in_fp8(w, k), H100_SXM) for w, k in ((False, False), (True, False),
                                                                           (False, True)))
    m = LLAMA3_8B
    head_and_embed = 2 * m.vocab * m.hidden * 2
    assert w8.model.weight_bytes == m.num_layers * m.layer_params + head_and_embed
    assert base.model.weight_bytes == 2 * m.num_layers * m.layer_params + head_and_embed
    assert kv8.model.kv_bytes_per_token * 2 == base.model.kv_bytes_per_token
    assert kv8.transfer_s(4096, False) - H100_SXM.link_latency_s == pytest.approx(
        (base.transfer_s(4096, False) - H100_SXM.link_latency_s) / 2)
    free = 0.9 * H100_SXM.memory_bytes - m.weight_bytes
    assert kv8.kv_capacity_tokens() == int(free // (m.kv_bytes_per_token // 2))
    decode = [(1, 2048)] * 32  # memory-bound: the weights' bytes
    assert w8.step_s(decode) < 0.8 * base.step_s(decode)
    prefill = [(8192, 0)]  # compute-bound: the projections at twice the rate
    assert w8.step_s(prefill) < 0.6 * base.step_s(prefill)
