"""Child-process ends of kvfabric tests: a sender or a receiver driven over a Pipe.

Each command gets ("ok", value) or ("err", error type name, message), so the parent
asserts on what the real API raised in another process.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvfabric import (
    BlockRegion, FabricError, FabricLayout, FabricReceiver, FabricSender, ReceiverConfig, SenderConfig,
    ShmSegment, Ticket,
)

LAYOUT = FabricLayout("fabric-test", "bfloat16", num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype_bytes=2)


def source_blocks(num_blocks: int, block_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)


def sender_main(pipe: Connection, layout_wire: dict, num_blocks: int, seed: int, config: dict[str, Any]) -> None:
    layout = FabricLayout.from_wire(layout_wire)
    sender = FabricSender(layout, BlockRegion(source_blocks(num_blocks, layout.block_bytes, seed)), SenderConfig(**config))
    transfers = {}
    pipe.send(("ok", "ready"))
    while True:
        cmd, *args = pipe.recv()
        try:
            result: Any = None
            if cmd == "open":
                ticket = Ticket.from_wire(args[0])
                transfers[ticket.request_id] = t = sender.open(ticket)
                result = t.transport
            elif cmd == "push":
                rid, src_ids, first_index, delay_s = args
                time.sleep(delay_s)
                transfers[rid].push(src_ids, first_index)
            elif cmd == "finish":
                rid, first_token_id, num_tokens = args
                transfers.pop(rid).finish(first_token_id, num_tokens)
            elif cmd == "abort":
                transfers.pop(args[0]).abort()
            elif cmd == "exit":
                sender.close()
                pipe.send(("ok", None))
                return
            pipe.send(("ok", result))
        except (FabricError, ValueError) as e:
            pipe.send(("err", type(e).__name__, str(e)))


def receiver_main(pipe: Connection, layout_wire: dict, num_blocks: int, config: dict[str, Any]) -> None:
    layout = FabricLayout.from_wire(layout_wire)
    seg = ShmSegment.create(num_blocks * layout.block_bytes)
    region = BlockRegion(seg.data.reshape(num_blocks, layout.block_bytes))
    receiver = FabricReceiver(layout, region, ReceiverConfig(**config), shm=seg)
    pipe.send(("ok", receiver.address.to_wire()))
    while True:
        cmd, *args = pipe.recv()
        if cmd == "expect":
            pipe.send(("ok", receiver.expect(*args).to_wire()))
        elif cmd == "poll":
            pipe.send(("ok", [repr(e) for e in receiver.poll(args[0])]))
        elif cmd == "blocks":
            pipe.send(("ok", region.array[args[0]].tobytes()))
        elif cmd == "exit":
            receiver.close()
            region = None  # type: ignore[assignment]
            seg.close()  # a multiprocessing child skips atexit: unlink here
            pipe.send(("ok", None))
            return


PRELOAD = ["tests.integration.fabric_peer", "tests.integration.prefill_peer", "tests.integration.tier_peer"]
"""What the children's fork server imports once (torch, transformers, the engine, kvfabric):
a child spawned afresh spent about 3 CPU-seconds importing them before its first command,
on a 2-core machine where the suite is CPU-bound."""


def child_context() -> Any:
    """multiprocessing's fork server, which has imported `PRELOAD` and holds nothing of the test
    process (no threads, sockets or Ray): each child is a fork of it. It keeps the environment
    of its start: a test that needs a child to see another variable passes it as an argument."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Peer:
    """The parent's handle on a child process."""

    def __init__(self, target: Any, *args: Any, daemon: bool = True) -> None:
        """`daemon` False: a child that starts children of its own (a split worker's ranks)."""
        ctx = child_context()
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=daemon)
        self.process.start()
        self.hello = self.call_raw(None, timeout_s=60)

    def call_raw(self, cmd: tuple | None, timeout_s: float = 10) -> Any:
        if cmd is not None:
            self.pipe.send(cmd)
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"child did not answer {cmd!r} in {timeout_s} s")
        reply = self.pipe.recv()
        if reply[0] != "ok":
            raise AssertionError(f"child raised {reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, *cmd: Any, timeout_s: float = 10) -> Any:
        return self.call_raw(cmd, timeout_s)

    def call_err(self, *cmd: Any, timeout_s: float = 10) -> tuple[str, str]:
        """A command that must fail in the child: (error type name, message)."""
        self.pipe.send(cmd)
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"child did not answer {cmd!r} in {timeout_s} s")
        reply = self.pipe.recv()
        assert reply[0] == "err", f"{cmd[0]} unexpectedly succeeded"
        return reply[1], reply[2]

    def send(self, *cmd: Any) -> None:
        self.pipe.send(cmd)

    def reply(self, timeout_s: float = 10) -> tuple:
        if not self.pipe.poll(timeout_s):
            raise TimeoutError(f"child did not answer in {timeout_s} s")
        return self.pipe.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit")
            except (TimeoutError, AssertionError, BrokenPipeError, EOFError):
                pass
        self.process.kill()
        self.process.join(5)
