"""The fleet's control plane: the workers' heartbeats, and the controller's autoscaler loop
(PoolGauge -> control/autoscaler.py `decide` -> launch or drain the cheapest worker by
`removal_cost`), as the live controller runs them. A part of `Fleet` (sim/fleet.py), which
holds the state named below; split out so each file reads as one thing."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from control.autoscaler import AutoscaleState, decide
from control.heartbeat import Heartbeat, ModelFacts
from control.pool_gauge import PoolGauge, removal_cost
from router.admission import AdmissionQueue
from router.frontend import ItlWindow
from router.kv_index import KVIndex
from router.loads import LoadBook
from sim.fleet_types import FleetConfig, Role, Worker

AUTOSCALE_TICK_S = 1.0
VOCAB = 128256


class PoolControl:
    """Fleet's heartbeats, autoscaler tick and drains (the state it reads is Fleet's)."""

    config: FleetConfig
    now: float
    workers: dict[str, Worker]
    loads: LoadBook
    index: KVIndex
    queue: AdmissionQueue
    itl: ItlWindow
    gauge: PoolGauge
    scale_state: AutoscaleState
    actions: list[tuple[float, str]]
    pool_sizes: list[tuple[float, int, int]]
    _left: int
    at: Callable[..., None]
    _launch: Callable[..., Any]

    def _heartbeats(self) -> None:
        beats = {w.worker_id: self._beat(w) for w in self.workers.values() if w.stopped_at is None}
        self.loads.set_heartbeats(beats)
        if self._left:
            self.at(self.now + self.config.heartbeat_s, self._heartbeats)

    def _beat(self, w: Worker) -> Heartbeat:
        load = w.engine.load()
        if w.beat is not None and w.beat[0] == (load, w.state):
            return w.beat[1]  # type: ignore[no-any-return]
        facts = ModelFacts("sim", self.config.block_size, VOCAB, self.config.max_model_len, load.num_total_blocks)
        beat = Heartbeat(w.worker_id, w.role, state=w.state, facts=facts, load=load)  # type: ignore[arg-type]
        w.beat = ((load, w.state), beat)
        return beat

    def _autoscale(self) -> None:
        c = self.config
        assert c.autoscale is not None
        members = [(w.worker_id, w.role, w.state) for w in self.workers.values() if w.stopped_at is None]
        beats = {w: self.loads.heartbeats[w] for w, _, _ in members if w in self.loads.heartbeats}
        snapshot = self.gauge.snapshot(members, beats, {"sim": {
            "itl_p50_ms": self.itl.p50_ms(), "num_queued": self.queue.num_queued,
            "inflight_tokens": self.queue.inflight_tokens, "budget_tokens": self.queue.budget_tokens}})
        decision = decide(snapshot, self.scale_state, self.now, c.autoscale)
        self.scale_state = decision.state
        if "->" in decision.reason:
            self.actions.append((self.now, decision.reason))
        for role in ("prefill", "decode"):
            self._reconcile(role, decision.target(role))  # type: ignore[arg-type]
        self.itl.samples.clear()  # the next tick measures its own window
        if self._left:
            self.at(self.now + AUTOSCALE_TICK_S, self._autoscale)

    def _reconcile(self, role: Role, target: int) -> None:
        """As the controller: launch up to the target; over it, drain the cheapest serving worker."""
        live = [w for w in self.workers.values() if w.role == role and w.state in ("starting", "serving")]
        for _ in range(target - len(live)):
            self._launch(role, ready_at=self.now + self.config.startup_s)
        draining = any(w.role == role and w.state == "draining" for w in self.workers.values())
        serving = [w for w in live if w.state == "serving"]
        if len(live) > target and not draining and serving:
            w = min(serving, key=lambda w: removal_cost(w.worker_id, self.loads.heartbeats.get(w.worker_id)))
            w.state = "draining"
            self._stop_if_drained(w)
        self._record_sizes()

    def _stop_if_drained(self, w: Worker) -> None:
        if w.state == "draining" and not w.busy and not w.engine.has_work and not w.engine.kv.num_held \
                and not w.engine.scheduler.requests:
            w.state, w.stopped_at = "stopped", self.now
            self.loads.num_blocks.pop(w.worker_id, None)
            self.index.forget_worker(w.worker_id)
            self._record_sizes()

    def _record_sizes(self) -> None:
        sizes = tuple(sum(w.role == r and w.state in ("serving", "draining") for w in self.workers.values())
                      for r in ("prefill", "decode"))
        if not self.pool_sizes or self.pool_sizes[-1][1:] != sizes:
            self.pool_sizes.append((self.now, *sizes))
