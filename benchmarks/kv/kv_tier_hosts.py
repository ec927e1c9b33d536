"""The conversation trace of benchmarks/kv/kv_tier_trace.py replayed on one host and on two, with
and without the shared KV tier.

    ./dev python -m benchmarks.kv.kv_tier_hosts [--size tiny|small] [--conversations 24] [--turns 5]
        [--pool-mib 18] [--store-mib 64] [--concurrency 2]      (root: network namespaces)

Hosts are network namespaces with hostnames of their own (benchmarks/serving/separate_hosts.py),
sharing the machine's /dev/shm as the processes of a real host do: a worker and the store of
its host move blocks over shm, a worker and another host's store over tcp. Two decode workers
(colocated: each prefills its own turns), `splitserve worker` processes with pools of
`--pool-mib`, and a router on this machine. Four arms:
  1 host   both workers on one host, with its store (tier on) or none
  2 hosts  a worker and a store on each host: a turn the router sends to the other host's
           worker (for load) is fetched from the first host's store over tcp, as the
           router's hint says (remote_store_fetch_cost), or computed
One JSON line per arm (hit rate, prefill tokens computed, TTFT p50/p99, blocks fetched from
the stores, of those over tcp from another host), then the ratios of each tier arm to the
arm without it on as many hosts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from benchmarks.kv.kv_tier_trace import BLOCK, conversation_trace, ratios, replay_row
from benchmarks.serving.separate_hosts import SUBNET, Hosts, namespaces, scrape, unavailable

NAMESPACE = "hosts"


def serving(made: Hosts, n: int, timeout_s: float = 120.0) -> None:
    """Waits until `n` workers' heartbeats say serving."""
    from control.reader import RegistryReader

    async def count() -> int:
        reader = RegistryReader(made.redis_url("127.0.0.1"), NAMESPACE)
        try:
            return sum(hb.state == "serving" for hb in (await reader.heartbeats()).values())
        finally:
            await reader.close()
    deadline = time.monotonic() + timeout_s
    while asyncio.run(count()) < n:
        assert time.monotonic() < deadline, f"fewer than {n} workers serving after {timeout_s} s"
        time.sleep(0.5)


def arm(model_dir: str, trace: Path, n: int, num_hosts: int, pool_mib: int, store_mib: int, concurrency: int,
        tmp: Path) -> dict:
    from loadgen.runner import run
    from loadgen.workload import from_trace

    items = [type(it)(it.prompt, min(it.max_tokens, 4), None) for it in from_trace(trace, n, BLOCK, 4096, 500, 0.0)]
    names = ("p", "d")[:num_hosts]
    placement = {"decode-0": "p", "decode-1": names[-1]}
    with namespaces(names) as hosts:
        made = Hosts(hosts, model_dir, tmp, kv_cache_mib=pool_mib, private_shm=False)
        try:
            via = {name: f"{SUBNET}.{i}.1" for i, name in enumerate(names, start=1)}
            for name in names if store_mib else ():
                made.start(name, ["kv-store", "--redis-url", made.redis_url(via[name]), "--namespace", NAMESPACE,
                                  "--model", model_dir, "--kv-store-mib", str(store_mib), "--host", "0.0.0.0"])
            for worker_id, name in placement.items():
                made.start(name, ["worker", "decode", "--worker-id", worker_id, "--redis-url",
                                  made.redis_url(via[name]), "--host", "0.0.0.0",
                                  *(["--kv-store", "local"] if store_mib else []), *made.common])
            serving(made, len(placement))
            address = made.start("router", ["router", "--redis-url", made.redis_url("127.0.0.1"), "--namespace",
                                            NAMESPACE, "--port", "0", "--mode", "colocated"])
            result = asyncio.run(run(address, items, concurrency=concurrency))
            fetched = far = 0.0
            for worker_id, name in placement.items():
                metrics = scrape(made.metrics_address(worker_id), hosts[name])
                for k, v in metrics.items():
                    name = k.split(",")[0]
                    fetched += v if name == "splitserve:kv_tier_fetched_blocks_total" else 0
                    far += v if name == "splitserve:kv_tier_far_fetched_blocks_total" else 0
        finally:
            made.stop()
    return {"bench": "kv_tier_hosts", "hosts": num_hosts, "tier": bool(store_mib), "requests": len(items),
            "pool_mib": pool_mib, "store_mib": store_mib, "concurrency": concurrency, **replay_row(result),
            "fetched_blocks": int(fetched), "far_fetched_blocks": int(far)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "small"), default="small")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--pool-mib", type=int, default=18, help="each worker's KV pool (small: 48 blocks of 16 tokens)")
    ap.add_argument("--store-mib", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    if (why := unavailable()) is not None:
        raise SystemExit(why)
    records = conversation_trace(args.conversations, args.turns)
    from engine.model.tiny_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / args.size, arch="llama", size=args.size, seed=0))
        trace = Path(tmp) / "conversations.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        for num_hosts in (1, 2):
            for mib in (0, args.store_mib):
                logs = Path(tmp) / f"logs-{num_hosts}-{mib}"
                logs.mkdir()
                row = {**arm(model_dir, trace, len(records), num_hosts, args.pool_mib, mib, args.concurrency, logs),
                       "size": args.size}
                print(json.dumps(row), flush=True)
                rows.append(row)
    for off, on in (rows[0:2], rows[2:4]):
        print(json.dumps({"bench": "kv_tier_hosts", "hosts": on["hosts"], **ratios(off, on)}), flush=True)


if __name__ == "__main__":
    main()
