"""What the OpenAI API tests call: the served model's name, a question, a JSON POST, a gRPC
Generate."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from proto import generate_pb2 as pb

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post(base: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def open_stream(http_address: str, path: str, body: dict,
                timeout: float = 60) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POSTs `body` with `"stream": true` to the router's HTTP door at `http_address` (host:port):
    the connection (the caller closes it) and its response, the head read, the body not."""
    conn = http.client.HTTPConnection(*http_address.split(":"), timeout=timeout)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def grpc_generate(stub, prompt: str | list[int], **sampling) -> tuple[str, list[int], pb.GenerateResponse]:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], responses[-1]
