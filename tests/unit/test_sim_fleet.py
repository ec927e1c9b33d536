"""The fleet simulator (sim/fleet.py): the router's, engines' and autoscaler's own code on a
virtual clock, with the forward pass and the wire priced by a cost model."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from loadgen import report
from loadgen.workload import WorkloadRequest, synthetic
from control.autoscaler import AutoscaleConfig
from engine.config import SchedulerConfig
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from sim.arrivals import Shape, arrival_times, timed, trace_items
from sim.fleet import Fleet, FleetConfig


class Linear:
    """1 ms a step and 0.1 ms a token; 2 ms to move any KV."""

    def step_s(self, chunks: list[tuple[int, int]], num_sampled: int | None = None) -> float:
        return 0.001 + 0.0001 * sum(n for n, _ in chunks)

    def for_worker(self):  # type: ignore[no-untyped-def]
        return self.step_s

    def transfer_s(self, num_tokens: int, same_node: bool) -> float:
        return 0.002

    def store_s(self, num_tokens: int) -> float:
        return 0.0005

    def disk_s(self, num_tokens: int) -> float:
        return 1e-5 * num_tokens

    rpc_s = 0.0
    delivery_s = ()
    hops_s = ()
    hop_token_s = 0.0
    push_token_s = 0.0


def one_each(**kw: object) -> FleetConfig:
    return FleetConfig(num_prefill=1, num_decode=1, num_blocks=1000, max_model_len=4096, **kw)  # type: ignore[arg-type]


def test_a_scripted_pair_through_prefill_transfer_and_decode_has_exact_times() -> None:
    prompt = list(range(3, 103))  # 100 tokens: six full blocks of 16 and four more
    items = [WorkloadRequest(prompt, 4, 0.0), WorkloadRequest(prompt, 3, 0.005)]
    result = Fleet(one_each(), Linear(), items).run()
    a, b = result.run.outcomes
    # a: prefill of 100 tokens 0 -> 11 ms (first token); its last chunk moves 11 -> 13 ms; on D
    # decode steps of 1.1 ms: 14.1, 15.2, then one shared with b (below), 1.2 ms: 16.4 ms
    assert a.code == "OK" and a.ttft_s == pytest.approx(0.011)
    assert a.itls_s == pytest.approx([0.0031, 0.0011, 0.0012]) and a.end_s == pytest.approx(0.0164)
    # b arrives at 5 ms while P computes a; P's next step (11 ms) finds a's six blocks cached and
    # computes 4 tokens (1.4 ms): first token at 12.4 ms; the KV lands at 14.4 ms, while D runs a's
    # step 14.1 -> 15.2; it joins the next, a batch of two (1.2 ms): 16.4 ms, then alone: 17.5 ms
    assert b.ttft_s == pytest.approx(0.0074) and b.num_cached == 96
    assert b.itls_s == pytest.approx([0.004, 0.0011]) and b.end_s == pytest.approx(0.0175)
    assert result.stats["num_remote_prefill"] == 2
    assert result.gpu_seconds == pytest.approx(2 * 0.0175)  # two GPUs, from 0 to the last token


def test_colocated_prefills_on_the_decode_worker_and_interleaves_its_decodes() -> None:
    prompt = list(range(3, 103))
    cfg = FleetConfig(num_prefill=0, num_decode=1, num_blocks=1000, max_model_len=4096,
                      routing=RoutingConfig(mode="colocated"))
    items = [WorkloadRequest(prompt, 3, 0.0), WorkloadRequest(list(range(200, 300)), 2, 0.0105)]
    a, b = Fleet(cfg, Linear(), items).run().run.outcomes
    # a: prefill 0 -> 11 ms; b (arrived meanwhile) prefills in a's first decode step (101 tokens,
    # 11.1 ms): a's second token waits for b's whole prompt, the interference P/D removes
    assert a.ttft_s == pytest.approx(0.011) and a.itls_s == pytest.approx([0.0111, 0.0012])
    assert b.ttft_s == pytest.approx(0.0221 - 0.0105)


def test_same_seed_same_run_and_every_block_comes_back() -> None:
    items = timed(synthetic(120, 300, 20, 0.5, 3, 128, 32000, seed=1), arrival_times(120, Shape(rate=200.0), seed=1))
    cfg = FleetConfig(num_prefill=2, num_decode=2, num_blocks=400, max_model_len=4096)

    def run() -> tuple[list[tuple[object, ...]], Fleet]:
        fleet = Fleet(cfg, Linear(), items)
        r = fleet.run()
        return [(o.code, o.ttft_s, tuple(o.itls_s), o.end_s, o.num_cached) for o in r.run.outcomes], fleet

    first, fleet = run()
    again, _ = run()
    assert first == again
    assert all(code == "OK" for code, *_ in first)
    for w in fleet.workers.values():  # nothing held once every request ended
        u = w.engine.pool.check_invariants()
        assert u.num_in_use == 0 and not w.engine.kv.num_held and len(w.table or ()) == 0


def test_cache_aware_routing_finds_shared_prefixes_round_robin_spreads_them() -> None:
    items = timed(synthetic(200, 400, 8, 1.0, 4, 320, 32000, seed=2), arrival_times(200, Shape(rate=50.0), seed=2))
    base = FleetConfig(num_prefill=4, num_decode=4, num_blocks=2000, max_model_len=4096)
    aware = report.summarize(Fleet(base, Linear(), items).run().run, 1.0, 0.1)
    rr = report.summarize(Fleet(dataclasses.replace(base, routing=RoutingConfig(
        mode="disaggregated", policy="round_robin")), Linear(), items).run().run, 1.0, 0.1)
    # four prefixes of 320 tokens (20 blocks) over 4 prefill workers: cache-aware keeps each on one
    assert aware["prefix_hit_rate"] > 0.7 > rr["prefix_hit_rate"]
    assert aware["ttft_ms"]["p50"] < rr["ttft_ms"]["p50"]


def test_an_overload_is_refused_at_arrival_by_the_routers_own_admission() -> None:
    items = [WorkloadRequest(list(range(3 + i, 1003 + i)), 200, 0.0) for i in range(40)]
    cfg = dataclasses.replace(one_each(), admission=AdmissionConfig(max_inflight_tokens=6000, max_queue_wait_s=0.5))
    outcomes = Fleet(cfg, Linear(), items).run().run.outcomes
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    assert refused and all(o.end_s <= 0.5 for o in refused)  # at arrival or on revision, never at the limit
    assert sum(o.ok for o in outcomes) >= 5


def test_the_autoscaler_grows_a_pool_under_load_and_shrinks_it_after() -> None:
    rng = random.Random(3)
    busy = [WorkloadRequest([rng.randrange(3, 32000) for _ in range(2000)], 4, 0.05 * i)
            for i in range(600)]  # 20 distinct prefill-heavy requests/s for 30 s
    quiet = [WorkloadRequest([rng.randrange(3, 32000) for _ in range(100)], 4, 30 + 2.0 * i)
             for i in range(60)]  # then one every 2 s
    cfg = dataclasses.replace(one_each(startup_s=5.0), scheduler=SchedulerConfig(max_num_batched_tokens=512),
                              autoscale=AutoscaleConfig(prefill_max=4, decode_max=2, up_delay_s=2.0,
                                                        down_delay_s=10.0, cooldown_s=5.0))
    result = Fleet(cfg, Linear(), busy + quiet).run()
    prefill_sizes = [p for _, p, _ in result.pool_sizes]
    assert max(prefill_sizes) > 1 and prefill_sizes[-1] < max(prefill_sizes)
    assert any("prefill 1 -> 2" in reason for _, reason in result.actions)
    assert len(result.actions) <= 10  # bounded steps with cooldowns: no oscillation
    assert all(o.ok for o in result.run.outcomes[600:])  # the quiet part; the busy one overran admission


def test_arrival_shapes() -> None:
    poisson = arrival_times(4000, Shape(rate=10.0), seed=0)
    assert poisson == sorted(poisson) and 4000 / poisson[-1] == pytest.approx(10.0, rel=0.05)
    ramp = arrival_times(4000, Shape("ramp", rate=5.0, rate_to=15.0), seed=0)
    first, last = sum(t < ramp[-1] / 4 for t in ramp), sum(t > 3 * ramp[-1] / 4 for t in ramp)
    assert last > 1.8 * first
    wave = arrival_times(6000, Shape("sinusoid", rate=10.0, amplitude=0.8, period_s=100.0), seed=0)
    peaks = sum(10 < t % 100 < 40 for t in wave)  # around the crest (25 s) vs the trough (75 s)
    troughs = sum(60 < t % 100 < 90 for t in wave)
    assert peaks > 3 * troughs
    burst = arrival_times(500, Shape("burst", rate=1.0, amplitude=1.0, period_s=10.0), seed=0)
    assert burst.count(10.0) == 10 and burst.count(20.0) == 10 and burst == sorted(burst)
    with pytest.raises(ValueError, match="shape"):
        Shape("square")


def test_trace_replay_keeps_sharing_exact_and_repeats_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    recs = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [7, 8]},
            {"timestamp": 500, "input_length": 600, "output_length": 4, "hash_ids": [7, 9]}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    items = trace_items(path, 5, 512, 100000, 32000, 1.0)
    assert [i.at_s for i in items] == pytest.approx([0.0, 0.5, 0.75, 1.25, 1.5])
    assert items[0].prompt[:512] == items[1].prompt[:512] and items[0].prompt[512:] != items[1].prompt[512:1024]
    assert len(items[1].prompt) == 600 and items[2].prompt == items[0].prompt


def test_delivery_patterns_move_what_the_client_sees_not_the_engines() -> None:
    class Jittery(Linear):
        delivery_s = ((0.0, 0.005, -0.001), (0.0, 0.0))

    items = [WorkloadRequest(list(range(3 + 200 * i, 103 + 200 * i)), 20, 0.01 * i) for i in range(6)]
    plain = Fleet(one_each(), Linear(), items).run()
    jittered = Fleet(one_each(), Jittery(), items).run()
    assert plain.stats["num_steps"] == jittered.stats["num_steps"]  # the same steps at the same times
    for a, b in zip(plain.run.outcomes, jittered.run.outcomes, strict=True):
        assert all(x >= 0 for x in b.itls_s) and len(a.itls_s) == len(b.itls_s)
        assert b.ttft_s >= a.ttft_s - 1e-12 and b.end_s >= a.end_s - 1e-12  # type: ignore[operator]
    assert max(x for o in jittered.run.outcomes for x in o.itls_s) > max(x for o in plain.run.outcomes for x in o.itls_s)
    assert min(x for o in jittered.run.outcomes for x in o.itls_s) == 0.0  # a token early on its pattern came with the last


def test_a_stream_replays_its_pattern_cyclically_from_a_phase_of_its_own() -> None:
    """Steps of 1.1 ms; the pattern (0, +2 ms, -0.5 ms), entered at a phase drawn per stream
    and shifted so the first decode token's offset is 0: token k after it is seen at its
    step's end plus the k-th offset from there, never before the token before it."""
    from sim.cpu_fit import delivery_cycle

    assert delivery_cycle([0.009, 0.001, 0.003, 0.0005]) == (0.0, -0.0005, 0.001)  # pace 1.5 ms: -0.5, then +1.5

    class Patterned(Linear):
        delivery_s = ((0.0, 0.002, -0.0005),)

    items = [WorkloadRequest(list(range(3, 19)), 8, 1.0 * i) for i in range(12)]  # far apart: each stream alone
    plain = Fleet(one_each(), Linear(), items).run().run.outcomes
    patterned = Fleet(one_each(), Patterned(), items).run().run.outcomes
    # by phase: offsets (0, 2, -0.5), (0, -2.5, -2), (0, 0.5, 2.5) ms, seen against steps at 0, 1.1, 2.2 ... ms
    by_phase = {(3.1, 0.0, 0.2, 3.1, 0.0, 0.2), (0.0, 0.2, 3.1, 0.0, 0.2, 3.1), (1.6, 3.1, 0.0, 0.2, 3.1, 0.0)}
    phases = set()
    for a, b in zip(plain, patterned, strict=True):
        assert b.ttft_s == a.ttft_s and a.itls_s[1:] == pytest.approx([0.0011] * 6)
        assert b.itls_s[0] == pytest.approx(a.itls_s[0])  # the first decode token: offset 0
        got = tuple(round(x * 1e3, 6) for x in b.itls_s[1:])
        assert got in by_phase
        phases.add(got)
    assert phases == by_phase  # twelve streams drew every phase


def test_hop_samples_are_drawn_per_request_grow_with_the_prompt_and_end_at_the_client() -> None:
    class Hops(Linear):
        hops_s = (0.001, 0.004)
        hop_token_s = 0.0001  # 1.6 ms more for each 16-token prompt
        delivery_s = ((0.0, 0.010),)  # every other later token seen 10 ms past its step; the first is in the hops

    items = [WorkloadRequest(list(range(3, 19)), 2, i * 1.0) for i in range(40)]  # one block, far apart: no queueing
    plain = Fleet(one_each(), Linear(), items).run()
    hopped = Fleet(one_each(), Hops(), items).run()
    extra = sorted({round(b.ttft_s - a.ttft_s, 9) for a, b in zip(plain.run.outcomes, hopped.run.outcomes, strict=True)})
    assert extra == [0.0026, 0.0056]  # each request drew one of the two, plus its prompt's part
    assert Fleet(one_each(), Hops(), items).run().run.outcomes == hopped.run.outcomes  # the same seed, the same draws
    assert all(b.itls_s == pytest.approx(a.itls_s) for a, b in zip(plain.run.outcomes, hopped.run.outcomes,
                                                                    strict=True))  # two tokens: no later offset


def test_the_cpu_fit_recovers_known_costs_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sim.cpu_fit import CpuCost, features, fit

    truth = (0.0004, 1e-5, 0.0, 1.2e-8, 3e-7, 4e-8, 2e-5, 0.0013)
    rng = random.Random(0)
    samples = []
    for _ in range(300):
        chunks = [(rng.choice((1, 1, 64, 512)), rng.choice((0, rng.randrange(0, 1024)))) for _ in range(rng.randrange(1, 9))]
        sampled, new = sum(n == 1 for n, _ in chunks) or 1, rng.random() < 0.2
        samples.append((chunks, sampled, new, sum(c * x for c, x in zip(truth, features(chunks, sampled, new), strict=True))))
    got = fit(samples)
    assert got == pytest.approx(truth, rel=1e-6, abs=1e-12)
    cost = CpuCost(got, step_overhead_s=0.001, seq_overhead_s=0.0001, rpc_s=0.003, delivery_s=((0.0, 0.002), (0.0,)),
                   hops_s=(0.002, 0.003))
    assert cost.step_s([(1, 100)] * 4) == pytest.approx(cost.engine_s([(1, 100)] * 4) + 0.001 + 4 * 0.0001)
    cost.save(tmp_path / "c.json")
    assert CpuCost.load(tmp_path / "c.json") == cost
    from engine.config import StepFloor
    held = dataclasses.replace(cost, floor=StepFloor(base_s=0.004, token_s=1e-6, seq_s=0.001))
    assert held.engine_s([(1, 100)] * 4) == pytest.approx(0.004 + 4e-6 + 0.004)  # the floor, over the fit (0.55 ms)
    assert held.engine_s([(512, 0)]) == pytest.approx(cost.engine_s([(512, 0)]))  # the fit (5.54 ms), over the floor
    assert held.engine_s([(512, 0)]) > 0.004 + 512e-6 + 0.001
    held.save(tmp_path / "h.json")
    assert CpuCost.load(tmp_path / "h.json") == held


def test_the_cpu_fit_prices_each_attention_path_and_a_workers_new_step_sizes() -> None:
    from sim.cpu_fit import FEATURES, CpuCost, features

    # a decode over 99, a cold 64-token chunk, a 100-token chunk over 412 cached, a 5-token tail over 40
    got = dict(zip(FEATURES, features([(1, 99), (64, 0), (100, 412), (5, 40)], 2, True), strict=True))
    assert got == {"step": 1.0, "tokens": 170.0, "causal_pairs": 64 * 65 / 2, "paged_pairs": 100.0 * 512,
                   "paged_kv": 512.0, "decode_kv": 100.0 + 45.0, "sampled": 2.0, "new_shape": 1.0}
    cost = CpuCost((0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.002), step_overhead_s=0.001, shape_cache=2)
    step = cost.for_worker()
    assert [step([(n, 0)]) for n in (64, 64, 32, 64, 16, 32, 32)] == pytest.approx(
        [0.003, 0.001, 0.003, 0.001, 0.003, 0.003, 0.001])  # 16 pushed out 32, the least recently run
    assert cost.for_worker()([(64, 0)]) == pytest.approx(0.003)  # another worker has its own
    assert step([]) == 0.0


def test_splitserve_simulate_on_a_trace_alone_runs_both_modes_on_8_gpus(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cluster.cli import main

    trace = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"
    assert main(["simulate", "--trace", str(trace), "--num-requests", "40", "--plots", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["label"].split()[0] for line in lines] == ["disaggregated", "colocated"]
    for line in lines:
        r = line["results"]
        assert r["num_requests"] == 40 and r["num_ok"] + r["num_failed"] == 40
        assert {"ttft_ms", "itl_ms", "e2e_ms", "goodput_rps", "slo_attainment", "prefix_hit_rate", "gpu_seconds"} <= set(r)
        assert line["config"]["fleet"]["num_prefill"] + line["config"]["fleet"]["num_decode"] == 8
    assert lines[1]["config"]["fleet"]["num_prefill"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["itl_cdf.png", "timeline.png", "ttft_cdf.png"]


def test_a_prefill_workers_push_costs_its_first_step_for_every_token_the_decode_worker_lacks() -> None:
    class Pushing(Linear):
        push_token_s = 1e-5

    [a] = Fleet(one_each(), Pushing(), [WorkloadRequest(list(range(3, 103)), 2, 0.0)]).run().run.outcomes
    assert a.ttft_s == pytest.approx(0.011 + 100 * 1e-5)  # the prefill, and 100 tokens pushed beside it


class Split(Linear):
    """A prefill worker at twice the degree: its steps take half as long."""

    def step_s(self, chunks: list[tuple[int, int]], num_sampled: int | None = None) -> float:
        return super().step_s(chunks, num_sampled) / 2


def test_prefill_and_decode_at_different_degrees_are_priced_and_counted_apart() -> None:
    """P at TP 2 (its steps priced by its own cost, its GPUs counted twice) beside D at TP 1:
    the same run's first token comes in half the prefill time; GPU-seconds count 3 GPUs."""
    prompt = list(range(3, 103))
    items = [WorkloadRequest(prompt, 4, 0.0)]
    same = Fleet(one_each(), Linear(), items).run()
    cfg = one_each(prefill_gpus_per_worker=2, prefill_num_blocks=2000)
    split = Fleet(cfg, Linear(), items, prefill_hardware=Split()).run()
    [a], [b] = same.run.outcomes, split.run.outcomes
    assert a.ttft_s == pytest.approx(0.011) and b.ttft_s == pytest.approx(0.0055)
    assert cfg.num_gpus == 3 and cfg.gpus("prefill") == 2 and cfg.gpus("decode") == 1 and cfg.blocks("prefill") == 2000
    assert split.gpu_seconds == pytest.approx(3 * b.end_s)
    assert b.itls_s == pytest.approx(a.itls_s)  # decode runs at its own degree, unchanged


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_the_node_store_serves_a_prefix_the_pool_evicted_and_its_fetch_is_priced(mode: str) -> None:
    """A 100-token prompt, five others that fill a 20-block pool, then the first again: with a
    store of 200 blocks on the node its 6 full blocks come from the store (96 cached tokens, the
    fetch's 0.5 ms in its first step: 4 tokens computed, 1.4 ms + 0.5 ms); without, it is computed
    whole (11 ms). Every block comes back."""
    first = list(range(3, 103))
    items = [WorkloadRequest(first, 1, 0.0),
             *(WorkloadRequest(list(range(1000 * i, 1000 * i + 100)), 1, 0.05 * i) for i in range(1, 6)),
             WorkloadRequest(first, 1, 0.5)]
    for blocks, cached, ttft in ((0, 0, 0.011), (200, 96, 0.0019)):
        cfg = FleetConfig(num_prefill=0 if mode == "colocated" else 1, num_decode=1, num_blocks=20,
                          max_model_len=4096, routing=RoutingConfig(mode=mode), kv_store_blocks=blocks)
        fleet = Fleet(cfg, Linear(), items)
        result = fleet.run()
        last = result.run.outcomes[-1]
        assert last.code == "OK" and last.num_cached == cached
        if mode == "colocated":
            assert last.ttft_s == pytest.approx(ttft)
        assert result.stats.get("num_store_fetched_blocks", 0) == cached // 16
        for w in fleet.workers.values():
            u = w.engine.pool.check_invariants()
            assert u.num_in_use == 0 and not w.engine.kv.num_held



def test_a_prefix_the_stores_memory_evicted_comes_back_from_its_spill_at_the_ssds_price() -> None:
    """The evicted prompt of the test above with a store of 6 blocks in memory and 200 on disk:
    each later prompt's 6 blocks push the one before into the spill. The last turn's fetch
    reads its 6 blocks back (96 tokens at 10 µs: 0.96 ms) before the push (0.5 ms): TTFT
    1.4 + 0.5 + 0.96 ms. Without a spill they are gone and computed."""
    first = list(range(3, 103))
    items = [WorkloadRequest(first, 1, 0.0),
             *(WorkloadRequest(list(range(1000 * i, 1000 * i + 100)), 1, 0.05 * i) for i in range(1, 6)),
             WorkloadRequest(first, 1, 0.5)]
    for disk, cached, ttft in ((0, 0, 0.011), (200, 96, 0.00286)):
        cfg = FleetConfig(num_prefill=0, num_decode=1, num_blocks=20, max_model_len=4096,
                          routing=RoutingConfig(mode="colocated"), kv_store_blocks=6, kv_store_disk_blocks=disk)
        fleet = Fleet(cfg, Linear(), items)
        result = fleet.run()
        last = result.run.outcomes[-1]
        assert last.code == "OK" and last.num_cached == cached and last.ttft_s == pytest.approx(ttft)
        stats = result.stats
        if disk:  # 5 prompts' blocks spilled, then the one the fetch put back in memory pushed out
            assert (stats["num_store_spilled_blocks"], stats["num_store_unspilled_blocks"],
                    stats["num_store_evicted_blocks"]) == (36, 6, 0)
        else:
            assert stats["num_store_evicted_blocks"] == 36 and stats["num_store_fetched_blocks"] == 0  # the last computed too
    assert fleet.tier is not None and fleet.tier.share(6, 6) == pytest.approx((0.0005 + 0.00096) / 0.0096)

class SlowStore(Linear):
    """A store that takes 20 ms a fetch: computing 6 blocks (96 tokens) takes 9.6 ms."""

    def store_s(self, num_tokens: int) -> float:
        return 0.02


def test_a_store_slower_than_computing_is_not_credited_and_fetched_from_only_as_a_probe() -> None:
    """The evicted prompts of the test above, with a node store whose fetch (20 ms) outruns
    computing their 6 blocks: the router's price is 1 (no credit). As the routers do
    (router/policy.py `tells_fetch`), a worker priced out is still told of a hit once every
    FETCH_PROBE_S (a fresh measurement): the first hit is fetched (21.4 ms, against 11 ms
    computing), the next one within 10 s computed."""
    first, second = list(range(3, 103)), list(range(203, 303))

    def evict(start: int, at: float) -> list[WorkloadRequest]:
        return [WorkloadRequest(list(range(1000 * i, 1000 * i + 100)), 1, at + 0.05 * (i - start))
                for i in range(start, start + 5)]

    items = [WorkloadRequest(first, 1, 0.0), WorkloadRequest(second, 1, 0.05), *evict(1, 0.1),
             WorkloadRequest(first, 1, 0.5), *evict(6, 0.55), WorkloadRequest(second, 1, 1.0)]
    cfg = FleetConfig(num_prefill=0, num_decode=1, num_blocks=20, max_model_len=4096,
                      routing=RoutingConfig(mode="colocated"), kv_store_blocks=200)
    fleet = Fleet(cfg, SlowStore(), items)
    result = fleet.run()
    probe, last = result.run.outcomes[7], result.run.outcomes[-1]
    assert (probe.sent_s, probe.num_cached, probe.ttft_s) == (0.5, 96, pytest.approx(0.0214))
    assert (last.sent_s, last.num_cached, last.ttft_s) == (1.0, 0, pytest.approx(0.011))
    assert result.stats["num_store_fetched_blocks"] == 6
    assert fleet.tier is not None and fleet.tier.share(6) == 1.0 and Fleet(cfg, Linear(), items).tier.share(6) == \
        pytest.approx(0.0005 / 0.0096)


def test_a_run_with_a_verdict_stops_once_it_is_settled_with_the_whole_run_s_answer() -> None:
    items = timed(synthetic(300, 400, 16, 0.5, 4, 320, 32000, seed=3), arrival_times(300, Shape(rate=1.0), seed=3))
    for rate, slo_s in ((20.0, 0.2), (400.0, 0.05), (400.0, 10.0)):
        fast = [dataclasses.replace(i, at_s=(i.at_s or 0.0) / rate) for i in items]
        whole = report.summarize(Fleet(one_each(), Linear(), fast).run().run, slo_s, 0.01)
        verdict = report.SloVerdict(len(fast), 0.9, slo_s, 0.01)
        fleet = Fleet(one_each(), Linear(), fast, verdict=verdict)
        result = fleet.run()
        assert result.decided is (whole["slo_attainment"] >= 0.9)
        num_ended = sum(f.done for f in fleet.flights.values())
        assert num_ended < len(items)  # settled before the last request: the rest never ran
        # one event settles it (a step's first tokens, a refusal's cascade may count several)
        assert verdict.num_met >= verdict.need if result.decided else verdict.num_missed > verdict.may_miss


def test_a_verdict_needs_what_the_summary_s_rounded_attainment_needs() -> None:
    for n in (1, 7, 100, 333, 1000, 4001):
        for target in (0.9, 0.95, 0.99, 0.5, 1.0):
            need = report.SloVerdict(n, target, 1.0, 1.0).need
            assert [report.attainment(k, n) >= target for k in range(n + 1)] == [k >= need for k in range(n + 1)]


def test_a_reservation_deferred_past_its_prefill_worker_s_stop_is_routed_again() -> None:
    """D reserves between its steps; a prefill worker the route named may have drained and
    stopped meanwhile (an autoscaled fleet): the request is routed again, as a router retries
    a failed prefill call, not handed to the stopped worker (where it would wait forever)."""
    items = [WorkloadRequest(list(range(3, 503)), 8, 0.0)]
    fleet = Fleet(FleetConfig(num_prefill=2, num_decode=1, num_blocks=1000, max_model_len=4096), Linear(), items)
    for w in fleet.workers.values():
        fleet._ready(w)
    d = next(w for w in fleet.workers.values() if w.role == "decode")
    d.busy = True  # mid-step: the reservation waits for the step's end
    fleet._arrive(0, items[0])
    [(reserve, f, _, p)] = d.calls
    named = fleet.workers[p]
    named.state = "draining"
    fleet._stop_if_drained(named)
    assert named.stopped_at is not None
    d.calls.clear()
    d.busy = False
    reserve(f, d, p)
    assert f.decision is not None and f.decision.prefill_worker != p
    assert not named.engine.has_work and fleet.workers[f.decision.prefill_worker].busy and f.rid in fleet.pushing
