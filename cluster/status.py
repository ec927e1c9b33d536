"""`splitserve status`: a running cluster's state, read from its Redis."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import msgspec

from cluster.processes import redacted
from control.router_stats import ControllerStatus, RouterStats


def show_status(args: argparse.Namespace, cluster_redis: Callable[[argparse.Namespace], tuple[str | None, str]]) -> int:
    """`splitserve status`: pools, the controller's last actions, workers, routers."""
    import asyncio

    from control.reader import read_cluster

    redis_url, namespace = cluster_redis(args)
    if redis_url is None:
        return 2
    try:
        beats, routers, controller = asyncio.run(read_cluster(redis_url, namespace))
    except Exception as e:  # noqa: BLE001 - any Redis failure is reported, not raised
        from cluster import daemon

        if args.redis_url is None and daemon.running_pid() is None:  # the last serve's record, and no serve runs
            print(f"no cluster is running here: the last `splitserve serve` has stopped (its Redis at "
                  f"{redacted(redis_url)} does not answer). Start one with `splitserve serve`, or name another "
                  "cluster's with --redis-url.", file=sys.stderr)
            return 1
        print(f"Redis at {redacted(redis_url)} is away ({e}): the cluster's state cannot be read now. Routers keep "
              "serving on the membership they last saw; an embedded Redis is started again by its cluster.",
              file=sys.stderr)
        return 1
    from kvstore.host import read_stores

    try:
        stores = read_stores(redis_url, namespace)
    except Exception:  # noqa: BLE001 - the stores' entries are extra: status goes on without them
        stores = []
    if args.json:
        print(json.dumps({"workers": {w: msgspec.to_builtins(b) for w, b in beats.items()},
                          "routers": msgspec.to_builtins(routers), "controller": msgspec.to_builtins(controller),
                          "kv_stores": stores}, default=str))
        return 0
    if controller is not None:
        print_pools(controller)
    print_workers(beats)
    print_routers(routers)
    print_stores(stores)
    print_tier_speeds(beats)
    if controller is None:
        print("controller: not reporting (its state expired): the cluster is down or starting; `serve`'s console "
              "says which")
    if not beats and not routers:
        print("no workers or routers are reporting (is the cluster running?)")
    return 0


def print_pools(controller: ControllerStatus) -> None:
    """Each pool's target and serving workers, the autoscaler's decision and last actions."""
    for role in ("prefill", "decode"):
        states = sorted(f"{w} {s}" for w, s in controller.workers.items() if w.startswith(role))
        print(f"{role} pool: target {controller.targets.get(role, 0)}, "
              f"{sum(1 for s in states if s.endswith(' serving'))} serving"
              + (f" ({', '.join(states)})" if states else ""))
    if controller.decision:
        print(f"autoscaler: {controller.decision}")
    for action in controller.actions[-3:]:
        print(f"  {action}")


def print_workers(beats: dict) -> None:
    """One row per worker: its state, queue, KV use, prefix hits and speculation."""
    print(f"{'worker':<12}{'role':<9}{'state':<10}{'address':<22}{'running':>8}{'waiting':>8}{'queued tok':>11}"
          f"{'KV used':>16}{'prefix hit':>11}{'spec accepted':>22}")
    for w, hb in sorted(beats.items()):
        b = hb.load
        used = b.num_total_blocks - b.num_free_blocks - b.num_cached_blocks
        hit = b.num_cached_tokens / b.num_prompt_tokens if b.num_prompt_tokens else 0.0
        kv = f"{used}/{b.num_total_blocks} ({used / max(b.num_total_blocks, 1):.0%})"
        spec = (f"{b.spec_num_accepted_tokens}/{b.spec_num_draft_tokens} "
                f"({b.spec_num_accepted_tokens / b.spec_num_draft_tokens:.0%})" if b.spec_num_draft_tokens else "-")
        print(f"{w:<12}{hb.role:<9}{hb.state:<10}{hb.address:<22}{b.num_running:>8}{b.num_waiting:>8}"
              f"{b.queued_prefill_tokens:>11}{kv:>16}{hit:>11.0%}{spec:>22}")


def print_routers(routers: dict[str, RouterStats]) -> None:
    """One line per router: admission, KV charged against its budget, outcomes, its feed."""
    for rid, s in sorted(routers.items()):
        hit = s.num_cached_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0
        print(f"{rid} on {s.address}: {s.num_admitted} running, {s.num_queued} queued {s.queued_by_priority}, "
              f"KV tokens charged {s.inflight_tokens:.0f} / used {s.used_tokens:.0f} of a budget of "
              f"{s.budget_tokens:.0f}, {s.num_requests} done, {s.num_refused} refused, {s.num_invalid} invalid, "
              f"{s.num_retries} retried, prefix hit rate {hit:.0%}, Redis feed {'up' if s.redis_healthy else 'DOWN'}"
              + (f", workers down: {', '.join(s.down_workers)}" if s.down_workers else ""))


def print_tier_speeds(beats: dict) -> None:
    """One line per worker with a KV tier: what its fetches took against computing the same
    blocks (what routers price its store hits by)."""
    for w, hb in sorted(beats.items()):
        if not hb.kv_store:
            continue
        s, block_s = hb.tier_speed, hb.tier_speed.token_s * hb.facts.block_size
        fetches = [f"{line[0] * 1e3:.1f} ms + {line[1] * 1e3:.2f} ms a block from {where}"
                   for where, line in (("its host's store", s.fetch), ("other hosts'", s.far_fetch)) if line]
        print(f"{w} fetches from {hb.kv_store}: " + (", ".join(fetches) if fetches else "no fetch timed yet") + "; "
              + (f"computes a block in {block_s * 1e3:.2f} ms" if block_s else "no prefill timed yet"))


def print_stores(stores: list[dict]) -> None:
    """One line per KV store (kvstore/host.py entries): what it holds, has moved and spilled."""
    for e in stores:
        mib = e.get("block_bytes", 0) / 2**20
        print(f"{e['store_id']} on {e['address']}: {e['num_blocks']}/{e['capacity_blocks']} blocks held, "
              f"{e.get('num_stored', 0)} stored ({e.get('num_stored', 0) * mib:.0f} MiB in), "
              f"{e.get('num_fetched', 0)} fetched ({e.get('num_fetched', 0) * mib:.0f} MiB out), "
              f"{e.get('num_hit_blocks', 0)} of the blocks looked up found, {e.get('num_evicted', 0)} evicted, "
              + (f"{e.get('disk_blocks', 0)}/{e.get('disk_capacity_blocks', 0)} spilled to disk "
                 f"({e.get('num_unspilled', 0)} read back), " if e.get("disk_capacity_blocks") else "") +
              f"{e.get('num_fetch_failures', 0)} fetches failed")
