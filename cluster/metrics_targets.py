"""`splitserve metrics-targets`: the running cluster's `/metrics` endpoints as Prometheus
`file_sd` JSON (torch-free).

Every router and worker registers where its `/metrics` listens (a worker in its heartbeat,
a router in its stats report, the controller in its status), so the list is read from the
registry, never configured.
Point a `file_sd_configs` entry at the file this writes (deploy/prometheus.yml does) and
rewrite it when pools change (the command is cheap: one Redis read); Prometheus re-reads
the file on change. Each target carries `role` and `instance_id` labels, so a dashboard
can split prefill from decode workers and routers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from control.heartbeat import Heartbeat
from control.router_stats import ControllerStatus, RouterStats


def file_sd(beats: dict[str, Heartbeat], routers: dict[str, RouterStats], namespace: str,
            controller: ControllerStatus | None = None,
            stores: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """One target group per process that serves `/metrics`, sorted by role then id."""
    groups = [(b.role, w, b.metrics_address) for w, b in beats.items()] + \
             [("router", r, s.metrics_address) for r, s in routers.items()] + \
             [("controller", "controller", controller.metrics_address if controller else "")] + \
             [("kv_store", str(e.get("store_id", "")), str(e.get("metrics_address", ""))) for e in stores]
    return [{"targets": [address], "labels": {"role": role, "instance_id": name, "splitserve_namespace": namespace}}
            for role, name, address in sorted(groups) if address]


def run(args: argparse.Namespace, redis_url: str) -> int:
    from control.reader import read_cluster
    from kvstore.host import read_stores

    try:
        beats, routers, controller = asyncio.run(read_cluster(redis_url, args.namespace))
        stores = read_stores(redis_url, args.namespace)
    except Exception as e:  # noqa: BLE001 - any Redis failure is reported, not raised
        print(f"Redis at {redis_url} is away ({e}): no targets can be read now", file=sys.stderr)
        return 1
    text = json.dumps(file_sd(beats, routers, args.namespace, controller, stores), indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:  # written whole, then renamed: Prometheus never reads half a file
        out = Path(args.output)
        with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, out)
    if not beats and not routers:
        print("no workers or routers are reporting (is the cluster running?)", file=sys.stderr)
        return 1
    return 0


def add_observe_flags(p: argparse.ArgumentParser, metrics_port: bool = True) -> None:
    """--otlp-endpoint, and for a router --metrics-port."""
    p.add_argument("--otlp-endpoint", default=None,
                   help="export traces over OTLP/gRPC to this collector (default: $OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "neither: tracing off)")
    if metrics_port:
        p.add_argument("--metrics-port", type=int, default=0,
                       help="the router's Prometheus /metrics port on --host (0: a free one, listed by "
                            "`splitserve metrics-targets`; -1: none)")


def metrics_port(args: argparse.Namespace) -> int | None:
    return None if args.metrics_port == -1 else args.metrics_port


def write_credentials(path: str, token: str) -> None:
    """The scrape token for Prometheus' `authorization: {credentials_file: PATH}` (mode 600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(token + "\n")


def add_parser(sub: Any, cluster_redis: Any, scrape_token: Any) -> None:
    p = sub.add_parser("metrics-targets", help="print the cluster's /metrics endpoints as Prometheus file_sd JSON")
    p.add_argument("--redis-url", help="default: the cluster last started by `splitserve serve`")
    p.add_argument("--namespace", default="splitserve")
    p.add_argument("--output", "-o", help="write the JSON to this file (atomically) instead of stdout")
    p.add_argument("--credentials-file", metavar="FILE",
                   help="also write the bearer token /metrics listeners bound beyond loopback ask for (mode 600; "
                        "from the cluster secret in the environment, or of the cluster `serve` started last)")

    def func(args: argparse.Namespace) -> int:
        redis_url, args.namespace = cluster_redis(args)
        if redis_url is None:
            return 2
        if args.credentials_file:
            token = scrape_token()
            if token is None:
                print("error: --credentials-file: no cluster secret in the environment "
                      "(SPLITSERVE_CLUSTER_SECRET_FILE) and no cluster started by `splitserve serve`", file=sys.stderr)
                return 2
            write_credentials(args.credentials_file, token)
        return run(args, redis_url)
    p.set_defaults(func=func)
