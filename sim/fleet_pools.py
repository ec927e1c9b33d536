"""The fleet's control plane: the workers' heartbeats, and the controller's autoscaler loop
(PoolGauge -> control/autoscaler.py `decide` -> launch or drain the cheapest worker by
`removal_cost`), as the live controller runs them. Fleet (sim/fleet.py) holds one; it owns
the autoscaler's state and the record of pool sizes, and reads the workers, the router's
parts and the clock through the fleet it serves."""
from __future__ import annotations

from typing import TYPE_CHECKING

from control.autoscaler import AutoscaleState, decide
from control.heartbeat import Heartbeat, ModelFacts
from control.pool_gauge import PoolGauge, removal_cost
from control.router_stats import RouterStats
from sim.fleet_types import Role, Worker

if TYPE_CHECKING:
    from sim.fleet import Fleet

AUTOSCALE_TICK_S = 1.0
VOCAB = 128256


class PoolControl:
    """The fleet's heartbeats, autoscaler tick and drains."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.gauge = PoolGauge(fleet.clock)
        self.scale_state = AutoscaleState()
        self.actions: list[tuple[float, str]] = []
        """(time, the autoscaler's reason) for each decision that changed a target."""
        self.pool_sizes: list[tuple[float, int, int]] = []
        """(time, prefill workers, decode workers) serving or draining, at each change."""

    def heartbeats(self) -> None:
        f = self.fleet
        f.loads.set_heartbeats({w.worker_id: self._beat(w) for w in f.workers.values() if w.stopped_at is None})
        if f.num_left:
            f.at(f.now + f.config.heartbeat_s, self.heartbeats)

    def _beat(self, w: Worker) -> Heartbeat:
        load = w.engine.load()
        if w.beat is not None and w.beat[0] == (load, w.state):
            return w.beat[1]  # type: ignore[no-any-return]
        c = self.fleet.config
        facts = ModelFacts("sim", c.block_size, VOCAB, c.max_model_len, load.num_total_blocks, c.kv_window)
        beat = Heartbeat(w.worker_id, w.role, state=w.state, facts=facts, load=load)  # type: ignore[arg-type]
        w.beat = ((load, w.state), beat)
        return beat

    def autoscale(self) -> None:
        f = self.fleet
        c = f.config
        assert c.autoscale is not None
        members = [(w.worker_id, w.role, w.state) for w in f.workers.values() if w.stopped_at is None]
        beats = {w: f.loads.heartbeats[w] for w, _, _ in members if w in f.loads.heartbeats}
        snapshot = self.gauge.snapshot(members, beats, {"sim": RouterStats(
            router_id="sim", address="", itl_p50_ms=f.itl.p50_ms(), num_queued=f.queue.num_queued,
            inflight_tokens=f.queue.inflight_tokens, budget_tokens=f.queue.budget_tokens)})
        decision = decide(snapshot, self.scale_state, f.now, c.autoscale)
        self.scale_state = decision.state
        if "->" in decision.reason:
            self.actions.append((f.now, decision.reason))
        for role in ("prefill", "decode"):
            self._reconcile(role, decision.target(role))  # type: ignore[arg-type]
        f.itl.samples.clear()  # the next tick measures its own window
        if f.num_left:
            f.at(f.now + AUTOSCALE_TICK_S, self.autoscale)

    def _reconcile(self, role: Role, target: int) -> None:
        """As the controller: launch up to the target; over it, drain the cheapest serving worker."""
        f = self.fleet
        live = [w for w in f.workers.values() if w.role == role and w.state in ("starting", "serving")]
        for _ in range(target - len(live)):
            f.launch(role, ready_at=f.now + f.config.startup_s)
        draining = any(w.role == role and w.state == "draining" for w in f.workers.values())
        serving = [w for w in live if w.state == "serving"]
        if len(live) > target and not draining and serving:
            w = min(serving, key=lambda w: removal_cost(w.worker_id, f.loads.heartbeats.get(w.worker_id)))
            w.state = "draining"
            self.stop_if_drained(w)
        self.record_sizes()

    def stop_if_drained(self, w: Worker) -> None:
        f = self.fleet
        if w.state == "draining" and not w.busy and not w.engine.has_work and not w.engine.connector.num_lent \
                and not w.engine.scheduler.requests:
            w.state, w.stopped_at = "stopped", f.now
            f.loads.num_blocks.pop(w.worker_id, None)
            f.index.forget_worker(w.worker_id)
            self.record_sizes()

    def record_sizes(self) -> None:
        workers = self.fleet.workers.values()
        sizes = tuple(sum(w.role == r and w.state in ("serving", "draining") for w in workers)
                      for r in ("prefill", "decode"))
        if not self.pool_sizes or self.pool_sizes[-1][1:] != sizes:
            self.pool_sizes.append((self.fleet.now, *sizes))
