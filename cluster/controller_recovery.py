"""StateStore: where a controller keeps what a restarted one needs, and how it reads it back.

    save(): targets, next ids, members, router ports, autoscaler memory, history
        -> Redis (cluster/controller_state.py), before each launch and drain and every tick
    load(): the record a restarted controller joins with the actors Ray still has by name
        (`Controller._recover`, through `controller_state.plan`); Redis that stays away for
        `RECOVER_TIMEOUT_S` leaves Ray's names alone to recover from
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis

from cluster import controller_state
from cluster.controller_state import Saved

logger = logging.getLogger(__name__)

RECOVER_TIMEOUT_S = 300.0
"""Longest a restarted controller waits for Redis before it recovers from Ray's names alone."""


class StateStore:
    def __init__(self, client: redis.asyncio.Redis, namespace: str) -> None:
        self.client, self.namespace = client, namespace

    async def load(self) -> Saved | None:
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while True:
            try:
                return await controller_state.load(self.client, self.namespace)
            except (redis.RedisError, OSError, TimeoutError) as e:
                if time.monotonic() > deadline:
                    logger.error("controller: Redis unreachable (%s); recovering from Ray's names alone", e)
                    return None
                await asyncio.sleep(1.0)

    async def save(self, saved: Saved) -> None:
        try:
            await controller_state.save(self.client, self.namespace, saved)
        except (redis.RedisError, OSError, TimeoutError) as e:
            logger.warning("controller: could not save its state (%s); recovery falls back to Ray's names", e)
