"""Stored responses of the Responses API in the cluster's Redis, shared by every router replica.

    {ns}:resp:{tenant}:{id}   a stored response (msgpack `StoredResponse`), expiring after the TTL
    {ns}:resps:{tenant}       the tenant's ids, scored by when each was stored (ms)
    {ns}:respbytes:{tenant}   the tenant's ids -> their sizes in bytes

`tenant` is a hash of the tenant an API key names (one shared tenant without keys), so a
response is found only by the tenant that stored it: another's id reads as not found. A
tenant's stored bytes are capped: storing past the cap drops its oldest responses first.
Each put is one Lua script (atomic across replicas); every call is bounded by the client's
timeouts, and a Redis that cannot be reached is `StoreUnavailable`.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import redis.asyncio

from control.redis_url import readable

PUT = """
local item, index, sizes = KEYS[1], KEYS[2], KEYS[3]
local prefix, id, value = ARGV[1], ARGV[2], ARGV[3]
local ttl, now, cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local size = string.len(value)
if size > cap then return -1 end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl)) do
  redis.call('HDEL', sizes, old)
  redis.call('ZREM', index, old)
end
local total = 0
for _, n in ipairs(redis.call('HVALS', sizes)) do total = total + tonumber(n) end
local dropped = 0
while total + size > cap do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if not oldest then break end
  total = total - tonumber(redis.call('HGET', sizes, oldest) or '0')
  redis.call('DEL', prefix .. oldest)
  redis.call('HDEL', sizes, oldest)
  redis.call('ZREM', index, oldest)
  dropped = dropped + 1
end
redis.call('SET', item, value, 'PX', ttl)
redis.call('ZADD', index, now, id)
redis.call('HSET', sizes, id, size)
redis.call('PEXPIRE', index, ttl)
redis.call('PEXPIRE', sizes, ttl)
return dropped
"""

DELETE = """
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class StoredResponse(msgspec.Struct, frozen=True):
    response: dict[str, Any]
    """The Response object as it was returned."""
    conversation: list[dict[str, Any]]
    """The conversation up to and with its output, as chat messages (no instructions): what a
    follow-up with `previous_response_id` continues."""


class StoreUnavailable(Exception):
    """Redis could not be reached (or answered an error)."""


class ResponseTooLarge(Exception):
    """A response larger than its tenant's whole cap."""


class ResponseStore:
    def __init__(self, redis_url: str, namespace: str, ttl_s: float, max_bytes_per_tenant: int,
                 timeout_s: float = 2.0) -> None:
        self.client = redis.asyncio.Redis.from_url(readable(redis_url), socket_timeout=timeout_s,
                                                   socket_connect_timeout=timeout_s)
        self.ns, self.ttl_ms, self.cap = namespace, int(ttl_s * 1000), max_bytes_per_tenant
        self._put = self.client.register_script(PUT)
        self._delete = self.client.register_script(DELETE)

    def _keys(self, tenant: str | None, response_id: str) -> tuple[str, str, str, str]:
        t = hashlib.sha256((tenant or "").encode()).hexdigest()[:32]
        prefix = f"{self.ns}:resp:{t}:"
        return prefix + response_id, f"{self.ns}:resps:{t}", f"{self.ns}:respbytes:{t}", prefix

    async def put(self, tenant: str | None, response_id: str, stored: StoredResponse) -> int:
        """Stores it for the TTL; returns how many of the tenant's oldest responses were dropped to fit."""
        item, index, sizes, prefix = self._keys(tenant, response_id)
        value = msgspec.msgpack.encode(stored)
        try:
            dropped = int(await self._put(keys=[item, index, sizes],
                                          args=[prefix, response_id, value, self.ttl_ms, int(time.time() * 1000),
                                                self.cap]))
        except (redis.RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(str(e)) from None
        if dropped < 0:
            raise ResponseTooLarge(f"{len(value)} bytes, over the {self.cap} bytes a tenant may store")
        return dropped

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The tenant's stored response (None: never stored by this tenant, expired, or deleted)."""
        try:
            value = await self.client.get(self._keys(tenant, response_id)[0])
        except (redis.RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(str(e)) from None
        return None if value is None else msgspec.msgpack.decode(value, type=StoredResponse)

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        item, index, sizes, _ = self._keys(tenant, response_id)
        try:
            return bool(await self._delete(keys=[item, index, sizes], args=[response_id]))
        except (redis.RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(str(e)) from None

    async def close(self) -> None:
        await self.client.aclose()
