"""AdmissionConfig: the router's admission settings (every field documented, validated)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


UNKNOWN_POOL_TOKENS = 262_144
"""The token budget while the decode pool's KV is unknown and no cap is set."""


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight_tokens: int | None = None
    """A cap on the token budget: the sum of the admitted requests' costs (prompt + the output
    each is charged, `charge_output`). None: no cap of its own; the decode pool's KV sets the budget, and
    `UNKNOWN_POOL_TOKENS` until the router knows the pool. A fixed default would cap a fleet:
    262,144 tokens (the default until 2026-11) held 17 of a long-context trace's requests in
    flight, so 32 H100s served no more than 16 (sim/, `splitserve simulate`)."""
    max_inflight_requests: int = 512
    """Most requests admitted at once."""
    max_queued_per_priority: int = 256
    """Most requests waiting per priority class; one more is refused."""
    max_queue_wait_s: float = 30.0
    """Longest a request may wait for admission; a longer estimated wait is refused up front."""
    min_retry_after_s: float = 0.2
    """Smallest retry-after hint given with a refusal."""
    charge_output: str = "expected"
    """What admission charges for a request's output: "expected", a high quantile of what
    finished requests of its tenant and route generated (router/output_lengths.py; a request
    that runs past it is charged what it holds from then on, and a decode worker whose pool
    fills preempts), or "max", its max_tokens within the context (no request ever waits on a
    decode worker for room, and a chat without max_tokens is charged the whole context)."""
    expected_quantile: float = 0.9
    """The quantile of finished requests' output lengths a request is charged ("expected")."""
    expected_prior_tokens: int = 256
    """The output charged before any request of its kind finished ("expected")."""
    kv_overcommit: float = 1.0
    """The budget is at most this many times the decode pool's KV capacity in tokens. At
    1.0 every admitted request can hold its whole KV at once: none waits on a decode
    worker for room. Above 1.0 bets that requests stop before `max_tokens`."""
    share_headroom: float = 0.1
    """Part of the KV capacity the budget leaves free for tenants under their fair share (they
    are admitted into it past the budget): without it, a flood that fills the budget holds
    every decode block, and a light tenant's request, though admitted first, waits for the
    flood's requests to end before it gets room on a decode worker."""
    aging_s: float = 10.0
    """A priority class whose oldest request has waited this long is served as one class
    more important (two after twice as long, and so on)."""
    ttft_budget_s: float | None = None
    """A time-to-first-token budget for admitted requests (None: none). Set, the router
    measures each admitted request's time from admission to its first token and steers the
    token budget by it: cut by a third when the recent p90 passes half the budget (the other
    half is the admission wait, bounded to it too), grown back while it stays under a
    quarter and the budget is what holds requests back. Under overload, what gets in then
    meets the budget and the rest is refused at once."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Tenant -> weight of its fair share within a priority class; tenants not named weigh 1."""
    tenant_quota_tokens: Mapping[str, int] = field(default_factory=dict)
    """Tenant -> most tokens it may have admitted at once (no cap for tenants not named)."""

    def __post_init__(self) -> None:
        for name in ("max_inflight_tokens", "max_inflight_requests", "max_queued_per_priority"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.charge_output not in ("expected", "max"):
            raise ValueError(f"charge_output must be expected or max, got {self.charge_output!r}")
        if not 0 < self.expected_quantile <= 1 or self.expected_prior_tokens < 1:
            raise ValueError("expected_quantile must be in (0, 1] and expected_prior_tokens positive, got "
                             f"{self.expected_quantile} and {self.expected_prior_tokens}")
        if self.ttft_budget_s is not None and not self.ttft_budget_s > 0:
            raise ValueError(f"ttft_budget_s must be positive, got {self.ttft_budget_s}")
        if not 0 <= self.share_headroom < 1:
            raise ValueError(f"share_headroom must be in [0, 1), got {self.share_headroom}")
        if min(self.max_queue_wait_s, self.min_retry_after_s, self.kv_overcommit, self.aging_s) <= 0:
            raise ValueError("max_queue_wait_s, min_retry_after_s, kv_overcommit and aging_s must be positive")
        bad = {t: w for t, w in self.tenant_weights.items() if not w > 0} | \
              {t: q for t, q in self.tenant_quota_tokens.items() if q <= 0}
        if bad:
            raise ValueError(f"tenant weights and quotas must be positive, got {bad}")
