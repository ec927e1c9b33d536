"""Work too long for the router's event loop (tokenizing a long prompt, rendering a long
conversation, checking a large constraint), run on a small pool of its own: at most
`workers` at once, at most `max_waiting` admitted (past it RESOURCE_EXHAUSTED with a retry
hint), each answered within `timeout_s` (past it INVALID_ARGUMENT: the request is too large
to prepare). The work runs where it lets go of the GIL (the tokenizer's batch form) or is
Python (which yields it every few ms), so the loop's other streams go on meanwhile.
Torch-free.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from router.attempt import RequestFailed

T = TypeVar("T")


class OffLoop:
    def __init__(self, workers: int = 2, max_waiting: int = 32, timeout_s: float = 30.0) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="router-prepare")
        self.max_waiting, self.timeout_s = max_waiting, timeout_s
        self.num_running = 0
        """Admitted and not yet finished (running or waiting for a worker; one past its
        deadline counts until its work ends, so timeouts cannot pile work up)."""
        self.num_refused = self.num_timed_out = 0

    async def run(self, work: Callable[[], T]) -> T:
        if self.num_running >= self.max_waiting:
            self.num_refused += 1
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.num_running} long requests are being "
                                "prepared (tokenized, rendered, their constraints checked); retry", 1.0)
        self.num_running += 1
        future = asyncio.get_running_loop().run_in_executor(self.pool, work)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            self.num_timed_out += 1
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"preparing the request took over {self.timeout_s:g} s: its prompt, conversation or "
                                "constraint is too large") from None

    def _done(self, future: asyncio.Future) -> None:  # type: ignore[type-arg]
        self.num_running -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a late failure is not logged as never retrieved

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
