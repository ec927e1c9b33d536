"""Who the router can send requests to: the workers' heartbeats, followed at runtime (pure).

`update(heartbeats)` takes the registry's current heartbeats: a worker appears when its
first heartbeat does, follows its state (`starting -> serving -> draining`), and is
gone when its heartbeat expires (`LoadBook.gone` remembers it), or new when it comes
back with a new incarnation (a restart).
When the registry cannot be read the router keeps the last table it had (Redis being
away costs routing hints, never the workers). The model facts the router validates
and hashes with are the ones the serving workers report; a worker whose facts differ
from the others' (another model id, block size) is left out of routing and logged.
"""
from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass

from control.heartbeat import Heartbeat, ModelFacts, Role, TierSpeed
from engine.core.step_model import Row, StepShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: Role
    address: str
    state: str
    incarnation: str
    facts: ModelFacts
    step_model: tuple[float, ...] = ()
    """A decode worker's step time (a, b, c): a + b·requests + c·KV tokens seconds."""
    step_profile: tuple[Row, ...] = ()
    """Its start-up profile: (requests, KV tokens, seconds) per point."""
    kv_store: str = ""
    """The id of the KV store it fetches from (its host's); empty: none."""
    tier_speed: TierSpeed = TierSpeed()
    """What it measured of fetching from stores against computing."""


class Members:
    def __init__(self, networks: tuple[str, ...] = ()) -> None:
        self.networks = WorkerNetworks(networks)
        """Where a worker's address may be: a heartbeat naming another is skipped (the router
        would send it the cluster token with every call)."""
        self.num_refused_addresses = 0
        self._refused: set[tuple[str, str]] = set()
        self._members: dict[str, Member] = {}
        self._draining: set[str] = set()
        """Told to drain by the controller: no new requests, even before its heartbeat says so."""
        self._mismatched: set[str] = set()
        self.facts: ModelFacts | None = None
        """The model facts most serving workers report (None before any worker serves); set by `update`."""
        self.store_addresses: dict[str, str] = {}
        """The registered KV stores: store id -> gRPC address (set by the feed)."""

    def update(self, heartbeats: dict[str, Heartbeat]) -> list[Member]:
        """Applies the registry's heartbeats; returns the members that left (gone, or restarted
        as a new incarnation: the old one's cache and connections are gone with it)."""
        left = [m for w, m in self._members.items()
                if w not in heartbeats or heartbeats[w].incarnation != m.incarnation]
        self._members = {w: Member(w, hb.role, hb.address, hb.state, hb.incarnation, hb.facts,
                                   tuple(float(x) for x in hb.step_model),
                                   tuple(zip(*[iter(map(float, hb.step_profile))] * 3)), hb.kv_store, hb.tier_speed)
                         for w, hb in heartbeats.items() if hb.address and self._allowed(w, hb.address)}
        self._draining &= set(self._members)
        self._check_facts()
        return left

    def _allowed(self, worker_id: str, address: str) -> bool:
        if self.networks.allows(address):
            return True
        if (worker_id, address) not in self._refused:  # counted and logged once a worker and address
            self._refused.add((worker_id, address))
            self.num_refused_addresses += 1
            logger.warning("router: worker %s's heartbeat gives the address %r, outside the workers' networks (%s): "
                           "skipped", worker_id, address[:100], self.networks)
        return False

    def _check_facts(self) -> None:
        self.facts = facts = self._agreed_facts()
        key = _model_key(facts) if facts is not None else None
        mismatched = {w for w, m in self._members.items() if key is not None and _model_key(m.facts) != key}
        for w in sorted(mismatched - self._mismatched):
            logger.warning("router: worker %s serves %s, the others %s: it gets no requests",
                           w, self._members[w].facts, facts)
        self._mismatched = mismatched

    def _agreed_facts(self) -> ModelFacts | None:
        counts = Counter(_model_key(m.facts) for m in self._members.values()
                         if m.state == "serving" and m.facts.complete)  # a size of 0 breaks every request
        if not counts:
            return None
        key, _ = counts.most_common(1)[0]
        return next(m.facts for m in self._members.values() if _model_key(m.facts) == key)

    def serving(self, role: Role) -> list[str]:
        """Workers of `role` that take new requests, sorted by id."""
        return sorted(w for w, m in self._members.items()
                      if m.role == role and m.state == "serving" and w not in self._mismatched | self._draining)

    def drain(self, worker_id: str) -> None:
        """The worker gets no new requests from now on (its heartbeat will say draining soon)."""
        self._draining.add(worker_id)

    def ids(self) -> list[str]:
        return sorted(self._members)

    def roles_and_states(self) -> list[tuple[str, str]]:
        """(role, state) of each member; told to drain counts as draining, a model mismatch as mismatched."""
        return [(m.role, "mismatched" if w in self._mismatched else "draining" if w in self._draining else m.state)
                for w, m in self._members.items()]

    def stores(self) -> list[str]:
        """The KV stores the members fetch from and the registered ones (their event streams: the
        routers' index of the tier)."""
        return sorted({m.kv_store for m in self._members.values() if m.kv_store} | set(self.store_addresses))

    def store_of(self, worker_id: str) -> str:
        m = self._members.get(worker_id)
        return m.kv_store if m is not None else ""

    def tier_speed(self, worker_id: str) -> TierSpeed:
        m = self._members.get(worker_id)
        return m.tier_speed if m is not None else TierSpeed()

    def address(self, worker_id: str) -> str | None:
        m = self._members.get(worker_id)
        return m.address if m is not None else None

    def num_blocks(self) -> dict[str, int]:
        return {w: m.facts.num_total_blocks for w, m in self._members.items()}

    def decode_kv_tokens(self) -> int:
        """KV capacity of the serving decode pool, in tokens (what admission budgets against)."""
        return sum(self._members[w].facts.num_total_blocks * self._members[w].facts.block_size
                   for w in self.serving("decode"))

    def decode_step_model(self) -> tuple[StepShape | None, int]:
        """The serving decode workers' step time and how many serve: the mean of their
        start-up profiles where they ran the same points (else the first worker's, by id), and
        the mean of the online models of those that measured one."""
        serving = sorted(self.serving("decode"))
        models = [self._members[w].step_model for w in serving if len(self._members[w].step_model) == 3]
        linear = tuple(sum(m[i] for m in models) / len(models) for i in range(3)) if models else None
        profiles = [p for w in serving if (p := self._members[w].step_profile)]
        profile: tuple[Row, ...] = ()
        if profiles and all([r[:2] for r in p] == [r[:2] for r in profiles[0]] for p in profiles):
            profile = tuple((n, kv, sum(p[i][2] for p in profiles) / len(profiles))
                            for i, (n, kv, _) in enumerate(profiles[0]))
        elif profiles:
            profile = profiles[0]
        shape = StepShape(linear, profile)  # type: ignore[arg-type]
        return (shape if shape else None), len(serving)

    def max_decode_blocks(self) -> int:
        return max((self._members[w].facts.num_total_blocks for w in self.serving("decode")), default=0)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._members


def _model_key(f: ModelFacts) -> tuple[str, int, int, int]:
    return f.model_id, f.block_size, f.vocab_size, f.max_model_len


class WorkerNetworks:
    """Where workers may be: `networks` (CIDRs, host names matched exactly, or "*": any), or
    when none are given any address that is not globally routable (loopback, private,
    link-local, documentation ranges), no names."""

    def __init__(self, networks: tuple[str, ...] = ()) -> None:
        self.spec = networks
        self.nets = [ipaddress.ip_network(n, strict=False) for n in networks if _is_network(n)]
        self.names = {n.lower() for n in networks if not _is_network(n) and n != "*"}

    def __str__(self) -> str:
        return ", ".join(self.spec) or "addresses that are not globally routable"

    def allows(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if "*" in self.spec:
            return True
        if not port.isdigit() or not 0 < int(port) < 65536 or not host:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        if not self.spec:
            return not ip.is_global and not ip.is_multicast and not ip.is_unspecified
        return any(ip in n for n in self.nets)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True
