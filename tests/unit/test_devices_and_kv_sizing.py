"""Device, dtype and GPU share per worker; the KV pool's size from memory figures (pure functions)."""
from __future__ import annotations

import pytest

from engine.model.devices import default_dtype, default_gpus_per_worker, resolve_device
from engine.model.kv_sizing import kv_pool_bytes, num_blocks_for

GIB = 2**30


def test_auto_picks_cuda_only_when_torch_sees_a_gpu() -> None:
    assert resolve_device("auto", 0) == "cpu"
    assert resolve_device("auto", 2) == "cuda"
    assert resolve_device("cpu", 8) == "cpu"
    assert resolve_device("cuda:1", 2) == "cuda:1"
    with pytest.raises(ValueError, match="torch sees no GPU"):
        resolve_device("cuda", 0)
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu", 1)


def test_bfloat16_on_gpu_float32_on_cpu() -> None:
    assert (default_dtype("cuda"), default_dtype("cuda:0"), default_dtype("cpu")) == ("bfloat16", "bfloat16", "float32")


def test_workers_share_a_lone_gpu_and_get_a_whole_one_otherwise() -> None:
    assert default_gpus_per_worker(1, 2) == 0.5  # one prefill + one decode worker on a one-GPU machine
    assert default_gpus_per_worker(1, 4) == 0.25
    assert default_gpus_per_worker(8, 2) == 1.0
    assert default_gpus_per_worker(0, 2) == 1.0  # no GPU on this node: Ray places the workers elsewhere


def test_the_kv_pool_gets_this_workers_share_less_what_the_profile_used() -> None:
    # an 80 GiB GPU, 0.9 of it for this worker, 16 GiB of weights and 2 GiB of peak activations
    assert kv_pool_bytes(80 * GIB, 18 * GIB, 0.9) == int(72 * GIB) - 18 * GIB
    # two workers sharing it at 0.45 each
    assert kv_pool_bytes(80 * GIB, 18 * GIB, 0.45) == int(36 * GIB) - 18 * GIB
    assert num_blocks_for(kv_pool_bytes(80 * GIB, 18 * GIB, 0.45), 2 * 2**20) == 9216


def test_the_pool_never_takes_more_than_is_free_less_a_steps_transient() -> None:
    """A second worker started at the default 0.9 on a GPU another worker fills: its share
    would be 72 - 18 GiB, but 20 GiB is free and a step needs 2 of it, so it gets 18."""
    assert kv_pool_bytes(80 * GIB, 18 * GIB, 0.9, free_bytes=20 * GIB, transient_bytes=2 * GIB) == 18 * GIB
    # plenty free: the share decides, as without a reading
    assert kv_pool_bytes(80 * GIB, 18 * GIB, 0.45, free_bytes=60 * GIB, transient_bytes=2 * GIB) == \
        int(36 * GIB) - 18 * GIB
    with pytest.raises(ValueError, match=r"1\.50 GiB of 80\.0 GiB is free and a step needs 2\.00 GiB of it; other "
                                         r"processes hold the rest.*--gpu-memory-utilization \(two workers: 0\.45"):
        kv_pool_bytes(80 * GIB, 18 * GIB, 0.9, free_bytes=int(1.5 * GIB), transient_bytes=2 * GIB)


def test_no_room_left_says_what_took_it_and_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"may use 0\.20 of 80\.0 GiB = 16\.00 GiB.*already take 18\.00 GiB.*"
                                         r"raise --gpu-memory-utilization"):
        kv_pool_bytes(80 * GIB, 18 * GIB, 0.2)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kv_pool_bytes(80 * GIB, GIB, 1.5)
    assert num_blocks_for(10, 2 * 2**20) == 1


def test_a_worker_advertises_what_peers_can_dial() -> None:
    from control.worker_config import WorkerConfig, route_address

    assert WorkerConfig(model_dir="m").advertised_host("redis://10.1.2.3:6379/0") == "127.0.0.1"  # bound to loopback
    assert WorkerConfig(model_dir="m", host="0.0.0.0").advertised_host("redis://127.0.0.1:6379") == "127.0.0.1"
    assert WorkerConfig(model_dir="m", host="0.0.0.0", advertise_host="node-7").advertised_host(None) == "node-7"
    wildcard = WorkerConfig(model_dir="m", host="0.0.0.0").advertised_host("redis://192.0.2.77:6379/0")
    assert wildcard == route_address("192.0.2.77") and wildcard != "0.0.0.0"  # never the wildcard itself


def test_cpu_workers_share_a_fraction_of_available_memory_never_under_the_old_default() -> None:
    from engine.model.kv_sizing import DEFAULT_CPU_KV_BYTES, cpu_kv_bytes

    gib = 2**30
    assert cpu_kv_bytes(20 * gib, 0.2, 2) == 2 * gib  # 1 prefill + 1 decode on a 24 GiB host
    assert cpu_kv_bytes(gib, 0.2, 4) == DEFAULT_CPU_KV_BYTES  # a small host: never less than before
    with pytest.raises(ValueError, match="CPU KV fraction"):
        cpu_kv_bytes(gib, 0.95, 1)


def test_serve_sizes_cpu_pools_from_memory_unless_kv_cache_mib_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import engine.model.kv_sizing
    from cluster.processes import add_device_flags, placement

    monkeypatch.setattr(engine.model.kv_sizing, "available_memory_bytes", lambda: 10 * 2**30)
    p = argparse.ArgumentParser()
    add_device_flags(p)
    p.add_argument("--gpus-per-worker", type=float, default=None)
    _, _, mib, _, _ = placement(p.parse_args(["--device", "cpu"]), 2)
    assert mib == 1024  # 0.2 of 10 GiB in two parts
    _, _, mib, _, _ = placement(p.parse_args(["--device", "cpu", "--cpu-kv-fraction", "0.5"]), 1)
    assert mib == 5 * 1024
    _, _, mib, _, _ = placement(p.parse_args(["--device", "cpu", "--kv-cache-mib", "300"]), 2)
    assert mib == 300


def test_a_cpu_pool_reads_zero_and_takes_memory_only_where_written() -> None:
    import torch

    from engine.model.kv_pool import KVLayout, KVPool

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    before = rss()
    pool = KVPool(KVLayout(2, 16, 4, 64, torch.bfloat16), 4096, "cpu")  # 128 MiB
    assert rss() - before < 16 * 2**20  # nothing resident until written
    assert pool.tensor.is_contiguous() and pool.tensor.dtype == torch.bfloat16
    assert float(pool.tensor[4095].abs().sum()) == 0.0
    pool.tensor[7] = 1.5
    assert float(pool.tensor[7].float().mean()) == 1.5 and float(pool.tensor[8].abs().sum()) == 0.0
