"""RouterConfig: what a router replica reads (every field documented, units in names, validated)."""
from __future__ import annotations

from dataclasses import dataclass, field

from control.tls import MemberTLS, tls_of
from router.admission import AdmissionConfig
from router.api_keys import ApiKeys
from router.members import WorkerNetworks
from router.request_limits import RequestLimits
from router.policy import RoutingConfig
from router.reasoning import REASONING_PARSERS
from router.tool_parsers import PARSERS


@dataclass(frozen=True)
class HttpDeadlines:
    """How long the HTTP API waits on a client, and how many connections it holds."""

    header_timeout_s: float = 10.0
    """A connection's request head (or its next one, kept alive) must arrive within this."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this of its head (408 past it, and closed)."""
    max_connections: int = 4096
    """Connections one router holds; past it a new one is told 503 and closed."""
    max_idle_connections: int = 1024
    """Connections with no request in progress; past it the longest idle one is closed."""
    max_body_bytes_in_flight: int = 256 << 20
    """Request bodies being read at once, in bytes (each counted at its Content-Length, or the
    largest body where it has none): past it a new one is told 503 with a retry hint."""
    max_body_bytes_per_client: int = 64 << 20
    """Of those, the most one client address may hold: 16 slow clients declaring 16 MiB each
    once held the whole budget; past it that client is told 429 with a retry hint."""

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError("HTTP timeouts must be positive")
        if min(self.max_connections, self.max_idle_connections, self.max_body_bytes_in_flight,
               self.max_body_bytes_per_client) < 1:
            raise ValueError("max_connections, max_idle_connections, max_body_bytes_in_flight and "
                             "max_body_bytes_per_client must be at least 1")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Interface the public gRPC server binds to (0.0.0.0 to serve other machines)."""
    port: int = 50051
    """0 picks a free port (router replicas all join the one the first replica got)."""
    share_port: bool = False
    """Bind with SO_REUSEPORT so several router replicas on one host serve one port (the
    kernel spreads connections over them). Off for a single router, so a port already
    taken (by another splitserve too) is an error instead of a silent split."""
    metrics_port: int | None = 0
    """Port of the router's Prometheus `/metrics` (HTTP, on `host`); 0 picks a free one
    (`splitserve metrics-targets` lists it), None serves none. Give several replicas on
    one host 0: a fixed port can be bound once."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API (`router/http_api.py`, on `host`); 0 picks a free
    one (replicas join the first one's, as for `port`), None serves none."""
    served_model_name: str | None = None
    """The model name the HTTP API answers to and reports; None: the model id the workers report."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the model's own (None: the model's)."""
    tool_call_parser: str | None = None
    """How tool calls are read out of the model's text for `tool_choice: "auto"`: hermes,
    llama3_json or mistral (router/tool_parsers.py); None: the chat template's own format."""
    reasoning_parser: str | None = None
    """How a thinking model's reasoning is split from its answer (`reasoning_content`): qwen3,
    deepseek_r1 (router/reasoning.py) or "none"; None: as the chat template implies."""
    responses_ttl_s: float = 24 * 3600.0
    """How long the Responses API keeps a stored response (for `previous_response_id`, GET)."""
    responses_max_bytes: int = 256 << 20
    """Bytes of stored responses one tenant (API key) may keep; past it, its oldest are dropped."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefill_timeout_s: float = 120.0
    """Longest a prefill worker may take to return a request's first token."""
    reserve_timeout_s: float = 15.0
    """Longest a decode worker may take to answer a reservation (its engine thread runs it
    between steps); one that does not is treated as unreachable."""
    decode_idle_timeout_s: float = 60.0
    """Longest the router waits for the next tokens of a running request before it checks
    the worker: one still heartbeating is busy and waited on (see `busy_wait_s`), one whose
    heartbeat is gone is dead and the request goes on elsewhere."""
    busy_wait_s: float = 300.0
    """Longest a request waits on a worker that still heartbeats but sends it nothing (each
    of the timeouts above, renewed while the worker is alive); then it ends RESOURCE_EXHAUSTED."""
    index_poll_ms: int = 200
    """How long one read of the workers' KV event streams may block."""
    load_refresh_s: float = 0.5
    """How often heartbeats (KV usage, queues) are re-read from Redis."""
    grace_s: float = 5.0
    """On shutdown, running streams get this long to finish."""
    max_attempts: int = 3
    """Tries per request when a worker fails under it (died, unreachable, out of KV). A
    later try avoids the workers that failed it and continues from the tokens already
    streamed (the prompt plus those tokens is prefilled again): the client sees one stream."""
    worker_down_s: float = 10.0
    """A worker that died or was unreachable gets no new requests for this long."""
    no_worker_wait_s: float = 10.0
    """With no decode worker to run a try on (all gone, or all failed this request), how long
    the request waits (within its deadline) for one to join, e.g. a replacement, before it
    ends UNAVAILABLE."""
    kv_wait_s: float = 1.0
    """How long an admitted request no decode worker has KV room for right now waits (within
    its deadline) for room, re-routing as bookings end and heartbeats come, before it ends
    RESOURCE_EXHAUSTED. Admission counts the decode pool as a whole; one worker can be short
    while the pool is not (blocks round up, the load splits unevenly, heartbeats lag)."""
    max_request_bytes: int = 16 << 20
    """Largest Generate request accepted (grpc answers a larger one RESOURCE_EXHAUSTED,
    "received message larger than max"). A text prompt the size of a 128k-token context is
    about 0.5 MB."""
    tokenizer_dir: str | None = None
    """Directory with the model's tokenizer.json (the model directory); None: prompts
    must come as token ids and stop strings are refused."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector for the router's trace spans (`control.tracing`); None:
    `$OTEL_EXPORTER_OTLP_ENDPOINT`, or no tracing."""
    request_timeout_s: float = 600.0
    """The deadline of a request whose caller sets none (every HTTP request; a gRPC call
    without a deadline): queued, prefilled and streamed within it, else DEADLINE_EXCEEDED / 504."""
    http_deadlines: HttpDeadlines = field(default_factory=HttpDeadlines)
    """How long the HTTP API waits for a request's head and body, and the connections it holds."""
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    """How much one OpenAI request may hold (messages, tools, names, template kwargs)."""
    api_keys: ApiKeys | None = None
    """Keys a caller must show on both doors (router/api_keys.py); None: the doors are open."""
    open_paths: tuple[str, ...] = ("/health",)
    """HTTP paths served without a key (gRPC health checks are always open)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names HTTP requests may name beside the loopback ones a loopback-bound router
    answers to; bound wider, the only ones (empty: any)."""
    worker_networks: tuple[str, ...] = ()
    """Where workers' addresses may be (CIDRs, or host names matched exactly): a heartbeat
    naming another address is skipped. Empty: any address that is not globally routable."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """Key of the block hashes: the workers' `cluster_secret`, so the KV index matches them
    (required to serve; there is no built-in one)."""
    internal_tls: bool = True
    """Mutual TLS on every connection between members (gRPC between routers, workers and KV
    stores; kvfabric tcp), with certificates each member makes from the cluster secret
    (control/tls.py). Off only on a network you trust, and on every member alike."""
    given_tls: MemberTLS | None = field(default=None, repr=False)
    """As the workers' (`WorkerConfig.given_tls`): a certificate of the deployment's own PKI."""

    @property
    def tls(self) -> MemberTLS | None:
        """This router's TLS identity in its cluster (None: internal TLS off, or no secret)."""
        return tls_of(self.cluster_secret, self.internal_tls, self.given_tls)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or none, got "
                             f"{self.reasoning_parser!r}")
        WorkerNetworks(self.worker_networks)  # a malformed network is an error here, at start
        if not self.responses_ttl_s > 0 or self.responses_max_bytes < 1:
            raise ValueError(f"responses_ttl_s and responses_max_bytes must be positive, got {self.responses_ttl_s}, "
                             f"{self.responses_max_bytes}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in 0..65535 (or None for no HTTP API), got {self.http_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535 (or None for no /metrics), got {self.metrics_port}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.kv_wait_s < 0:
            raise ValueError(f"kv_wait_s must be at least 0, got {self.kv_wait_s}")
        if min(self.prefill_timeout_s, self.reserve_timeout_s, self.decode_idle_timeout_s, self.busy_wait_s) <= 0:
            raise ValueError("prefill_timeout_s, reserve_timeout_s, decode_idle_timeout_s and busy_wait_s must be positive")
        if self.no_worker_wait_s < 0:
            raise ValueError(f"no_worker_wait_s must be >= 0, got {self.no_worker_wait_s}")
        if self.max_attempts < 1 or self.worker_down_s < 0:
            raise ValueError(f"max_attempts must be >= 1 and worker_down_s >= 0, got {self.max_attempts}, "
                             f"{self.worker_down_s}")
