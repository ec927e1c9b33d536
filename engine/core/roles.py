"""What a worker's role adds to the engine's step, one object per role beside the core (not
branches on the role inside `step`):

- `PrefillRole`: a request ends at its first token; its blocks are held for the transfer
  layer (`KVCacheManager.hold`, given back through the engine's connector once pushed) and
  given to the `KVHandoff`, which also hears after every step that advanced a request
  (a chunk's blocks are ready to push while the next chunk computes);
- `Role` (both, decode): nothing after a step. A decode worker's reservations for KV
  computed elsewhere go through the connector (engine/kv_connector.py: `reserve`,
  `landed`), outside the step.
"""
from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import KVHandoff
from engine.core.request import FinishReason, Request
from engine.core.scheduler import ScheduledRequest, Scheduler


class Role:
    """Roles both and decode: the step's requests go on until they finish."""

    handoff: KVHandoff | None = None

    def after_step(self, scheduled: list[ScheduledRequest]) -> None:
        """Every request the step advanced, before outputs are built."""

    def after_token(self, request: Request, token_id: int, scheduler: Scheduler, kv: KVCacheManager) -> None:
        """A request that got `token_id` and is not finished."""


class PrefillRole(Role):
    def __init__(self, handoff: KVHandoff | None = None) -> None:
        self.handoff = handoff

    def after_step(self, scheduled: list[ScheduledRequest]) -> None:
        if self.handoff is not None:
            for s in scheduled:
                self.handoff.on_blocks_computed(s.request)

    def after_token(self, request: Request, token_id: int, scheduler: Scheduler, kv: KVCacheManager) -> None:
        """The first token: the request is done here; its blocks go to the transfer layer."""
        block_ids = list(kv.hold(request))
        scheduler.finish(request, FinishReason.PREFILL_DONE, keep_blocks=True)
        if self.handoff is not None:
            self.handoff.on_prefill_finished(request, block_ids, token_id)


def role_for(name: str, handoff: KVHandoff | None = None) -> Role:
    return PrefillRole(handoff) if name == "prefill" else Role()
