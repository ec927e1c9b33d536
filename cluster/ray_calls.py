"""Awaiting Ray calls from asyncio code, always with a timeout (Ray's own await has none)."""
from __future__ import annotations

import asyncio
from typing import Any

CALL_TIMEOUT_S = 30.0


async def await_ref(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """Await a Ray ObjectRef with a timeout."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
