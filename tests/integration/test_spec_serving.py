"""Speculative decoding (ngram) on the decode pool of a real local cluster (Ray actors,
redis-server, gRPC on loopback): greedy tokens through prefill -> transfer -> speculating
decode equal the monolithic engine's without speculation, the decode workers' Prometheus
counters say it speculated, and a drain or a kill of a speculating decode worker mid-stream
(the router continuing elsewhere from the tokens streamed) changes no token and leaves every
block free. The tests share one cluster and run in order."""
from __future__ import annotations

import concurrent.futures
import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.config import SpeculativeConfig
from proto import generate_pb2 as pb
from router.policy import RoutingConfig
from tests.integration.cluster_checks import generate, greedy, tokens, wait_for

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=3.0,
                            # unpriced: proposals by acceptance alone, not by step times a loaded machine skews
                            # (a CI run saw the priced policy propose nothing that stuck: no message of 2+ tokens)
                            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1,
                                                          priced=False)),
        num_prefill=1, num_decode=2,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")),
        worker_num_cpus=0.25, supervise_interval_s=0.5, drain_timeout_s=20.0, replace_dead_workers=False)
    with LocalCluster(config) as c:
        yield c


def copying_prompt(seed: int, length: int = 24, repeats: int = 3) -> list[int]:
    """A random run of tokens said `repeats` times: what prompt lookup guesses well."""
    rng = random.Random(seed)
    run = [rng.randrange(3, 500) for _ in range(length)]
    return run * repeats


def serving_decode(cluster: LocalCluster) -> list[str]:
    return sorted(w for w, s in cluster.controller_status()["workers"].items() if w.startswith("decode") and s == "serving")


def spec_counts(cluster: LocalCluster) -> tuple[float, float]:
    """Proposed and accepted tokens, summed over the live decode workers' /metrics."""
    proposed = accepted = 0.0
    for w in cluster.workers():
        if w["role"] != "decode" or not w.get("metrics_address"):
            continue
        text = urllib.request.urlopen(f"http://{w['metrics_address']}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                proposed += s.value if s.name == "splitserve:spec_decode_num_draft_tokens_total" else 0
                accepted += s.value if s.name == "splitserve:spec_decode_num_accepted_tokens_total" else 0
    return proposed, accepted


def test_greedy_tokens_through_the_speculating_decode_pool_equal_the_monolithic_engine(  # type: ignore[no-untyped-def]
        cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:
    prompts = [copying_prompt(i, 16 + 4 * i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(stub, p, 80), prompts))
    for p, got in zip(prompts, results, strict=True):
        assert tokens(got) == greedy(tiny_llama_dir, p, 80)
    # accepted proposals arrive several to a message
    assert any(len(r.token_ids) > 1 for got in results for r in got[1:])
    proposed, accepted = wait_for("the counters", lambda: (c := spec_counts(cluster))[1] and c)
    assert proposed >= accepted > 0
    wait_for("every block back", lambda: not cluster.holdings(), 20)


def test_a_drain_of_a_speculating_decode_worker_changes_no_token(  # type: ignore[no-untyped-def]
        cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:
    prompts = [copying_prompt(10 + i) for i in range(4)]
    cluster.scale("decode", 2)  # whatever ran before: two decode workers, one to drain
    wait_for("two decode workers", lambda: len(serving_decode(cluster)) == 2, 120)
    both = set(serving_decode(cluster))
    wait_for("the routers see both", lambda: all(both <= set(s["serving"]["decode"]) for s in cluster.router_stats()),
             10)
    drains = len(cluster.controller_status()["drains"])
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, stub, p, 400) for p in prompts]
        wait_for("every request streaming", lambda: cluster.router_stats()[0]["num_admitted"] == len(prompts), 30)
        cluster.scale("decode", 1)
        results = [f.result() for f in futures]
    for p, got in zip(prompts, results, strict=True):
        assert tokens(got) == greedy(tiny_llama_dir, p, 400)
    wait_for("the drain to finish", lambda: cluster.controller_status()["drains"][drains:], 60)
    assert len(serving_decode(cluster)) == 1
    wait_for("every block back", lambda: not cluster.holdings(), 20)


def test_a_speculating_decode_worker_killed_mid_stream_changes_no_token(  # type: ignore[no-untyped-def]
        cluster: LocalCluster, stub, tiny_llama_dir: str) -> None:
    cluster.scale("decode", 2)
    wait_for("a second decode worker", lambda: len(serving_decode(cluster)) == 2, 120)
    new = set(serving_decode(cluster))
    wait_for("the routers see both", lambda: all(new <= set(s["members"]) for s in cluster.router_stats()), 10)
    prompt = copying_prompt(20, 32)
    stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                              sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True)), timeout=120)
    retries_before = cluster.router_stats()[0]["num_retries"]
    head = [next(stream) for _ in range(3)]
    victim = head[0].route.decode_worker
    assert victim.startswith("decode-")
    cluster.kill_worker(victim)
    rest = list(stream)
    assert tokens([*head, *rest]) == greedy(tiny_llama_dir, prompt, 600)
    assert rest[-1].route.decode_worker not in ("", victim)
    assert cluster.router_stats()[0]["num_retries"] == retries_before + 1  # killed mid-stream: continued elsewhere
    wait_for("every live block back", lambda: not cluster.holdings(), 30)


def test_on_the_embedded_real_model_greedy_tokens_are_identical_with_each_proposer(  # type: ignore[no-untyped-def]
        smollm2_dir: str, tmp_path) -> None:
    """No cluster: the engine alone, a mixed batch (a long prompt prefilled in chunks beside the
    others' decodes), speculation off, ngram, and a 2-layer draft of the model itself."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.core.request import SamplingParams
    from engine.model.tiny_model import make_draft_model
    from router.chat_template import ChatTemplate

    template = ChatTemplate.load(smollm2_dir)
    assert template is not None
    text = "Splitserve moves the KV cache from prefill workers to decode workers over kvfabric. "
    prompts = [template.render([{"role": "user", "content": c}]) for c in (
        "Repeat this exactly: " + text * 2, "Count from one to twenty in words.", "Fix the typos: " + text * 4)]
    draft = str(make_draft_model(smollm2_dir, tmp_path / "draft", 2))

    def run(spec: SpeculativeConfig) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model_dir=smollm2_dir, detokenize=False, speculative=spec,
                                        cache=CacheConfig(kv_cache_bytes=64 * 2**20),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64)))
        return [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=16))], engine

    want, _ = run(SpeculativeConfig())
    for spec in (SpeculativeConfig(method="ngram"), SpeculativeConfig(method="draft", draft_model_dir=draft)):
        got, engine = run(spec)
        assert got == want, spec.method
        assert engine.speculator is not None and engine.speculator.counters.num_draft_tokens > 0
        assert engine.check_invariants().num_in_use == 0
