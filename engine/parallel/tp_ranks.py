"""A tensor-parallel worker's other ranks: child processes of the worker (rank 0), one per
further GPU (on CPU, processes sharing its cores), joined to it in a process group of their
own (gloo on CPU, NCCL on GPUs) over loopback.

    worker (rank 0): `TensorRanks.start` --spawn--> rank r: `_follower` -> engine/tp_followers.follow
                     <-- init_process_group (tcp://127.0.0.1:port, a timeout on every wait) -->

The worker's engine leads (engine/parallel/tp_followers.py); each follower runs its share of the
model on `cuda:r` (or the CPU). A follower that dies makes the leader's next collective fail:
the worker's engine loop ends and the worker goes down as any dead worker does (its
heartbeat stops, routers retry its requests elsewhere, the pool replaces it). A leader that
dies ends the followers' waits the same way; `stop` ends them in order.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from engine.config import EngineConfig
from engine.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

TIMEOUT_S = 120.0
"""Longest any collective (and the group's start) waits for a rank."""


class TensorRanks:
    def __init__(self, world: int, allocator: Callable[[], Any] | None = None) -> None:
        """`allocator`: makes each follower's pool allocator, one the worker can map (a
        class or a module-level function: it crosses the spawn); None: private pools."""
        self.world = world
        self.allocator = allocator
        self.processes: list[Any] = []

    def start(self, config: EngineConfig) -> EngineConfig:
        """Spawns ranks 1..world-1 and joins rank 0 (this process) to their group; returns the
        leader's engine config."""
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, self.world):
            p = ctx.Process(target=_follower, args=(config, rank, self.world, port, self.allocator),
                            name=f"tp-rank-{rank}", daemon=True)
            p.start()
            self.processes.append(p)
        dist.init_process_group(_backend(config.device), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=self.world, timeout=timedelta(seconds=TIMEOUT_S))
        return dataclasses.replace(config, device=_rank_device(config.device, 0),
                                   tensor_parallel=TensorParallel(0, self.world))

    def stop(self, timeout_s: float = 10.0) -> None:
        """After the engine released its followers: they return; any that does not is killed."""
        import torch.distributed as dist

        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                logger.warning("tensor-parallel rank %s did not stop in %.0f s: killed", p.name, timeout_s)
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _follower(config: EngineConfig, rank: int, world: int, port: int, allocator: Callable[[], Any] | None) -> None:
    import torch
    import torch.distributed as dist

    from engine.parallel.tp_followers import follow

    torch.set_num_threads(1)
    dist.init_process_group(_backend(config.device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        follow(dataclasses.replace(config, device=_rank_device(config.device, rank),
                                   tensor_parallel=TensorParallel(rank, world)), allocator)
    finally:
        dist.destroy_process_group()


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU the worker was given (its CUDA_VISIBLE_DEVICES), or the CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else device
