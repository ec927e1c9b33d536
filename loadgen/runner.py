"""Sends a workload over gRPC, or over the OpenAI HTTP API (a target `http://HOST:PORT`), and
records what each request saw, from the client's side.

Arrivals: Poisson at a rate, a closed loop of N clients, or the items' own times (trace
replay). Each request becomes one `Outcome` (status, TTFT, every inter-token gap, end to
end, tokens, route); `on_change` is called after each send and each end, for the progress
display. Every call has a timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import grpc

from loadgen.report import CUT
from loadgen.workload import WorkloadRequest
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc


@dataclass
class Outcome:
    code: str = "OK"
    sent_s: float = 0.0
    """When it was sent, from the start of the run."""
    end_s: float = 0.0
    """When it ended (last token or error), from the start of the run."""
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_prompt: int = 0
    num_cached: int = 0
    num_out: int = 0
    route: str = ""
    """decode worker, then `<-prefill worker` or ` local`."""
    transfer_s: float = 0.0
    """The router's `Timing.transfer_ms`: the part of the KV transfer not hidden under the prefill."""
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (DistServe's TPOT); None for one token."""
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else None


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    elapsed_s: float = 0.0


async def one_grpc(stub: pb_grpc.GenerationStub, item: WorkloadRequest, timeout_s: float, start: float,
                   out: Outcome) -> None:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=item.prompt),
                             sampling=pb.SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
    last = final = None
    try:
        async for r in stub.Generate(req, timeout=timeout_s):
            now = time.perf_counter() - start
            if r.token_ids:
                if out.ttft_s is None:
                    out.ttft_s = now - out.sent_s
                elif last is not None:
                    out.itls_s += [(now - last) / len(r.token_ids)] * len(r.token_ids)
                last = now
            final = r
    except grpc.aio.AioRpcError as e:
        out.code, out.details = e.code().name, e.details() or ""
    out.end_s = time.perf_counter() - start
    if out.ok and (final is None or out.ttft_s is None):
        out.code, out.details = "EMPTY", "the stream ended without a token"
    elif out.ok and final is not None:
        out.num_prompt, out.num_cached = final.usage.prompt_tokens, final.usage.cached_tokens
        out.num_out, out.transfer_s = final.usage.completion_tokens, final.timing.transfer_ms / 1e3
        out.route = final.route.decode_worker + (f"<-{final.route.prefill_worker}" if final.route.prefill_worker
                                                 else " local")


async def one_http(session: aiohttp.ClientSession, url: str, item: WorkloadRequest, timeout_s: float, start: float,
                    out: Outcome) -> None:
    """The same request as `one_grpc`, as a streamed OpenAI completion (token ids in, token ids per chunk out)."""
    body = {"prompt": item.prompt, "max_tokens": item.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    last, usage = None, None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                error = (await response.json()).get("error", {})
                out.code, out.details = f"HTTP_{response.status}", str(error.get("message", ""))
            else:
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter() - start
                    if chunk.get("error"):
                        out.code, out.details = "STREAM_ERROR", str(chunk["error"].get("message"))
                    n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                    if n:
                        if out.ttft_s is None:
                            out.ttft_s = now - out.sent_s
                        elif last is not None:
                            out.itls_s += [(now - last) / n] * n
                        last = now
                    usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.code, out.details = type(e).__name__, str(e)
    out.end_s = time.perf_counter() - start
    if out.ok and (usage is None or out.ttft_s is None):
        out.code, out.details = "EMPTY", "the stream ended without a token"
    elif out.ok and usage is not None:
        out.num_prompt, out.num_out = usage["prompt_tokens"], usage["completion_tokens"]
        out.num_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def run(target: str, items: list[WorkloadRequest], rate: float | None = None, concurrency: int | None = None,
              seed: int = 0, timeout_s: float = 300.0, on_change: Callable[[Run], None] | None = None,
              duration_s: float | None = None) -> Run:
    """Runs the workload; with neither `rate` nor `concurrency`, items need their own times.
    `duration_s`: the run ends then, whatever is left: no request is sent after it, and those
    still streaming are cancelled and recorded as `CUT` (what ended is reported as ever)."""
    result = Run()
    notify = (lambda: on_change(result)) if on_change else (lambda: None)
    rng = random.Random(seed)
    http = target.startswith("http://")
    async with contextlib.AsyncExitStack() as stack:
        if http:
            session = await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0)))
            url = target.rstrip("/") + "/v1/completions"
        else:
            stub = pb_grpc.GenerationStub(await stack.enter_async_context(grpc.aio.insecure_channel(target)))
        start = time.perf_counter()

        end = math.inf if duration_s is None else start + duration_s

        async def send(item: WorkloadRequest) -> None:
            out = Outcome(sent_s=time.perf_counter() - start)
            result.outcomes.append(out)
            notify()
            try:
                if http:
                    await one_http(session, url, item, timeout_s, start, out)
                else:
                    await one_grpc(stub, item, timeout_s, start, out)
            except asyncio.CancelledError:
                out.code, out.details, out.end_s = CUT, "still streaming when the run's duration ended", \
                    time.perf_counter() - start
                raise
            notify()

        tasks: list[asyncio.Task[None]] = []
        if concurrency:
            queue = list(reversed(items))

            async def client() -> None:
                while queue and time.perf_counter() < end:
                    await send(queue.pop())
            tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        else:
            t = 0.0
            for item in items:
                t = item.at_s if item.at_s is not None else t + (rng.expovariate(rate) if rate else 0.0)
                if start + t >= end:
                    break
                if (delay := start + t - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(item)))
        await _until(tasks, end)
        result.elapsed_s = time.perf_counter() - start
    return result


async def _until(tasks: list[asyncio.Task[None]], end: float) -> None:
    """Waits for the tasks, cancelling those still running at `end` (perf_counter time)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=None if end == math.inf else max(end - time.perf_counter(), 0.0))
    for task in pending:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            raise r
