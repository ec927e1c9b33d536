"""kvfabric between workers of different tensor-parallel degrees: each receiver rank's pool
gets exactly its KV heads, from whichever sender rank holds them, over shm and tcp; a
split that cannot be filled is refused at the handshake, naming why.

A model of 4 KV heads: its whole KV (random bytes, [blocks, layers, K/V, tokens, heads,
head dim]) is cut into the sender ranks' pools as tensor parallelism cuts it; after the
transfer each receiver rank's pool must equal the whole KV's cut for that rank, byte for byte.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvfabric import (
    BlockRegion,
    FabricLayout,
    FabricReceiver,
    FabricSender,
    HandshakeError,
    KVArrived,
    ReceiverConfig,
    SenderConfig,
    ShmSegment,
)
from kvfabric.layout import HeadPiece, head_pieces

HEADS, LAYERS, BLOCK, DIM = 4, 2, 4, 8
NUM_SRC, NUM_DST = 24, 32


def layout(world: int, heads: int = HEADS) -> FabricLayout:
    """`heads` KV heads split `world` ways as engine/parallel/tensor_parallel.py splits them (replicated
    where ranks outnumber heads)."""
    local = max(heads // world, 1)
    shards = tuple(r * heads // world for r in range(world))
    return FabricLayout("heads-test", "float32", LAYERS, BLOCK, local, DIM, 4, model_kv_heads=heads, shards=shards)


def whole_kv(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (NUM_SRC, LAYERS * 2 * BLOCK, HEADS, DIM * 4), dtype=np.uint8)


def cut(kv: np.ndarray, lay: FabricLayout, rank: int) -> np.ndarray:
    first = lay.shards[rank]
    return np.ascontiguousarray(kv[:, :, first:first + lay.num_kv_heads]).reshape(kv.shape[0], -1)


class Pools:
    """A receiver's ranks' pools in shared memory (zeros), as a split decode worker has them."""

    def __init__(self, lay: FabricLayout) -> None:
        self.segments = [ShmSegment.create(NUM_DST * lay.block_bytes) for _ in range(lay.world)]
        self.regions = [BlockRegion(s.data.reshape(NUM_DST, lay.block_bytes)) for s in self.segments]
        self.receiver = FabricReceiver(lay, self.regions, ReceiverConfig(io_timeout_s=5), shm=self.segments[0],
                                       shm_ranks=self.segments[1:])

    def close(self) -> None:
        self.receiver.close()
        for s in self.segments:
            s.close()


def test_the_pieces_of_each_split() -> None:
    assert head_pieces(layout(1), layout(1)) == [HeadPiece(0, 0, 0, 0, 4)]
    assert head_pieces(layout(2), layout(1)) == [HeadPiece(0, 0, 0, 0, 2), HeadPiece(1, 0, 0, 2, 2)]
    assert head_pieces(layout(1), layout(2)) == [HeadPiece(0, 0, 0, 0, 2), HeadPiece(0, 2, 1, 0, 2)]
    assert head_pieces(layout(2), layout(4)) == [HeadPiece(0, 0, 0, 0, 1), HeadPiece(0, 1, 1, 0, 1),
                                                 HeadPiece(1, 0, 2, 0, 1), HeadPiece(1, 1, 3, 0, 1)]
    # 2 heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1; each replica gets its head
    assert head_pieces(layout(1, 2), layout(4, 2)) == [HeadPiece(0, 0, 0, 0, 1), HeadPiece(0, 0, 1, 0, 1),
                                                       HeadPiece(0, 1, 2, 0, 1), HeadPiece(0, 1, 3, 0, 1)]
    assert head_pieces(layout(4, 2), layout(1, 2)) == [HeadPiece(0, 0, 0, 0, 1), HeadPiece(2, 0, 0, 1, 1)]
    with pytest.raises(ValueError, match="do not cover the model's 4 exactly"):
        FabricLayout("m", "float32", 1, 4, 2, 8, 4, model_kv_heads=4, shards=(0, 1))
    with pytest.raises(ValueError, match="the sender's model has 2 KV heads, the receiver's 4"):
        head_pieces(layout(1, 2), layout(2))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (1, 1)])
def test_each_receiver_rank_gets_exactly_its_heads(p: int, d: int, transport: str) -> None:
    src_layout, dst_layout = layout(p), layout(d)
    kv = whole_kv(seed=10 * p + d)
    sources = [cut(kv, src_layout, r) for r in range(p)]
    pools = Pools(dst_layout)
    sender = FabricSender(src_layout, [BlockRegion(s) for s in sources], SenderConfig(transport=transport,
                                                                                      checksum=True))
    try:
        src_ids = [3, 4, 5, 9, 10, 17, 0]
        dst_ids = [30, 2, 3, 4, 11, 12, 20]  # runs adjacent on one side, both, or neither
        ticket = pools.receiver.expect("r1", list(dst_ids), num_skip_blocks=1)  # the first is cached there
        transfer = sender.open(ticket)
        assert transfer.transport == transport
        transfer.push(src_ids[1:4], 1)
        transfer.push(src_ids[4:], 4)
        transfer.finish(first_token_id=7, num_tokens=len(src_ids) * BLOCK)
        events = []
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            events = pools.receiver.poll(0.05)
        [arrived] = events
        assert isinstance(arrived, KVArrived) and arrived.first_token_id == 7
        for rank, region in enumerate(pools.regions):
            want = cut(kv, dst_layout, rank)
            assert np.array_equal(region.array[list(dst_ids[1:])], want[src_ids[1:]]), f"rank {rank}"
            assert not region.array[dst_ids[0]].any(), "the cached block is never written"
        assert pools.receiver.num_reservations() == 0
        untouched = sorted(set(range(NUM_DST)) - set(dst_ids[1:]))
        assert not any(region.array[untouched].any() for region in pools.regions)
    finally:
        sender.close()
        pools.close()


def test_a_split_of_another_model_is_refused_naming_the_heads() -> None:
    pools = Pools(layout(2))
    sender = FabricSender(layout(1, 2), [BlockRegion(np.zeros((NUM_SRC, layout(1, 2).block_bytes), np.uint8))])
    try:
        ticket = pools.receiver.expect("r1", [0, 1], 0)
        with pytest.raises(HandshakeError, match="num_kv_heads differs: sender 2, receiver 4") as e:
            sender.open(ticket)
        assert e.value.field == "num_kv_heads"
    finally:
        sender.close()
        pools.close()


def test_a_device_pool_refuses_a_split_it_would_have_to_move_head_by_head() -> None:
    """GPU pools move whole blocks between equal degrees only, but over nixl: a receiver over a
    device pool (a stand-in region: nothing is copied) answers a TP-2 sender's hello with the
    reason, and a nixl hello is judged on its transport alone."""
    from kvfabric.cuda import DeviceRegion
    from kvfabric.wire import Challenge, Conn, Hello, HelloErr, HelloReply, dial

    whole = layout(1)
    receiver = FabricReceiver(whole, DeviceRegion(1 << 32, NUM_DST, whole.block_bytes, 0), ReceiverConfig())
    try:
        a = receiver.address
        conn = Conn(dial(a.host, a.port, None, 5), 5)
        assert isinstance(conn.recv(Challenge), Challenge)
        conn.send(Hello(layout(2).to_wire(), "nccl", host_id="another-host"))
        reply = conn.recv(HelloReply)
        assert isinstance(reply, HelloErr) and reply.field == "shards"
        assert "GPU pools move whole blocks between workers of one tensor-parallel degree" in reply.error
        conn.close()
        conn = Conn(dial(a.host, a.port, None, 5), 5)  # nixl moves any split (a descriptor per row): not the shards
        assert isinstance(conn.recv(Challenge), Challenge)
        conn.send(Hello(layout(2).to_wire(), "nixl", host_id="another-host"))
        reply = conn.recv(HelloReply)
        assert isinstance(reply, HelloErr) and reply.field == "transport"  # (this one offers no nixl)
        conn.close()
    finally:
        receiver.close()
