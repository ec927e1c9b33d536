"""`splitserve worker` and `splitserve router`: one worker or router replica as a plain process
(no Ray), and the device and secret settings they share with `serve`."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig
from cluster.metrics_targets import add_observe_flags
from cluster.metrics_targets import metrics_port as _metrics_port
from control.auth import check_private
from control.tls import SERVER_NAME, MemberTLS, given_tls
from control.worker_config import NO_SECRET
from kvfabric.config import TRANSPORTS
from engine.config import SpeculativeConfig
from engine.model.kv_sizing import DEFAULT_CPU_KV_FRACTION
from engine.checkpoints.quant_config import KV_CACHE_DTYPES, QUANTIZATIONS
from router.config import HttpDeadlines
from router.reasoning import REASONING_PARSERS
from router.request_limits import RequestLimits
from router.tool_parsers import PARSERS


def placement(args: argparse.Namespace, num_local_workers: int) -> tuple[str, str, int | None, float, float]:
    """--device/--dtype/--kv-cache-mib/--gpu-memory-utilization/--gpus-per-worker, resolved:
    (device, dtype, KV MiB or None to size from GPU memory, utilization, GPUs per worker). On
    CPU without --kv-cache-mib each of the `num_local_workers` gets its part of
    --cpu-kv-fraction of this host's available memory."""
    import torch

    from engine.model.devices import default_dtype, default_gpus_per_worker, resolve_device
    from engine.model.kv_sizing import available_memory_bytes, cpu_kv_bytes

    num_gpus = torch.cuda.device_count()
    device = resolve_device(args.device, num_gpus)
    gpus = args.gpus_per_worker or default_gpus_per_worker(num_gpus, num_local_workers)
    utilization = args.gpu_memory_utilization or round(0.9 * min(gpus, 1.0), 3)
    mib = args.kv_cache_mib
    if not mib and not device.startswith("cuda"):
        mib = cpu_kv_bytes(available_memory_bytes(), args.cpu_kv_fraction, num_local_workers) // 2**20
    return device, args.dtype or default_dtype(device), mib, utilization, gpus


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU), cpu or cuda")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: quantize the checkpoint's projections to FP8 as they load (per-channel weight "
                        "scales, per-token input scales); an FP8 checkpoint is served in FP8 without it")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: KV pools hold e4m3 (half a bfloat16 pool's bytes per token: twice the tokens, half "
                        "the bytes every hand-off moves); auto: the model's dtype")
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV pool per worker (default: sized from GPU memory on cuda; on cpu, a part of "
                        "--cpu-kv-fraction)")
    p.add_argument("--cpu-kv-fraction", type=float, default=DEFAULT_CPU_KV_FRACTION,
                   help=f"on cpu without --kv-cache-mib: the share of this host's available memory its workers' "
                        f"KV pools take in all, in equal parts (default {DEFAULT_CPU_KV_FRACTION}; pages are taken "
                        "as requests use them)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of its GPU a worker may use in all (default 0.9 x its GPU share)")
    p.add_argument("--kv-transport", choices=TRANSPORTS, default=None,
                   help="how prefill workers push KV to decode workers (default: per pair, shm or cuda_ipc on one "
                        "host, tcp or nccl across hosts); nixl: through NIXL (UCX; RDMA where the NIC has it), "
                        "decode workers then register their pools with it")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding on the decode workers (engine/spec/spec_decode.py)."""
    g = p.add_argument_group("speculative decoding (decode workers)")
    g.add_argument("--speculative", default="off", metavar="ngram|draft:DIR|off",
                   help="propose tokens ahead and verify them in one forward: ngram (prompt lookup), or a "
                        "draft model with the same tokenizer (draft:DIR); default off")
    g.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens, help="most tokens proposed per request per step")
    g.add_argument("--spec-max-batched-tokens", type=int, default=SpeculativeConfig.max_batched_tokens,
                   help="a step's decode tokens plus proposals stay within this: fewer proposals as the batch "
                        "grows, none at this many requests decoding")
    g.add_argument("--spec-min-acceptance", type=float, default=SpeculativeConfig.min_acceptance,
                   help="a request whose proposals are accepted less often stops proposing for a while")
    g.add_argument("--spec-backoff-steps", type=int, default=SpeculativeConfig.backoff_steps, help="that while, doubling each time")
    g.add_argument("--prompt-lookup-max", type=int, default=SpeculativeConfig.ngram_max, help="ngram: longest suffix matched")
    g.add_argument("--prompt-lookup-min", type=int, default=SpeculativeConfig.ngram_min, help="ngram: shortest suffix matched")


def speculative_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--speculative and its knobs as a SpeculativeConfig (ValueError naming what is wrong)."""
    method, _, draft = str(args.speculative).partition(":")
    if method not in ("off", "ngram", "draft") or (method == "draft") != bool(draft):
        raise ValueError(f"--speculative must be ngram, draft:DIR or off, got {args.speculative!r}")
    if draft and not Path(draft).exists():
        raise ValueError(f"--speculative draft:{draft}: no such checkpoint")
    return SpeculativeConfig(method=method, draft_model_dir=draft or None,  # type: ignore[arg-type]
                             num_speculative_tokens=args.num_speculative_tokens,
                             max_batched_tokens=args.spec_max_batched_tokens,
                             min_acceptance=args.spec_min_acceptance, backoff_steps=args.spec_backoff_steps,
                             ngram_min=args.prompt_lookup_min, ngram_max=args.prompt_lookup_max)


def add_http_flags(p: argparse.ArgumentParser, default_port: int = 8000) -> None:
    """The OpenAI HTTP API's flags (serve and router)."""
    p.add_argument("--http-port", type=int, default=default_port,
                   help=f"OpenAI-compatible HTTP API port on --host (default {default_port}; 0: a free one; -1: none)")
    p.add_argument("--served-model-name", help="model name the HTTP API answers to (default: the model's name)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template replacing the model's own")
    p.add_argument("--tool-call-parser", choices=PARSERS,
                   help="how tool_choice auto reads calls out of the model's text (default: the chat template's "
                        "own format; hermes for <tool_call>, llama3_json, mistral for [TOOL_CALLS])")
    p.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, "none"],
                   help="how a thinking model's reasoning is split into reasoning_content (default: as the chat "
                        "template implies: qwen3 or deepseek_r1 where it writes <think>; none: never)")
    p.add_argument("--responses-ttl-s", type=float, default=RouterConfig.responses_ttl_s,
                   help="how long the Responses API keeps a stored response, in seconds (default a day)")
    p.add_argument("--responses-store-mib", type=float, default=RouterConfig.responses_max_bytes / 2**20,
                   help="MiB of stored responses one tenant (API key) may keep; past it its oldest are dropped")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]",
                   help="a key callers must show (HTTP 'Authorization: Bearer KEY', gRPC metadata "
                        "'authorization'); with :TENANT its requests are that tenant's (repeatable; argv is "
                        "visible to other users: prefer --api-key-file or $SPLITSERVE_API_KEY)")
    p.add_argument("--api-key-file", metavar="FILE", help="keys, a KEY[:TENANT] a line (mode 600)")
    p.add_argument("--open-path", action="append", default=None, metavar="PATH",
                   help="an HTTP path served without a key (repeatable; default /health; the Prometheus "
                        "/metrics is on its own port, never behind a key)")
    p.add_argument("--max-messages", type=int, default=RequestLimits.max_messages,
                   help="messages one chat or /tokenize request may hold")
    p.add_argument("--max-tools", type=int, default=RequestLimits.max_tools, help="tools one chat request may hold")
    p.add_argument("--max-template-kwargs-bytes", type=int, default=RequestLimits.max_template_kwargs_bytes,
                   help="largest chat_template_kwargs, as JSON")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="deadline of a request whose caller sets none (HTTP requests; gRPC calls without one)")
    p.add_argument("--http-header-timeout-s", type=float, default=HttpDeadlines.header_timeout_s,
                   help="a connection's request head (or its next one, kept alive) must arrive within this")
    p.add_argument("--http-body-timeout-s", type=float, default=HttpDeadlines.body_timeout_s,
                   help="a request's body must arrive within this of its head (408 past it)")
    p.add_argument("--http-max-connections", type=int, default=HttpDeadlines.max_connections,
                   help="HTTP connections one router holds (past it: 503 and closed); idle ones past a quarter of "
                        "it are closed longest idle first")
    p.add_argument("--worker-network", action="append", default=[], metavar="CIDR|NAME",
                   help="where workers may be (repeatable): a heartbeat giving another address is skipped "
                        "(default: any address that is not globally routable)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name HTTP requests may name (repeatable): beside localhost on a loopback bind; "
                        "bound wider, the only ones (default: any)")


REDIS_URL_ENV = "SPLITSERVE_REDIS_URL"


def add_internal_tls_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-internal-tls", dest="internal_tls", action="store_false",
                   help="plain gRPC and kvfabric tcp between the cluster's members (default: mutual TLS with "
                        "certificates made from the cluster secret); only on a network you trust, on every member")
    p.add_argument("--tls-ca", metavar="PEM", help="your own PKI for the members' TLS: the CA (bundle) they trust; "
                                                   "with --tls-cert and --tls-key, on every member")
    p.add_argument("--tls-cert", metavar="PEM", help=f"this member's certificate (naming DNS:{SERVER_NAME})")
    p.add_argument("--tls-key", metavar="PEM", help="its private key (unencrypted; readable by this user only)")


def given_tls_of(args: argparse.Namespace) -> MemberTLS | None:
    """The certificate --tls-ca/--tls-cert/--tls-key give (all three or none), checked; None:
    members make theirs from the cluster secret. Raises ValueError."""
    files = (args.tls_ca, args.tls_cert, args.tls_key)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("--tls-ca, --tls-cert and --tls-key go together (the CA members trust, this member's "
                         "certificate, its key)")
    if not args.internal_tls:
        raise ValueError("--tls-ca/--tls-cert/--tls-key are for the members' TLS, which --no-internal-tls turns off")
    return given_tls(*files)


def add_redis_url_flag(p: argparse.ArgumentParser) -> None:
    """A plain process's Redis: --redis-url, else $SPLITSERVE_REDIS_URL (where a password
    belongs: argv is visible to every user of the machine in `ps`)."""
    p.add_argument("--redis-url", default=None, help=f"the cluster's Redis (redis://host:port/db; default "
                                                     f"${REDIS_URL_ENV}, where a password belongs: argv shows in ps)")


def redis_url_of(args: argparse.Namespace) -> str:
    """The Redis URL a plain process was given (ValueError when none)."""
    url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise ValueError(f"no Redis: pass --redis-url or set ${REDIS_URL_ENV}")
    if args.redis_url and urlsplit(args.redis_url).password:
        print(f"splitserve: warning: --redis-url holds a password, visible to other users in ps; set "
              f"${REDIS_URL_ENV} instead", file=sys.stderr)
    return url


def http_fields(args: argparse.Namespace) -> dict:
    """The RouterConfig fields of the HTTP flags (serve and router)."""
    from router import api_keys

    return dict(http_port=None if args.http_port < 0 else args.http_port, served_model_name=args.served_model_name,
                chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser, api_keys=api_keys.load(args.api_key, args.api_key_file),
                responses_ttl_s=args.responses_ttl_s, responses_max_bytes=int(args.responses_store_mib * 2**20),
                allowed_hosts=tuple(args.allowed_host), worker_networks=tuple(args.worker_network),
                open_paths=tuple(args.open_path) if args.open_path is not None else ("/health",),
                request_limits=RequestLimits(max_messages=args.max_messages, max_tools=args.max_tools,
                                             max_template_kwargs_bytes=args.max_template_kwargs_bytes),
                request_timeout_s=args.request_timeout_s,
                http_deadlines=HttpDeadlines(header_timeout_s=args.http_header_timeout_s,
                                             body_timeout_s=args.http_body_timeout_s,
                                             max_connections=args.http_max_connections,
                                             max_idle_connections=max(1, args.http_max_connections // 4)))


def worker_host(args: argparse.Namespace) -> str:
    """`serve`'s worker bind address: --worker-host, else on a Ray cluster (--ray-address)
    the IP of each worker's node (peers are on other nodes), else loopback."""
    from control.worker_config import NODE_IP

    if args.worker_host is not None:
        return str(args.worker_host)
    return NODE_IP if args.ray_address else "127.0.0.1"


def redacted(url: str) -> str:
    """A Redis URL fit to print: its password replaced by ***."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(parts.password, "***", 1)))


def cluster_secret() -> bytes | None:
    """The cluster secret from $SPLITSERVE_CLUSTER_SECRET_FILE or $SPLITSERVE_CLUSTER_SECRET (never argv)."""
    path = os.environ.get("SPLITSERVE_CLUSTER_SECRET_FILE")
    if path:
        check_private(Path(path), "$SPLITSERVE_CLUSTER_SECRET_FILE")
        return Path(path).read_bytes().strip()
    value = os.environ.get("SPLITSERVE_CLUSTER_SECRET")
    return value.encode() if value else None


def required_secret() -> bytes:
    """A plain process's cluster secret (raises ValueError when none is configured: no built-in one)."""
    secret = cluster_secret()
    if not secret:
        raise ValueError(NO_SECRET)
    return secret


def _run_until_signal(start, stop) -> int:  # type: ignore[no-untyped-def]
    """Runs `await start()` (returns a line to print), then waits for SIGINT/SIGTERM, then `await stop()`."""
    import asyncio

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        print(await start(), flush=True)
        await stopping.wait()
        print("splitserve: stopping", file=sys.stderr, flush=True)
        await stop()

    asyncio.run(main())
    return 0


def _worker(args: argparse.Namespace) -> int:
    import secrets

    from cluster.default_model import model_path

    try:
        device, dtype, mib, utilization, _ = placement(args, 1)
        config = WorkerConfig(model_dir=model_path(args.model), dtype=dtype, quantization=args.quantization,
                              kv_cache_dtype=args.kv_cache_dtype, device=device,
                              block_size=args.block_size, kv_cache_bytes=mib * 2**20 if mib else None,
                              gpu_memory_utilization=utilization, host=args.host, num_threads=args.num_threads,
                              model_id=args.model_id, advertise_host=args.advertise_host,
                              cluster_secret=required_secret(), otlp_endpoint=args.otlp_endpoint,
                              speculative=speculative_config(args), tensor_parallel=args.tensor_parallel,
                              kv_store=args.kv_store, internal_tls=args.internal_tls, kv_transport=args.kv_transport,
                              given_tls=given_tls_of(args))
        if args.tensor_parallel > 1 and args.role == "prefill" and device.startswith("cuda"):
            raise ValueError("--tensor-parallel splits prefill workers on CPU only: on GPUs a split worker's ranks "
                             "keep their KV pools private, so its pushes could not carry every KV head")
        redis_url = redis_url_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    worker_id = args.worker_id or f"{args.role}-{secrets.token_hex(3)}"
    if args.role == "prefill":
        from prefill_worker.worker import PrefillWorker as Worker
    else:
        from decode_worker.worker import DecodeWorker as Worker  # type: ignore[assignment]
    worker = Worker(worker_id, config, redis_url, args.namespace)

    async def start() -> str:
        info = await worker.start()
        return (f"splitserve: {args.role} worker {worker_id} serving on {info['address']} "
                f"(Redis {redacted(redis_url)})")

    return _run_until_signal(start, worker.shutdown)


def _kv_store(args: argparse.Namespace) -> int:
    from cluster.default_model import model_path
    from kvstore.host import StoreConfig, StoreHost

    try:
        if args.kv_store_mib <= 0:
            raise ValueError(f"--kv-store-mib must be positive, got {args.kv_store_mib}")
        if (args.kv_store_dir is None) != (args.kv_store_disk_gib <= 0):
            raise ValueError("a spill needs both --kv-store-dir and a positive --kv-store-disk-gib")
        if args.kv_store_direct_io and args.kv_store_dir is None:
            raise ValueError("--kv-store-direct-io is how the spill file is read and written: it needs --kv-store-dir")
        config = StoreConfig(model_path(args.model), args.kv_store_mib << 20, args.block_size, args.dtype,
                             args.model_id, args.host, args.advertise_host, args.port, required_secret(),
                             args.kv_store_dir, int(args.kv_store_disk_gib * 2**30), args.kv_store_direct_io,
                             args.internal_tls, given_tls_of(args), args.kv_transport, args.quantization,
                             args.kv_cache_dtype)
        if args.kv_transport == "nixl":
            from kvfabric.nixl import unavailable  # only then: it loads NIXL (and NumPy)
            if (why := unavailable()) is not None:
                raise ValueError(f"--kv-transport nixl: {why}")
        redis_url = redis_url_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    host = StoreHost(config, redis_url, args.namespace)

    async def start() -> str:
        info = await host.start()
        return (f"splitserve: KV store of {info['capacity_blocks']} blocks serving on {info['address']} for this "
                f"host's workers (Redis {redacted(redis_url)})")

    return _run_until_signal(start, host.stop)


def _router(args: argparse.Namespace) -> int:
    from router.policy import RoutingConfig
    from router.service import RouterService

    try:
        if args.tokenizer and Path(args.tokenizer).suffix == ".gguf":
            raise ValueError("--tokenizer takes a directory; for a GGUF model, the converted directory a worker "
                             "of that model logs at start (the router loads no model code)")
        config = RouterConfig(host=args.host, port=args.port, metrics_port=_metrics_port(args),
                              otlp_endpoint=args.otlp_endpoint, **http_fields(args), tokenizer_dir=args.tokenizer,
                              routing=RoutingConfig(mode=args.mode, local_prefill_tokens=args.local_prefill_tokens),
                              cluster_secret=required_secret(), internal_tls=args.internal_tls,
                              given_tls=given_tls_of(args))
        redis_url = redis_url_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    service = RouterService(args.router_id, config, redis_url, args.namespace)

    async def start() -> str:
        address = await service.start()
        http = f", OpenAI API on http://{service.http_address}/v1" if service.http_address else ""
        return f"splitserve: router {args.router_id} serving on {address}{http} (Redis {redacted(redis_url)})"

    return _run_until_signal(start, service.shutdown)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    w = sub.add_parser("worker", help="run one prefill or decode worker as a plain process (no Ray)")
    w.add_argument("role", choices=("prefill", "decode"))
    add_redis_url_flag(w)
    w.add_argument("--namespace", default=ClusterConfig.namespace, help="prefix of the cluster's Redis keys")
    w.add_argument("--worker-id", help="unique in the cluster (default: ROLE-<random>)")
    w.add_argument("--model", help="model directory, .gguf file, or `tiny` (default: the embedded SmolLM2-135M-Instruct)")
    w.add_argument("--model-id", help="name the block hashes are keyed with (default: the directory's name)")
    w.add_argument("--host", default="127.0.0.1", help="interface for the worker's gRPC and kvfabric listeners")
    w.add_argument("--advertise-host", help="address peers dial to reach this worker (default: --host, or for "
                                            "0.0.0.0 this machine's address on its route to the Redis host)")
    add_observe_flags(w, metrics_port=False)
    add_device_flags(w)
    w.add_argument("--gpus-per-worker", type=float, default=1.0, help=argparse.SUPPRESS)
    w.add_argument("--block-size", type=int, default=WorkerConfig.block_size)
    w.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    w.add_argument("--tensor-parallel", type=int, default=1,
                   help="split the model across this many processes (GPUs); on GPUs decode only, prefilling its "
                        "own prompts")
    add_speculative_flags(w)
    w.add_argument("--kv-store", help="this host's shared KV tier: `local` (the store `splitserve kv-store` "
                                      "registered for this host) or HOST:PORT (default: none)")
    add_internal_tls_flag(w)
    w.set_defaults(func=_worker)

    k = sub.add_parser("kv-store", help="run this host's shared KV tier (a store of prefix blocks) as a plain process")
    add_redis_url_flag(k)
    k.add_argument("--namespace", default=ClusterConfig.namespace, help="prefix of the cluster's Redis keys")
    k.add_argument("--model", help="the workers' model: directory, .gguf file, or `tiny` (default: the embedded one)")
    k.add_argument("--model-id", help="as the workers' --model-id (default: the directory's name)")
    k.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the workers' KV dtype")
    k.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="as the workers' --quantization")
    k.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="as the workers' --kv-cache-dtype")
    k.add_argument("--block-size", type=int, default=WorkerConfig.block_size)
    k.add_argument("--kv-store-mib", type=int, default=1024, help="host memory for blocks")
    k.add_argument("--host", default="127.0.0.1", help="interface for the store's gRPC and kvfabric listeners")
    k.add_argument("--advertise-host", help="address workers dial (default: --host)")
    k.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one, printed when ready)")
    k.add_argument("--kv-store-dir", help="a directory (an SSD) for the blocks memory evicts")
    k.add_argument("--kv-store-disk-gib", type=float, default=0.0, help="how much of --kv-store-dir to fill")
    k.add_argument("--kv-store-direct-io", action="store_true", help="the spill file with O_DIRECT (no page cache)")
    k.add_argument("--kv-transport", choices=("shm", "tcp", "nixl"), default=None,
                   help="as the workers' --kv-transport: nixl moves offloads and fetches through NIXL")
    add_internal_tls_flag(k)
    k.set_defaults(func=_kv_store)

    r = sub.add_parser("router", help="run one router replica as a plain process (no Ray)")
    add_redis_url_flag(r)
    r.add_argument("--namespace", default=ClusterConfig.namespace, help="prefix of the cluster's Redis keys")
    r.add_argument("--router-id", default="router-0")
    r.add_argument("--port", type=int, default=RouterConfig.port, help="0: a free one, printed when ready")
    add_observe_flags(r)
    r.add_argument("--host", default="127.0.0.1", help="interface to serve on (0.0.0.0 for other machines)")
    add_http_flags(r)
    r.add_argument("--tokenizer", help="directory with the model's tokenizer.json (default: token-id prompts only)")
    r.add_argument("--mode", choices=("disaggregated", "colocated", "auto"), default="auto")
    r.add_argument("--local-prefill-tokens", type=int, default=256)
    add_internal_tls_flag(r)
    r.set_defaults(func=_router)
