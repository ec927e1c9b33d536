"""The KV store's gRPC service (proto `KVStore`) and its process.

    worker --Offer / Lookup / Fetch / Stats (gRPC, the cluster token)--> `StoreService` --> `KVStore`
    worker <===================== kvfabric (shm on the host, tcp across hosts) =====================> store pool

Offer and Lookup only take the store's lock; Fetch waits on kvfabric (its push and the
receiver's ack), so it runs on a worker thread, never on the event loop. Hashes and tickets
are checked as any worker's input is: a bad one ends the call INVALID_ARGUMENT with the reason.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging

import grpc

from control.auth import TokenCheck, cluster_token
from control.tls import MemberTLS, add_member_port, client_context, server_context
from kvfabric import FabricLayout, ReceiverConfig, SenderConfig
from kvfabric.pools import offers_nixl
from kvfabric.region import CopyBytes
from kvstore.disk import DiskTier, slot_bytes
from kvstore.store import KVStore
from proto import generate_pb2 as pb
from proto import generate_pb2_grpc as pb_grpc
from proto.convert import ticket_from_pb, ticket_to_pb

logger = logging.getLogger(__name__)


class StoreService(pb_grpc.KVStoreServicer):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    async def Offer(self, request: pb.OfferRequest, context: grpc.aio.ServicerContext) -> pb.OfferReply:
        try:
            ticket, wanted = await asyncio.to_thread(self.store.offer, list(request.block_hashes))  # may spill
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if ticket is None:
            return pb.OfferReply()
        return pb.OfferReply(ticket=ticket_to_pb(ticket), wanted=wanted)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupReply:
        try:
            return pb.LookupReply(num_blocks=self.store.lookup(list(request.block_hashes)))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Fetch(self, request: pb.FetchRequest, context: grpc.aio.ServicerContext) -> pb.FetchReply:
        try:
            ticket = ticket_from_pb(request.ticket)
            hashes = list(request.block_hashes)
            error = await asyncio.to_thread(self.store.fetch, ticket, hashes)
        except ValueError as e:  # InvalidRequestError is one
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.FetchReply(error=error)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StoreStats:
        s = self.store.stats
        return pb.StoreStats(capacity_blocks=self.store.capacity, num_blocks=self.store.num_blocks,
                             block_bytes=self.store.layout.block_bytes, num_offered=s.num_offered,
                             num_stored=s.num_stored, num_lookups=s.num_lookups, num_hit_blocks=s.num_hit_blocks,
                             num_fetched=s.num_fetched, num_evicted=s.num_evicted, bytes_in=s.bytes_in,
                             bytes_out=s.bytes_out, num_fetch_failures=s.num_fetch_failures,
                             store_id=self.store.store_id)


def store_layout(model_dir: str, model_id: str, block_size: int, dtype: str,
                 quantization: str | None = None, kv_cache_dtype: str = "auto") -> FabricLayout:
    """The layout a model's workers push (one rank: every KV head) for a store of its blocks,
    under the name their engines give their KV (`engine.checkpoints.quant_config.kv_model_id`); `dtype`:
    the workers' model dtype, which their pools hold unless `kv_cache_dtype` is fp8."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from engine.model.model_config import ModelConfig
    from engine.checkpoints.quant_config import kv_model_id

    path = resolve_model_dir(model_dir)
    mc = ModelConfig.from_dir(path, quantization)
    if kv_cache_dtype == "fp8":
        dtype = "float8_e4m3fn"
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[dtype]
    return FabricLayout(kv_model_id(model_id or path.resolve().name, mc.fp8, kv_cache_dtype), dtype, mc.num_layers,
                        block_size, mc.num_kv_heads, mc.head_dim, itemsize)


async def serve(store: KVStore, host: str, port: int, secret: bytes | None,
                tls: MemberTLS | None = None) -> tuple[grpc.aio.Server, int]:
    """The store's service on host:port (0: a free one), under mutual TLS when `tls`; returns
    the server and its port."""
    server = grpc.aio.server(interceptors=[TokenCheck(cluster_token(secret))] if secret else None)
    pb_grpc.add_KVStoreServicer_to_server(StoreService(store), server)
    bound = add_member_port(server, f"{host}:{port}", tls)
    await server.start()
    return server, bound


def open_store(layout: FabricLayout, capacity_bytes: int, host: str, advertise_host: str | None,
               secret: bytes | None, copy: CopyBytes = ctypes.memmove, store_id: str = "",
               disk_dir: str | None = None, disk_bytes: int = 0, disk_direct: bool = False,
               tls: MemberTLS | None = None, kv_transport: str | None = None) -> KVStore:
    """A store of `capacity_bytes` of blocks, its kvfabric listener on `host`; with `disk_dir`,
    up to `disk_bytes` more of them spilled into a file there (kvstore/disk.py), with O_DIRECT
    where `disk_direct`; `kv_transport`: the workers' (nixl: offers and pushes over NIXL too)."""
    token = cluster_token(secret) if secret else None
    num_blocks = capacity_bytes // layout.block_bytes
    if num_blocks < 1:
        raise ValueError(f"a KV store of {capacity_bytes} bytes holds no {layout.block_bytes}-byte block")
    disk = DiskTier(disk_dir, disk_bytes // slot_bytes(layout.block_bytes, disk_direct), layout.block_bytes,
                    disk_direct) if disk_dir else None
    return KVStore(layout, num_blocks, ReceiverConfig(host=host, advertise_host=advertise_host, token=token,
                                                      tls=server_context(tls), nixl=offers_nixl("cpu", kv_transport)),
                   SenderConfig(token=token, tls=client_context(tls), transport=kv_transport), copy, store_id, disk)
