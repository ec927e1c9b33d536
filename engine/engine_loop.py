"""EngineLoop: one thread owns an LLMEngine; other threads (an asyncio loop, a gRPC server) call into it.

The engine is not thread-safe, so every access goes through `call(fn)`: `fn(engine)`
runs on the loop thread between steps and its result comes back as a
`concurrent.futures.Future` (wrap it with `asyncio.wrap_future` in async code). One
turn of the loop: run queued calls -> `idle_hook` (e.g. kvfabric events) -> one engine
step -> `on_outputs`. With nothing to step, the thread sleeps on the call queue (or in
`idle_hook`, when it says it is waiting for something), so it never spins.
"""
from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine, RequestOutput
from engine.types import EngineStopped

logger = logging.getLogger(__name__)

T = TypeVar("T")

IdleHook = Callable[[float], bool]
"""Called each turn with how long it may wait (s); returns True if it did work."""


def freeze_startup_heap() -> None:
    """For a process that serves from now on (a worker actor, after it built its engine):
    moves every object alive now (imported modules, the model's and tokenizer's Python
    objects) out of the cyclic collector's reach, as vLLM does. Otherwise each full
    collection walks them all while the engine thread holds the GIL: 90 ms measured with
    the `small` model loaded, a stall of every stream on the worker. Not for processes that
    build and drop engines (tests): frozen cycles are never collected."""
    gc.collect()
    gc.freeze()


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[RequestOutput]], None],
        idle_hook: IdleHook | None = None,
        hook_wait_s: float = 0.002,
        idle_wait_s: float = 0.05,
        name: str = "engine-loop",
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`on_death`: called (on the loop's thread) when a step raised and the loop ended: a
        worker exits then, as a crashed one would, rather than serve on without an engine."""
        self.engine = engine
        self.on_death = on_death
        self.on_outputs = on_outputs
        self.idle_hook = idle_hook
        self.hook_wait_s = hook_wait_s
        """How long idle_hook may block when the engine has nothing to step."""
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.num_steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stop.is_set():
            fut.set_exception(EngineStopped("the engine loop has stopped"))
        else:
            self._calls.put((fn, fut))
        return fut

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._calls.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
        except BaseException as e:  # a bug, a device fault, a lost tensor-parallel rank: fail every later call
            logger.exception("engine loop died")
            self.error = e
            self._stop.set()
        self._fail_pending()
        if self.error is not None and self.on_death is not None:
            self.on_death(self.error)

    def _turn(self) -> None:
        ran_calls = self._run_calls(block_s=0.0)
        busy = self.engine.has_schedulable()
        hooked = False
        if self.idle_hook is not None:
            hooked = self.idle_hook(0.0 if busy or ran_calls else self.hook_wait_s)
        if self.engine.has_schedulable():
            outputs = self.engine.step()
            self.num_steps += 1
            if outputs:
                self.on_outputs(outputs)
        elif not (ran_calls or hooked or self.engine.has_unfinished()):
            self._run_calls(block_s=self.idle_wait_s)

    def _run_calls(self, block_s: float) -> bool:
        ran = False
        while True:
            try:
                item = self._calls.get(timeout=block_s) if block_s > 0 and not ran else self._calls.get_nowait()
            except queue.Empty:
                return ran
            if item is None:
                return ran
            fn, fut = item
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # the caller gets it; the loop goes on
                fut.set_exception(e)

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(EngineStopped(f"the engine loop has stopped: {self.error!r}"))
