"""What n choices and log-probabilities cost, on a 1 prefill + 1 decode cluster (the embedded
SmolLM2-135M-Instruct, CPU, disaggregated), through the gRPC door, in one process.

- n: one request of --n choices against --n separate requests (seeds s .. s + n - 1, sent at
  once), alternating over --rounds: the prompt tokens the prefill worker computed and the KV
  bytes it pushed (its Prometheus counters before and after), the time to the first token
  of every choice (the slowest) and to the end (each round and arm on a prompt of its own, so
  no prefix-cache hit crosses them; that choice i draws as seed + i is the suite's to check).
- logprobs: decode tokens/s with `logprobs` (and 5 `top_logprobs`) on against off, at
  concurrency 1 and --concurrency, greedy, the same prompts, arms alternating.

One JSON line per arm and a ratio line per comparison.

    ./dev python benchmarks/engine/choices_logprobs.py [--n 8] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig  # noqa: E402
from cluster.default_model import model_path  # noqa: E402
from cluster.local import LocalCluster  # noqa: E402
from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402
from proto import generate_pb2 as pb  # noqa: E402
from proto import generate_pb2_grpc as pb_grpc  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402

PROMPT = ("You are a helpful assistant. Summarise the following in one sentence: the river ran through the old "
          "town, past the mill and the church, under three bridges, and out to the sea, where the fishermen "
          "waited for the tide. ") * 3


def counters(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def prefill_work(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens computed (queried less hit) and KV bytes pushed between two scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = sum(v for k, v in d.items() if "prefix_cache_queries" in k and k.endswith("_total"))
    hits = sum(v for k, v in d.items() if "prefix_cache_hits" in k and k.endswith("_total"))
    pushed = sum(v for k, v in d.items() if "kv_transfer_bytes" in k and k.endswith("_total"))
    return {"prompt_tokens_computed": queries - hits, "kv_bytes_pushed": pushed}


def generate(stub: Any, sampling: pb.SamplingParams, text: str = PROMPT) -> tuple[dict[int, list[int]], float, float]:
    """Tokens by choice, the seconds to the last choice's first token, and to the end."""
    began = time.perf_counter()
    first: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    for r in stub.Generate(pb.GenerateRequest(text=text, sampling=sampling), timeout=300):
        if r.token_ids and r.choice not in first:
            first[r.choice] = time.perf_counter() - began
        tokens.setdefault(r.choice, []).extend(r.token_ids)
    return tokens, max(first.values()), time.perf_counter() - began


def n_round(stub: Any, prefill_metrics: str, n: int, seed: int, arm: str, max_tokens: int, text: str
            ) -> dict[str, Any]:
    before = counters(prefill_metrics)
    began = time.perf_counter()
    if arm == "n":
        tokens, ttft, _ = generate(stub, pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n,
                                                           ignore_eos=True), text)
        choices = [tokens[i] for i in range(n)]
    else:
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda i: generate(stub, pb.SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True), text), range(n)))
        choices, ttft = [r[0][0] for r in runs], max(r[1] for r in runs)
    took = time.perf_counter() - began
    time.sleep(1.0)  # the push's counters land as each hand-off ends
    return {"arm": arm, "ttft_s": round(ttft, 3), "total_s": round(took, 3),
            **prefill_work(before, counters(prefill_metrics)), "choices": choices}


def decode_rate(stub: Any, concurrency: int, logprobs: bool, max_tokens: int, rounds: int) -> float:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                                 top_logprobs=5 if logprobs else 0)
    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: generate(stub, sampling, f"{i} {PROMPT}"), range(concurrency * rounds)))
    return concurrency * rounds * max_tokens / (time.perf_counter() - began)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    model = model_path(None)
    config = ClusterConfig(worker=WorkerConfig(model_dir=model, block_size=16, kv_cache_bytes=256 * 2**20),
                           num_prefill=1, num_decode=1,
                           router=RouterConfig(port=0, tokenizer_dir=str(resolve_model_dir(model)),
                                               routing=RoutingConfig(mode="disaggregated")))
    conf = {"bench": "choices_logprobs", "model": "SmolLM2-135M-Instruct Q4_1 as float32", "cpu": True,
            "cluster": "1 prefill + 1 decode, disaggregated", **vars(args)}
    with LocalCluster(config) as cluster:
        prefill_metrics = next(w["metrics_address"] for w in cluster.workers() if w["role"] == "prefill")
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            generate(stub, pb.SamplingParams(max_tokens=4))  # warm-up
            results: dict[str, list[dict[str, Any]]] = {"n": [], "separate": []}
            for r in range(args.rounds):
                for arm in (("n", "separate") if r % 2 == 0 else ("separate", "n")):
                    # a fresh prompt per round and arm: no prefix-cache hit between them
                    res = n_round(stub, prefill_metrics, args.n, 1000 * r, arm, args.max_tokens, f"[{r}-{arm}] {PROMPT}")
                    results[arm].append(res)
                    print(json.dumps({**conf, "round": r, **{k: v for k, v in res.items() if k != "choices"}}),
                          flush=True)
            med = {arm: {k: statistics.median(x[k] for x in rs) for k in ("ttft_s", "total_s", "prompt_tokens_computed",
                                                                         "kv_bytes_pushed")}
                   for arm, rs in results.items()}
            print(json.dumps({**conf, "compare": f"n={args.n} / {args.n} separate requests (medians)",
                              **{k: round(med["n"][k] / med["separate"][k], 3) if med["separate"][k] else None
                                 for k in med["n"]}, "n_arm": med["n"], "separate_arm": med["separate"]}), flush=True)
            rates: dict[tuple[int, bool], list[float]] = {}
            for r in range(args.rounds):
                for c in (1, args.concurrency):
                    for lp in ((False, True) if r % 2 == 0 else (True, False)):
                        rates.setdefault((c, lp), []).append(decode_rate(stub, c, lp, args.max_tokens, 1))
            for c in (1, args.concurrency):
                on, off = statistics.median(rates[(c, True)]), statistics.median(rates[(c, False)])
                print(json.dumps({**conf, "compare": "logprobs + 5 top_logprobs on / off", "concurrency": c,
                                  "tokens_per_s_on": round(on, 1), "tokens_per_s_off": round(off, 1),
                                  "ratio": round(on / off, 3)}), flush=True)


if __name__ == "__main__":
    main()
