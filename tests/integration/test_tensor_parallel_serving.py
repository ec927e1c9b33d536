"""Decode workers split across two processes (`serve --decode-tp 2 --mode colocated`): the
router, the worker (rank 0, the engine) and its child rank serve greedy tokens equal to the
whole model's; a child rank killed mid-stream takes its worker down (its engine's next
collective fails), the request goes on on the other worker with the same tokens, and the
controller replaces the dead worker; the workers' shutdown stops their child ranks."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.core.request import SamplingParams
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.reference import make_engine, random_prompts

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)


def spawned_ranks(parent: int | None = None) -> set[int]:
    """Processes started by multiprocessing's spawn (a split worker's child ranks), of `parent` if given."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                ppid = int(next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("PPid:")))
            except (OSError, StopIteration):
                continue
            if (b"multiprocessing.spawn" in cmdline or b"spawn_main" in cmdline) and parent in (None, ppid):
                out.add(int(pid))
    return out


def ranks_of(cluster: LocalCluster) -> set[int]:
    """The child ranks of `cluster`'s live workers (not another test's: split workers of another
    cluster may run beside this one)."""
    return set().union(*(spawned_ranks(w["pid"]) for w in cluster.workers() if w.get("pid") and not w.get("dead")))


def test_split_decode_workers_serve_the_whole_models_tokens_and_survive_a_lost_rank(tiny_llama_dir: str) -> None:
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=0, num_decode=2, decode_tp=2, worker_num_cpus=0.25,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="colocated")))
    prompts = random_prompts([9, 30, 70], 512, seed=4)
    engine = make_engine(tiny_llama_dir, block_size=16)
    want = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    long = engine.generate([prompts[0]], SamplingParams(max_tokens=600, ignore_eos=True))[0].token_ids
    with LocalCluster(config) as cluster:
        ranks = [spawned_ranks(w["pid"]) for w in cluster.workers() if w.get("role") == "decode"]
        assert [len(r) for r in ranks] == [1, 1]  # each worker's one child rank
        ours = set().union(*ranks)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for prompt, w in zip(prompts, want, strict=True):
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=10, ignore_eos=True, temperature=0))
                got = list(stub.Generate(request, timeout=120))
                assert [t for r in got for t in r.token_ids] == w.token_ids
                assert got[-1].route.local_prefill
            stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[0]), sampling=pb.SamplingParams(
                max_tokens=600, ignore_eos=True, temperature=0)), timeout=300)
            head = next(stream)
            victim = head.route.decode_worker
            [pid] = [w["pid"] for w in cluster.workers() if w["worker_id"] == victim]
            [rank] = spawned_ranks(pid)
            os.kill(rank, signal.SIGKILL)
            rest = list(stream)
        assert [t for r in [head, *rest] for t in r.token_ids] == long
        assert rest[-1].route.decode_worker not in ("", victim)
        deadline = time.monotonic() + 180
        while True:  # the dead worker is replaced by a new one, split as it was
            serving = [w for w in cluster.workers() if w.get("role") == "decode" and w.get("worker_id") != victim
                       and not w.get("dead")]
            if len(serving) == 2:
                break
            assert time.monotonic() < deadline, serving
            time.sleep(1)
        ours |= ranks_of(cluster)  # the replacement's rank too
        assert_idle(cluster)
    deadline = time.monotonic() + 30
    while ours & spawned_ranks():
        assert time.monotonic() < deadline, "the child rank outlived its worker"
        time.sleep(0.5)


def test_a_split_prefill_worker_pushes_every_ranks_heads_to_a_whole_decode_worker(tiny_llama_dir: str) -> None:
    """`serve --prefill-tp 2 --mode disaggregated`: each prompt is prefilled by a worker split
    in two, whose ranks push their KV heads from their own pools into the decode worker's one
    pool; the tokens are the whole model's, and nothing is held afterwards."""
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, prefill_tp=2, worker_num_cpus=0.25,
        router=RouterConfig(port=0, routing=RoutingConfig(mode="disaggregated")))
    prompts = random_prompts([9, 30, 70], 512, seed=5)
    engine = make_engine(tiny_llama_dir, block_size=16)
    want = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    with LocalCluster(config) as cluster:
        [prefill] = [w for w in cluster.workers() if w.get("role") == "prefill"]
        ours = spawned_ranks(prefill["pid"])
        assert len(ours) == 1  # the prefill worker's one child rank
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for prompt, w in zip(prompts, want, strict=True):
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=10, ignore_eos=True, temperature=0))
                got = list(stub.Generate(request, timeout=120))
                assert [t for r in got for t in r.token_ids] == w.token_ids
                assert not got[-1].route.local_prefill and got[-1].route.prefill_worker == prefill["worker_id"]
        assert_idle(cluster)
    deadline = time.monotonic() + 30
    while ours & spawned_ranks():
        assert time.monotonic() < deadline, "the child rank outlived its worker"
        time.sleep(0.5)
