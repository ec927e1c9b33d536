"""Structured output on a real local cluster (Ray actors, redis-server, gRPC on loopback), the
tiny model: every constraint kind, greedy and sampled, through the colocated path (a short
prompt prefilled by the decode worker) and the disaggregated one (the prefill worker samples
the first token under the constraint, the decode worker continues it), each token for
token the monolithic engine's (greedy and seeded); a decode worker
killed mid-stream leaves output identical to the uninterrupted run; bad constraints are
INVALID_ARGUMENT before any work. The tests share one cluster and run in order."""
from __future__ import annotations

import json
import random
import re

import grpc
import jsonschema
import openai
import pytest

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.local import LocalCluster
from engine.llm_engine import LLMEngine
from engine.core.request import Constraint, SamplingParams
from proto import generate_pb2 as pb
from router.policy import RoutingConfig
from tests.integration.cluster_checks import wait_for
from tests.integration.reference import make_engine

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)

LOCAL_PREFILL_TOKENS = 16

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}
GRAMMAR = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]{1,2}/'
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-f]{3}-[0-9]{2,4}"


def valid(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        if kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text) is not None  # GRAMMAR's language


CONSTRAINTS = {"json_schema": json.dumps(SCHEMA), "json_object": "", "regex": REGEX, "choice": json.dumps(CHOICES),
               "grammar": GRAMMAR}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str):  # type: ignore[no-untyped-def]
    config = ClusterConfig(
        worker=WorkerConfig(model_dir=tiny_llama_dir, block_size=16, kv_cache_bytes=8 * 2**20, step_profile_s=0,
                            kv_lease_s=3.0),
        num_prefill=1, num_decode=2,
        router=RouterConfig(port=0, http_port=0, tokenizer_dir=tiny_llama_dir,
                            routing=RoutingConfig(mode="auto", local_prefill_tokens=LOCAL_PREFILL_TOKENS)),
        worker_num_cpus=0.25, replace_dead_workers=False)
    with LocalCluster(config) as c:
        yield c


def request(prompt: list[int], kind: str, max_tokens: int = 120, temperature: float = 0.0,
            seed: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 constraint=pb.Constraint(kind=kind, value=CONSTRAINTS.get(kind, "")))
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> LLMEngine:
    """The monolithic engine the cluster's outputs must equal."""
    return make_engine(tiny_llama_dir, block_size=16)


def monolithic(engine: LLMEngine, prompt: list[int], kind: str, temperature: float, seed: int | None) -> list[int]:
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                            constraint=Constraint(kind, CONSTRAINTS.get(kind, "")))
    return engine.generate([prompt], params)[0].token_ids


def run(stub, req: pb.GenerateRequest) -> tuple[str, list[pb.GenerateResponse]]:  # type: ignore[no-untyped-def]
    got = list(stub.Generate(req, timeout=120))
    return "".join(r.text for r in got), got


@pytest.mark.parametrize("kind", [k for k in CONSTRAINTS if k != "json_object"])  # a random model writes a
# free-form object's keys for ever: json_object runs on the real model (test_openai_api.py)
def test_every_output_follows_its_constraint_on_both_paths_greedy_and_sampled(cluster: LocalCluster, stub,  # type: ignore[no-untyped-def]
                                                                             kind: str, engine: LLMEngine) -> None:
    rng = random.Random(1000 + list(CONSTRAINTS).index(kind))  # distinct prompts per kind: no cached prefix
    remote = {"colocated": [], "disaggregated": []}  # type: dict[str, list[bool]]
    for length, path in ((6, "colocated"), (40, "disaggregated")):
        for temperature, seed in ((0.0, None), (1.0, 7), (1.0, 8)):
            if path == "disaggregated":  # a router that misses a heartbeat prefills locally: wait for P
                wait_for("the prefill worker", lambda: any(w.startswith("prefill") for s in cluster.router_stats()
                                                           for w in s["members"]), 30)
            prompt = [rng.randrange(3, 500) for _ in range(length)]
            text, got = run(stub, request(prompt, kind, temperature=temperature, seed=seed))
            assert got[-1].finish_reason == pb.FINISH_REASON_STOP, (kind, path, text)  # complete, not cut
            assert valid(kind, text), (kind, path, text)
            # token for token the monolithic engine's, the KV moved through kvfabric or not
            assert [t for r in got for t in r.token_ids] == monolithic(engine, prompt, kind, temperature, seed), \
                (kind, path, temperature, seed)
            remote[path].append(bool(got[0].route.prefill_worker))
    # short prompts never leave the decode worker; long ones went through the prefill worker
    # (a heartbeat missed under load may still route one of them locally: that is routing, not this test)
    assert not any(remote["colocated"]) and any(remote["disaggregated"]), remote


def test_a_decode_worker_killed_mid_stream_leaves_the_constrained_output_identical(  # type: ignore[no-untyped-def]
        cluster: LocalCluster, stub) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 120, "maxItems": 120}
    sampling = pb.SamplingParams(max_tokens=600, constraint=pb.Constraint(kind="json_schema", value=json.dumps(schema)))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[random.Random(3).randrange(3, 500) for _ in range(40)]),
                             sampling=sampling)
    want, _ = run(stub, req)
    jsonschema.validate(json.loads(want), schema)
    before = cluster.router_stats()[0]["num_retries"]
    stream = stub.Generate(req, timeout=120)
    head = [next(stream) for _ in range(3)]
    victim = head[0].route.decode_worker
    cluster.kill_worker(victim)
    rest = list(stream)
    assert "".join(r.text for r in [*head, *rest]) == want  # the retry continued the constraint from the sent tokens
    assert cluster.router_stats()[0]["num_retries"] == before + 1
    wait_for("every live block back", lambda: not cluster.holdings(), 30)


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("json_schema", '{"type": "strang"}', "Invalid type: strang"),
    ("json_schema", '{"type": "string", "if": {}}', "Unimplemented keys"),
    ("json_schema", "{not json", "the JSON schema is not JSON"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: nothing_defined", "unknown name"),
    ("grammar", 'root ::= "a" root', "no finite output: rule start cannot end"),
    ("json_schema", '{"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}',
     "no finite instance: # requires itself"),
    ("choice", "[]", "a choice is a non-empty list"),
    ("xml", "<a/>", "constraint kind must be one of"),
])
def test_a_bad_constraint_is_invalid_argument_before_any_work(cluster: LocalCluster, stub, kind: str,  # type: ignore[no-untyped-def]
                                                              value: str, message: str) -> None:
    sampling = pb.SamplingParams(max_tokens=8, constraint=pb.Constraint(kind=kind, value=value))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=sampling), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), e.value.details()
    assert cluster.router_stats()[0]["num_admitted"] == 0


def test_over_http_each_kind_follows_its_constraint_on_both_paths(cluster: LocalCluster) -> None:
    client = openai.OpenAI(base_url=f"http://{cluster.info['http_address']}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    asks = {"json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
            "regex": {"structured_outputs": {"regex": REGEX}}, "choice": {"guided_choice": CHOICES},
            "grammar": {"structured_outputs": {"grammar": GRAMMAR}}}
    rng = random.Random(9)
    for kind, extra in asks.items():
        for length in (6, 40):  # colocated, disaggregated
            for temperature in (0.0, 1.0):
                prompt = [rng.randrange(3, 500) for _ in range(length)]
                r = client.completions.create(model=model, prompt=prompt, max_tokens=120, temperature=temperature,
                                              seed=11, extra_body=extra)
                assert r.choices[0].finish_reason == "stop" and valid(kind, r.choices[0].text), (kind, r)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4,
                                  extra_body={"guided_regex": "a" * 70000})
    assert "at most 65536" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # a grammar that never terminates
        client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4,
                                  extra_body={"structured_outputs": {"grammar": 'start: "(" start ")"'}})
    assert e.value.status_code == 400 and "no finite output: rule start cannot end" in str(e.value)
