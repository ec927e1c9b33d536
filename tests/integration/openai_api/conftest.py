"""The cluster the OpenAI API tests share, one per test module: the embedded default model
(SmolLM2-135M-Instruct from its GGUF file), a real cluster (Ray actors, redis-server), 1
prefill + 1 decode worker in mode disaggregated, so every request goes router -> prefill ->
kvfabric -> decode. After every test nothing is held on any worker or router."""
from __future__ import annotations

import grpc
import openai
import pytest
import torch

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from proto import generate_pb2_grpc as pb_grpc
from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from tests.integration.cluster_checks import assert_idle
from tests.integration.openai_api.calls import MODEL


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: str, smollm2_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=smollm2_gguf, block_size=16, kv_cache_bytes=64 * 2**20, step_profile_s=0),
        num_prefill=1, num_decode=1, worker_num_cpus=0.5,
        router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=smollm2_dir,
                            routing=RoutingConfig(mode="disaggregated"),
                            # charged the worst case, one long request holds the budget (the overload test)
                            # a queue wait limit no loaded machine's forecast reaches: the overload test's
                            # queued request waits behind a 1,200-token one, however slow the steps (300 s
                            # was reached with the suite on three xdist workers on 2 cores: 0.25 s a token),
                            # nor the request deadline that also bounds it (ci14's forecast passed 600 s)
                            admission=AdmissionConfig(max_queued_per_priority=1, max_queue_wait_s=3600.0,
                                                      charge_output="max"),
                            request_timeout_s=3600.0))
    with LocalCluster(config) as c:
        yield c


@pytest.fixture
def base(cluster: LocalCluster) -> str:  # type: ignore[misc]
    yield f"http://{cluster.info['http_address']}"
    assert_idle(cluster)


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_dir: str):  # type: ignore[no-untyped-def]
    """transformers on the GGUF file's weights as transformers dequantizes them (float32): the
    reference. Read from the converted directory, which holds exactly transformers' reading of
    the file (`_convert` saves its state dict; the tensors are equal): the file itself takes
    transformers about 25 CPU-seconds to parse and dequantize, the directory under one."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
