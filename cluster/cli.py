"""`splitserve` command line.

  splitserve serve [--model DIR] [--num-prefill N] [--num-decode M] [--mode disaggregated|colocated|auto]
                   [--port P] [--redis-url URL]       start a local cluster (Ray + Redis + router)
  splitserve generate PROMPT [--target HOST:PORT] ... stream a completion from a running cluster
  splitserve status [--redis-url URL]                 pools, queues, KV usage, prefix hit rate
  splitserve scale prefill|decode N                   resize a running cluster's pool
  splitserve serve --detach ... / splitserve stop     serve in the background (under `ray up`) / stop it
  splitserve worker prefill|decode --redis-url URL [--model DIR] ...   one worker as a plain process (no Ray)
  splitserve router --redis-url URL [--port P] ...    one router replica as a plain process (no Ray)
  splitserve make-tiny-model DIR [--arch llama|qwen2] [--size tiny|small|llama3-8b] [--seed N] [--draft-of MODEL]
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from loadgen.cli import add_parser as add_bench_parser
from cluster import daemon
from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.default_model import TINY
from cluster.make_model import add_parser as add_make_model_parser
from cluster.metrics_targets import add_observe_flags
from cluster.metrics_targets import add_parser as add_metrics_targets_parser
from cluster.metrics_targets import metrics_port as _metrics_port
from cluster.processes import (add_device_flags, add_http_flags, add_internal_tls_flag, add_speculative_flags,
                               cluster_secret, given_tls_of, http_fields, placement, redacted, speculative_config,
                               worker_host)
from cluster.processes import add_parsers as add_process_parsers
from cluster.status import show_status
from control.auth import metrics_token
from control.autoscaler import AutoscaleConfig
from control.redis_url import readable
from router.admission_config import AdmissionConfig
from router.policy import RoutingConfig
from sim.cli import add_parser as add_simulate_parser
from sim.plan_cli import add_parser as add_plan_parser

DEFAULT_TARGET = "127.0.0.1:50051"
WATCH_INTERVAL_S = 3.0
"""How often `serve` checks that its cluster can still serve."""


def _state_file() -> Path:
    from engine.checkpoints.gguf_checkpoint import cache_root

    return cache_root() / "serve.json"


def _serve(args: argparse.Namespace) -> int:
    if args.detach:
        argv = list(args.argv)
        argv.remove("serve")
        return daemon.detach(args, argv)
    started = time.perf_counter()
    try:
        config = _serve_config(args)
        _preflight(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cluster.local import LocalCluster  # here: a refusal above need not load Ray

    cluster = LocalCluster(config, embedded_redis=not args.redis_url)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    daemon.record()
    try:
        info = cluster.start()
        _write_state(info["address"], cluster.redis_url, args.namespace,
                     metrics_token(cluster.config.worker.cluster_secret))
        http = f", OpenAI API on http://{info['http_address']}/v1" if info.get("http_address") else ""
        print(f"{daemon.READY_MARK}{_model_name(config)} on {info['address']}{http} "
              f"({args.num_prefill} prefill, {args.num_decode} decode on {config.worker.device} "
              f"{config.worker.dtype}, mode {args.mode}"
              + (f", {args.num_routers} routers" if args.num_routers > 1 else "")
              + f", Redis {redacted(cluster.redis_url)}); "
              f"ready in {time.perf_counter() - started:.1f} s. Ctrl-C stops.", flush=True)
        if args.model == TINY:
            print("splitserve: --model tiny has random weights, so its text is noise by design (it is for tests)",
                  flush=True)
        _watch(cluster, stop)
    finally:
        print("splitserve: stopping", file=sys.stderr, flush=True)
        cluster.stop()
        daemon.forget()
        print(daemon.STOPPED_MARK, file=sys.stderr, flush=True)
    return 0


def _watch(cluster, stop: threading.Event) -> None:  # type: ignore[no-untyped-def]
    """Until Ctrl-C: every few seconds, whether the cluster can still serve and be supervised;
    says so once when it cannot (and once when it can again), instead of running on silently."""
    said = None
    while not stop.wait(WATCH_INTERVAL_S):
        problem = cluster.problem()
        if problem != said:
            print(f"splitserve: {problem}; Ctrl-C stops this and `serve` starts it again"
                  if problem else "splitserve: the cluster is whole again", file=sys.stderr, flush=True)
            said = problem


def _serve_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """serve's flags as a ClusterConfig (raises ValueError naming what is wrong). The cluster
    secret comes from the environment, or the controller generates one."""
    from cluster.default_model import model_path

    if args.plan:
        _apply_plan(args)
    device, dtype, mib, utilization, gpus = placement(args, args.num_prefill + args.num_decode)
    http, admission, autoscale = http_fields(args), _admission_config(args), _autoscale_config(args)
    model = model_path(args.model)  # the flags' own errors first: a GGUF model is converted below (seconds)
    return ClusterConfig(
        worker=WorkerConfig(model_dir=model, dtype=dtype, quantization=args.quantization,
                            kv_cache_dtype=args.kv_cache_dtype, device=device,
                            block_size=args.block_size, kv_cache_bytes=mib * 2**20 if mib else None,
                            gpu_memory_utilization=utilization, host=worker_host(args),
                            advertise_host=args.advertise_host, cluster_secret=cluster_secret(),
                            otlp_endpoint=args.otlp_endpoint, speculative=speculative_config(args),
                            internal_tls=args.internal_tls, given_tls=given_tls_of(args),
                            kv_transport=args.kv_transport, max_num_batched_tokens=args.max_num_batched_tokens),
        num_prefill=args.num_prefill, num_decode=args.num_decode, num_routers=args.num_routers,
        controller_max_restarts=args.controller_max_restarts, gpus_per_worker=gpus, autoscale=autoscale,
        decode_tp=args.decode_tp, prefill_tp=args.prefill_tp, kv_store_mib=args.kv_store_mib,
        kv_store_dir=args.kv_store_dir, kv_store_disk_gib=args.kv_store_disk_gib,
        kv_store_direct_io=args.kv_store_direct_io,
        router=RouterConfig(host=args.host, port=args.port, metrics_port=_metrics_port(args),
                            otlp_endpoint=args.otlp_endpoint, tokenizer_dir=_model_dir(model), **http,
                            admission=admission,
                            routing=RoutingConfig(mode=args.mode, local_prefill_tokens=args.local_prefill_tokens)),
        redis_url=args.redis_url or "", redis_host=args.redis_host, namespace=args.namespace,
        ray_address=args.ray_address,
        role_resources={role: {name: 1.0} for role, name in (("prefill", args.prefill_resource),
                                                              ("decode", args.decode_resource)) if name})


def _apply_plan(args: argparse.Namespace) -> None:
    """serve --plan: the plan's best fleet in place of the pool flags (a KV tier it chose is
    --kv-store-mib's to size: the plan's GiB are a GPU node's host memory), and predictive
    scaling where the plan found it ahead on its trace."""
    from sim.plan import plan_scales_ahead, read_plan

    c = read_plan(args.plan)
    args.predictive_scaling = args.predictive_scaling or plan_scales_ahead(args.plan)
    args.num_prefill, args.num_decode, args.mode = c.prefill, c.decode, c.mode
    args.prefill_tp, args.decode_tp, args.max_num_batched_tokens = c.prefill_tp, c.decode_tp, c.max_num_batched_tokens
    if c.speculative:
        args.speculative = "ngram"


def _model_dir(model: str) -> str:
    """The directory the router reads the tokenizer and chat template from: `model`, or for a
    GGUF file its converted directory (converted here, once, before any worker starts)."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from engine.types import EngineError

    try:
        return str(resolve_model_dir(model))
    except EngineError as e:
        raise ValueError(f"--model {model}: {e}") from None


def _model_name(config) -> str:  # type: ignore[no-untyped-def]
    return config.router.served_model_name or Path(config.router.tokenizer_dir).name


def _write_state(address: str, redis_url: str, namespace: str, scrape_token: str) -> None:
    """Where `generate`, `status`, `scale` and `metrics-targets` find the running cluster (0600:
    the URL holds the Redis password, and the scrape token is /metrics' bearer token)."""
    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    path.chmod(0o600)
    path.write_text(json.dumps({"address": address, "redis_url": redis_url, "namespace": namespace,
                                "metrics_token": scrape_token}))


def _scrape_token() -> str | None:
    """The /metrics bearer token: of the cluster secret in the environment, else of the
    cluster `splitserve serve` started last (None: neither)."""
    secret = cluster_secret()
    if secret:
        return metrics_token(secret)
    if _state_file().is_file():
        return json.loads(_state_file().read_text()).get("metrics_token")
    return None


def _preflight(config) -> None:  # type: ignore[no-untyped-def]
    """What would otherwise fail only after Ray and the workers start: the model and the port."""
    import socket

    from engine.model.model_config import ModelConfig
    from engine.types import EngineError
    from router.chat_template import ChatTemplate, ChatTemplateError

    try:
        ModelConfig.from_dir(config.router.tokenizer_dir)  # the model's directory (a GGUF file's converted one)
        ChatTemplate.load(config.router.tokenizer_dir, config.router.chat_template)
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template: {e}") from None
    except (EngineError, OSError, ValueError) as e:
        raise ValueError(f"--model {config.worker.model_dir}: {e}") from None
    for port, flag in ((config.router.port, "--port"), (config.router.http_port, "--http-port")):
        if not port:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((config.router.host, port))
            except OSError as e:
                raise ValueError(f"cannot listen on {config.router.host}:{port} ({e.strerror}): another splitserve? "
                                 f"pick another with {flag}") from None


def _autoscale_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """serve --autoscale: the policy's bounds and budgets (None without the flag)."""
    if not args.autoscale:
        return None
    ratio = args.num_prefill / args.num_decode if args.plan and args.num_prefill and not args.independent_pools \
        else None  # a plan's P:D ratio, kept as the pools scale
    return AutoscaleConfig(prefill_min=args.min_prefill, prefill_max=max(args.max_prefill, args.num_prefill),
                           decode_min=args.min_decode, decode_max=max(args.max_decode, args.num_decode),
                           ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, pd_ratio=ratio,
                           predictive=args.predictive_scaling, startup_s=args.worker_startup_s)


def _admission_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """serve's admission flags; raises ValueError with the flag at fault."""

    def pairs(values: list[str], flag: str, kind: type) -> dict[str, float]:
        out = {}
        for v in values:
            name, sep, amount = v.rpartition("=")
            try:
                out[name] = kind(amount)
            except ValueError:
                sep = ""
            if not sep:
                raise ValueError(f"{flag} takes TENANT=NUMBER, got {v!r}")
        return out

    ttft_s = args.ttft_budget_ms / 1e3 if args.ttft_budget_ms is not None else None
    return AdmissionConfig(max_queue_wait_s=args.max_queue_wait_s, kv_overcommit=args.kv_overcommit, ttft_budget_s=ttft_s,
                           charge_output=args.admission_charge,
                           tenant_weights=pairs(args.tenant_weight, "--tenant-weight", float),
                           tenant_quota_tokens=pairs(args.tenant_quota, "--tenant-quota", int))


def _scale(args: argparse.Namespace) -> int:
    import redis

    from control.heartbeat import target_key

    redis_url, namespace = _cluster_redis(args)
    if redis_url is None:
        return 2
    if args.n < (1 if args.role == "decode" else 0):
        print(f"error: a cluster needs at least {1 if args.role == 'decode' else 0} {args.role} workers", file=sys.stderr)
        return 2
    if args.n > 256:  # the controller's MAX_MANUAL_TARGET
        print(f"error: at most 256 {args.role} workers per pool, got {args.n}", file=sys.stderr)
        return 2
    try:
        client = redis.Redis.from_url(readable(redis_url), socket_timeout=2.0, socket_connect_timeout=2.0)
        client.set(target_key(namespace, args.role), args.n, ex=60)
    except redis.RedisError as e:
        print(f"error: cannot reach {redacted(redis_url)}: {e}", file=sys.stderr)
        return 1
    print(f"{args.role} target set to {args.n}; the controller acts on it within a second "
          "(`splitserve status` shows the pools)")
    return 0


def _cluster_redis(args: argparse.Namespace) -> tuple[str | None, str]:
    """--redis-url/--namespace, or those of the cluster `splitserve serve` started last."""
    if args.redis_url is not None:
        return args.redis_url, args.namespace
    if not _state_file().is_file():
        print("error: no --redis-url given and no local cluster started by `splitserve serve`", file=sys.stderr)
        return None, args.namespace
    state = json.loads(_state_file().read_text())
    return state["redis_url"], state["namespace"]


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from proto import generate_pb2 as pb
    from proto import generate_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(text=args.prompt, sampling=sampling, priority=args.priority, tenant=args.tenant)
    print(args.prompt, end="", flush=True)
    last = None
    try:
        with grpc.insecure_channel(args.target) as channel:
            for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=args.timeout_s):
                print(response.text, end="", flush=True)
                last = response
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if last is not None:
        t, u, r = last.timing, last.usage, last.route
        where = f"{r.decode_worker} (local prefill)" if r.local_prefill else f"{r.prefill_worker} -> {r.decode_worker}"
        print(f"\n[{last.request_id}] {u.completion_tokens} tokens, finish {pb.FinishReason.Name(last.finish_reason)}, "
              f"prompt {u.prompt_tokens} ({u.cached_tokens} cached), TTFT {t.ttft_ms:.1f} ms, "
              f"transfer {t.transfer_ms:.1f} ms, via {where}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_client_parsers(sub)
    add_process_parsers(sub)
    add_make_model_parser(sub)
    return parser


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="start a local cluster: Ray, Redis, prefill + decode pools, router")
    s.add_argument("--model", help="a Hugging Face model directory, a .gguf file (or a directory holding one), or "
                                   "`tiny` (random weights, for tests); default: the embedded SmolLM2-135M-Instruct")
    s.add_argument("--num-prefill", type=int, default=ClusterConfig.num_prefill)
    s.add_argument("--num-decode", type=int, default=ClusterConfig.num_decode)
    s.add_argument("--num-routers", type=int, default=ClusterConfig.num_routers,
                   help="router replicas, all serving --port (the kernel spreads connections over them)")
    s.add_argument("--mode", choices=("disaggregated", "colocated", "auto"), default=RoutingConfig.mode)
    s.add_argument("--local-prefill-tokens", type=int, default=RoutingConfig.local_prefill_tokens,
                   help="auto mode: decode workers prefill prompts with fewer uncached tokens themselves")
    s.add_argument("--port", type=int, default=RouterConfig.port, help="router port (0: a free one, printed when ready)")
    s.add_argument("--host", default=RouterConfig.host, help="interface to serve on (0.0.0.0 for other machines)")
    add_http_flags(s)
    add_internal_tls_flag(s)
    add_observe_flags(s)
    s.add_argument("--redis-url", help="use this Redis instead of starting one (redis://host:port/db)")
    s.add_argument("--redis-host", default=ClusterConfig.redis_host, help="interface the embedded Redis binds: on a Ray "
                   "cluster's head its private address (or 0.0.0.0), so workers on other nodes reach it")
    s.add_argument("--namespace", default=ClusterConfig.namespace, help="prefix of this cluster's Redis keys (and its Ray "
                   "namespace: one cluster per namespace on a Ray cluster)")
    s.add_argument("--controller-max-restarts", type=int, default=ClusterConfig.controller_max_restarts,
                   help="times Ray restarts a controller that died (workers and routers serve on meanwhile)")
    _add_autoscale_flags(s)
    add_device_flags(s)
    s.add_argument("--plan", metavar="FILE", help="a plan file of `splitserve plan`: its best fleet's pools, mode, "
                   "TP degrees and step budget (in place of --num-prefill, --num-decode, --mode, --prefill-tp, "
                   "--decode-tp, --max-num-batched-tokens)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one engine step may hold (the prefill chunk; default: from the device's memory)")
    s.add_argument("--decode-tp", type=int, default=ClusterConfig.decode_tp,
                   help="tensor-parallel degree of each decode worker: its model split across this many processes "
                        "(GPUs; there, above 1 needs --mode colocated)")
    s.add_argument("--prefill-tp", type=int, default=ClusterConfig.prefill_tp,
                   help="tensor-parallel degree of each prefill worker (CPU; any degree against --decode-tp: each "
                        "rank pushes its KV heads to the decode ranks that hold them)")
    s.add_argument("--kv-store-mib", type=int, default=ClusterConfig.kv_store_mib,
                   help="the shared KV tier: host memory of each node's store of evicted prefix blocks, which any "
                        "worker of the node fetches instead of computing them again (CPU workers; default 0: none)")
    s.add_argument("--kv-store-dir", help="a directory (an SSD) where each node's KV store spills the blocks its "
                                         "memory evicts (with --kv-store-disk-gib)")
    s.add_argument("--kv-store-disk-gib", type=float, default=ClusterConfig.kv_store_disk_gib, help="how much of --kv-store-dir a store may fill")
    s.add_argument("--kv-store-direct-io", action="store_true", help="read and write the spill file with O_DIRECT "
                                                                     "(no page cache)")
    s.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs each worker asks Ray for (default 1; 1/N when N workers share a one-GPU machine)")
    s.add_argument("--block-size", type=int, default=WorkerConfig.block_size)
    add_speculative_flags(s)
    daemon.add_flags(s)
    _add_ray_flags(s)
    _add_admission_flags(s)
    s.set_defaults(func=_serve)


def _add_autoscale_flags(s: argparse.ArgumentParser) -> None:
    """serve --autoscale: the pools' bounds, the SLOs they scale on, a plan's ratio, the forecast."""
    s.add_argument("--autoscale", action="store_true",
                   help="scale prefill on queue time and decode on KV pressure, within --min-prefill/--max-prefill "
                        "and --min-decode/--max-decode")
    s.add_argument("--independent-pools", action="store_true",
                   help="--autoscale with --plan: each pool scales on its own signals, not at the plan's P:D ratio")
    s.add_argument("--predictive-scaling", action="store_true",
                   help="--autoscale: also launch workers for the load forecast --worker-startup-s ahead (a trend of "
                        "each pool's demand), not only for the load that has arrived")
    s.add_argument("--worker-startup-s", type=float, default=AutoscaleConfig.startup_s,
                   help="--predictive-scaling: how far ahead the forecast reads until a launched worker's time to "
                        "serving has been measured (then the launches' own)")
    s.add_argument("--min-prefill", type=int, default=0, help="--autoscale: (0 lets mode auto drop the prefill pool)")
    s.add_argument("--max-prefill", type=int, default=AutoscaleConfig.prefill_max)
    s.add_argument("--min-decode", type=int, default=AutoscaleConfig.decode_min)
    s.add_argument("--max-decode", type=int, default=AutoscaleConfig.decode_max)
    s.add_argument("--ttft-slo-ms", type=float, default=AutoscaleConfig.ttft_slo_ms,
                   help="--autoscale: the TTFT budget prefill scales on")
    s.add_argument("--itl-slo-ms", type=float, default=AutoscaleConfig.itl_slo_ms,
                   help="--autoscale: the ITL budget decode scales on")


def _add_ray_flags(s: argparse.ArgumentParser) -> None:
    """serve's flags for a Ray cluster (deploy/): where workers run and how peers reach them."""
    r = s.add_argument_group("on a Ray cluster (see deploy/)")
    r.add_argument("--ray-address", help="join this Ray cluster (auto, or the head's HOST:PORT) instead of "
                                         "starting a local Ray node")
    r.add_argument("--prefill-resource", metavar="NAME",
                   help="custom Ray resource each prefill worker asks for (one unit): the node type it runs on")
    r.add_argument("--decode-resource", metavar="NAME", help="likewise for decode workers")
    r.add_argument("--worker-host", default=None,
                   help="interface workers bind their gRPC and KV listeners to (0.0.0.0: every one; default "
                        "127.0.0.1, or with --ray-address the IP of the Ray node each worker runs on)")
    r.add_argument("--advertise-host", help="address workers give peers (default: --worker-host, or for 0.0.0.0 "
                                            "each machine's address on its route to the Redis host)")


def _add_admission_flags(s: argparse.ArgumentParser) -> None:
    """serve's flags for the router's admission: its token budget and the tenants' shares."""
    a = s.add_argument_group("admission (the router's token budget, shared fairly)")
    a.add_argument("--max-queue-wait-s", type=float, default=AdmissionConfig.max_queue_wait_s,
                   help="longest a request waits for admission; a longer estimated wait is refused at once")
    a.add_argument("--ttft-budget-ms", type=float, default=None,
                   help="keep admitted requests' time to first token within this: the token budget follows "
                        "measured TTFT and half of it bounds the admission wait (default: no TTFT budget)")
    a.add_argument("--kv-overcommit", type=float, default=AdmissionConfig.kv_overcommit,
                   help="admitted tokens at most this times the decode pool's KV capacity")
    a.add_argument("--admission-charge", choices=("expected", "max"), default=AdmissionConfig.charge_output,
                   help="what a request's output is charged against the budget: expected (a high quantile of "
                        "what finished requests of its tenant generated; one that runs longer is charged what "
                        "it holds, and a full decode pool preempts) or max (its max_tokens within the context: "
                        "no request ever waits on a decode worker for room); default expected")
    a.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                   help="weight of a tenant's fair share (default 1; repeatable)")
    a.add_argument("--tenant-quota", action="append", default=[], metavar="TENANT=TOKENS",
                   help="most tokens a tenant may have admitted at once (repeatable)")


def _add_client_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Commands against a running cluster: generate, scale, status."""
    g = sub.add_parser("generate", help="stream a completion from a running cluster")
    g.add_argument("prompt")
    g.add_argument("--target", default=DEFAULT_TARGET, help="router address host:port")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--priority", type=int, default=0, help="lower is more important")
    g.add_argument("--tenant", default="")
    g.add_argument("--timeout-s", type=float, default=120.0)
    g.set_defaults(func=_generate)

    sc = sub.add_parser("scale", help="set a running cluster's prefill or decode pool size")
    sc.add_argument("role", choices=("prefill", "decode"))
    sc.add_argument("n", type=int)
    sc.add_argument("--redis-url", help="default: the cluster last started by `splitserve serve`")
    sc.add_argument("--namespace", default="splitserve")
    sc.set_defaults(func=_scale)

    st = sub.add_parser("status", help="pools, queues, KV usage and prefix hit rate")
    st.add_argument("--redis-url", help="default: the cluster last started by `splitserve serve`")
    st.add_argument("--namespace", default="splitserve")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=lambda a: show_status(a, _cluster_redis))
    daemon.add_stop_parser(sub)
    add_metrics_targets_parser(sub, _cluster_redis, _scrape_token)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
