"""Ordinary chats at once on the out-of-the-box cluster, admission charging the expected
output against charging max_tokens (issue 47).

For each `--admission-charge` arm (expected, max) one local cluster as `splitserve serve`
starts it on CPU: the embedded default model, 1 prefill + 1 decode worker, the KV pool an
engine gets by default (256 MiB: 5,825 tokens of this model), the default admission. Then
--waves waves of --concurrency chats without max_tokens (the OpenAI default), each wave sent
at once through the `openai` client and waited for (streamed, so the first token is timed).
Per arm, one JSON line: served, refused (429), goodput (served chats a second), TTFT p50 and
p99 of the served, and the router's peak KV tokens charged and really used.

    ./dev python benchmarks/serving/chat_burst.py [--concurrency 8] [--waves 3]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import threading
import time
from typing import Any

QUESTIONS = ["What is the capital of France?", "Name a fruit.", "What color is the sky?", "Say hello.",
             "What is 2 + 2?", "Name a planet.", "What is the capital of Italy?", "Name an ocean."]


def chat(client: Any, model: str, question: str) -> tuple[bool, float | None, int]:
    """(served, time to first token, output tokens) of one streamed chat."""
    import openai

    began = time.perf_counter()
    ttft, tokens = None, 0
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - began
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.RateLimitError:
        return False, None, 0
    return True, ttft, tokens


def arm(charge: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    from loadgen.report import pct
    from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
    from cluster.default_model import model_path
    from cluster.local import LocalCluster
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from router.admission import AdmissionConfig

    gguf = model_path(None)
    config = ClusterConfig(worker=WorkerConfig(model_dir=gguf), num_prefill=1, num_decode=1, worker_num_cpus=0.5,
                           router=RouterConfig(port=0, http_port=0, served_model_name="m",
                                               tokenizer_dir=str(resolve_model_dir(gguf)),
                                               admission=AdmissionConfig(charge_output=charge)))
    peak = {"charged": 0, "used": 0, "budget": 0}
    with LocalCluster(config) as cluster:
        client = openai.OpenAI(base_url=f"http://{cluster.info['http_address']}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.1):
                for s in cluster.router_stats():
                    peak["charged"] = max(peak["charged"], int(s.get("inflight_tokens") or 0))
                    peak["used"] = max(peak["used"], int(s.get("used_tokens") or 0))
                    peak["budget"] = max(peak["budget"], int(s.get("budget_tokens") or 0))

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        results: list[tuple[bool, float | None, int]] = []
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for w in range(args.waves):
                questions = [QUESTIONS[(w + i) % len(QUESTIONS)] for i in range(args.concurrency)]
                results += list(pool.map(lambda q: chat(client, "m", q), questions))
        elapsed = time.perf_counter() - began
        stop.set()
        watcher.join(timeout=5)
    served = [r for r in results if r[0]]
    ttfts = sorted(t for _, t, _ in served if t is not None)

    def p(q: int) -> float | None:
        x = pct(ttfts, q)
        return None if x is None else round(x, 3)

    return {"bench": "chat_burst", "admission_charge": charge, "concurrency": args.concurrency, "waves": args.waves,
            "served": len(served), "refused": len(results) - len(served),
            "goodput_per_s": round(len(served) / elapsed, 2), "ttft_p50_s": p(50), "ttft_p99_s": p(99),
            "mean_output_tokens": round(sum(n for *_, n in served) / max(len(served), 1), 1),
            "peak_charged_tokens": peak["charged"], "peak_used_tokens": peak["used"], "budget_tokens": peak["budget"],
            "elapsed_s": round(elapsed, 1),
            "cluster": "embedded SmolLM2-135M, 1 prefill + 1 decode, default KV pool and admission, CPU"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8, help="chats sent at once in each wave")
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--arms", nargs="*", default=["max", "expected"], choices=["max", "expected"])
    args = ap.parse_args()
    for charge in args.arms:
        print(json.dumps(arm(charge, args)), flush=True)


if __name__ == "__main__":
    main()
