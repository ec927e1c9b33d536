"""The router's front under hostile clients: how long its event loop stalls while each
hostile case runs (a 1 ms timer's lateness, max and p99, against the same timer idle), and
what an API key costs a request on each door.

    ./dev python -m benchmarks.hostile.front_hostile [--model DIR]

One JSON line per case. The HTTP server is the router's OpenAIServer with its generation
scripted (tests/integration/test_http_hostile.py's `Served`, on its own thread and loop);
the gRPC door is a grpc.aio server with and without `KeyCheck` in front of one streaming
method.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from collections.abc import Callable

import grpc

from loadgen.report import pct
from router.api_keys import ApiKeys, KeyCheck
from router.frontend import Frontend, ask_from_pb
from tests.integration.test_http_hostile import DEADLINES, FLOODS, Served, _refusal_s, closed_within, raw

KEY = "sk-bench-0123456789"


def lateness(served: Served, attack: Callable[[], None]) -> dict[str, float]:
    served.lateness = []
    t0 = time.perf_counter()
    attack()
    wall = time.perf_counter() - t0
    lat = sorted(served.lateness) or [0.0]
    return {"wall_s": round(wall, 3), "stall_max_ms": round(lat[-1] * 1e3, 2),
            "stall_p99_ms": round(pct(lat, 99) * 1e3, 3), "timer_samples": len(lat)}  # type: ignore[operator]


def idle() -> None:
    time.sleep(2.0)


def messages_16mib(served: Served) -> Callable[[], None]:
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 570_000}, separators=(",", ":")).encode()
    return lambda: [served.call("POST", "/v1/chat/completions", body) for _ in range(3)] and None


def huge_tokenize(served: Served) -> Callable[[], None]:
    return lambda: [served.call("POST", "/tokenize", {"prompt": "word " * 3_000_000}) for _ in range(3)] and None


def long_chat(served: Served) -> Callable[[], None]:
    """A chat the context admits but whose text is long: rendered and tokenized off the loop."""
    def run() -> None:
        served.members.facts = served.members.facts.__class__(**{**_facts(served), "max_model_len": 1 << 17})
        for _ in range(3):
            served.call("POST", "/tokenize", {"messages": [{"role": "user", "content": "word " * 700_000}]})
    return run


def _facts(served: Served) -> dict:
    f = served.members.facts
    return {k: getattr(f, k) for k in f.__struct_fields__}


def slowloris(served: Served) -> Callable[[], None]:
    def run() -> None:
        socks = [raw(served.port) for _ in range(200)]
        for _ in range(10):
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            time.sleep(0.2)
        for s in socks:
            closed_within(s, 0.01)
            s.close()
    return run


def idle_flood(served: Served) -> Callable[[], None]:
    def run() -> None:
        socks = [raw(served.port) for _ in range(10_000)]
        served.answers()
        for s in socks:
            s.close()
    return run


def ref_schema(served: Served, model: str) -> Callable[[], None]:
    """A 60 KB JSON schema whose 1,200 `$ref`s all name one large node, prepared on the
    server's loop as a gRPC request is (its check off the loop)."""
    from proto import generate_pb2 as pb
    from router.admission import AdmissionConfig
    from router.gate import AdmissionGate
    from router.members import Members
    from router.servicer import Generation
    from tests.unit.helpers import heartbeat

    big = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
        f"q{j}": {"type": "integer"} for j in range(4)}} for i in range(150)}}
    schema = json.dumps({"$defs": {"big": big}, "anyOf": [{"$ref": "#/$defs/big"}] * 1200}, separators=(",", ":"))
    members = Members()
    members.update({"d0": heartbeat("d0", "decode", address="10.0.0.1:1", model_id="m", block_size=16,
                                    vocab_size=1 << 16, max_model_len=4096, num_total_blocks=64)})
    service = Generation(Frontend(model), AdmissionGate(AdmissionConfig(), time.monotonic), None,  # type: ignore[arg-type]
                         members)

    def run() -> None:
        for i in range(3):  # a new schema each time (a refused or compiled one is cached)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
                max_tokens=2, constraint=pb.Constraint(kind="json_schema", value=schema.replace("p0", f"p0{i}"))))
            asyncio.run_coroutine_threadsafe(service.prepare(ask_from_pb(request)), served.loop).result(60)
        service.off_loop.close()
    return run


def floods(served: Served, config: dict) -> None:
    """Each of the test suite's floods (a list or map far past its limit): the refusal's time
    after the body's last byte, and the loop's worst stall meanwhile; one JSON line each."""
    facts = served.members.facts
    served.members.facts = facts.__class__(**{**_facts(served), "max_model_len": 64})
    for path, body, _ in FLOODS:
        data = json.dumps(body, separators=(",", ":")).encode().replace(b"\\\\u006f", b"\\u006f")
        served.lateness = []
        took, answer = _refusal_s(served.port, path, data)
        lat = max(served.lateness, default=0.0)
        print(json.dumps({"case": f"flood {path} {next(iter(body.keys() - {'prompt'}), 'prompt')}",
                          "body_bytes": len(data), "status": int(answer[9:12]), "refused_ms": round(took * 1e3, 2),
                          "stall_max_ms": round(lat * 1e3, 2), "config": config}), flush=True)
    served.members.facts = facts


def wrong_keys(served: Served) -> Callable[[], None]:
    return lambda: [served.call("GET", "/v1/models") for _ in range(1000)] and None


def http_request_cost(served: Served, n: int, key: str | None) -> float:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    t0 = time.perf_counter()
    for _ in range(n):
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
    conn.close()
    return (time.perf_counter() - t0) / n


def grpc_call_cost(n: int, keys: ApiKeys | None) -> float:
    async def echo(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield request

    async def run() -> float:
        server = grpc.aio.server(interceptors=[KeyCheck(keys)] if keys else None)
        handlers = {"Echo": grpc.unary_stream_rpc_method_handler(echo)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/bench.Echo/Echo")
            metadata = (("authorization", f"Bearer {KEY}"),) if keys else ()
            for _ in range(50):
                [_ async for _ in call(b"x", metadata=metadata)]
            t0 = time.perf_counter()
            for _ in range(n):
                [_ async for _ in call(b"x", metadata=metadata)]
            elapsed = time.perf_counter() - t0
        await server.stop(None)
        return elapsed / n

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="tokenizer and chat template directory (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    from cluster import default_model
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir

    model = str(resolve_model_dir(default_model.model_path(args.model)))
    config = {"model": model, "deadlines": DEADLINES.__dict__}
    served = Served(Frontend(model))
    try:
        for name, attack in (("idle", idle), ("messages_16mib", messages_16mib(served)),
                             ("huge_tokenize", huge_tokenize(served)), ("long_chat_off_loop", long_chat(served)),
                             ("slowloris_200", slowloris(served)), ("idle_connections_10000", idle_flood(served)),
                             ("ref_schema_60kb", ref_schema(served, model))):
            print(json.dumps({"case": name, **lateness(served, attack), "config": config}), flush=True)
        floods(served, config)
        served.members.facts = served.members.facts.__class__(**{**_facts(served), "max_model_len": 64})
        plain = statistics.median(http_request_cost(served, args.requests // 5, None) for _ in range(5))
    finally:
        served.close()
    keys = ApiKeys.parse([KEY, *(f"sk-other-{i:012d}" for i in range(9))])
    from router.http_guard import HttpGuard

    served = Served(Frontend(model), HttpGuard(keys, ("/health",), None))
    try:
        print(json.dumps({"case": "wrong_keys_1000", **lateness(served, wrong_keys(served)), "config": config}))
        keyed = statistics.median(http_request_cost(served, args.requests // 5, KEY) for _ in range(5))
    finally:
        served.close()
    t0 = time.perf_counter()
    for _ in range(100_000):
        keys.check(f"Bearer {KEY}")
    check_us = (time.perf_counter() - t0) / 100_000 * 1e6
    g_plain = statistics.median(grpc_call_cost(args.requests, None) for _ in range(3))
    g_keyed = statistics.median(grpc_call_cost(args.requests, keys) for _ in range(3))
    print(json.dumps({"case": "api_key_cost", "keys": len(keys.digests), "check_us": round(check_us, 2),
                      "http_request_ms": round(plain * 1e3, 3), "http_request_with_key_ms": round(keyed * 1e3, 3),
                      "http_ratio": round(keyed / plain, 3), "grpc_call_ms": round(g_plain * 1e3, 3),
                      "grpc_call_with_key_ms": round(g_keyed * 1e3, 3), "grpc_ratio": round(g_keyed / g_plain, 3),
                      "requests": args.requests}))


if __name__ == "__main__":
    socket.setdefaulttimeout(30)
    main()
