"""ClusterConfig refuses the combinations of the tier's and the degrees' settings that cannot
work, before anything starts, with a message naming the flags; the ones that can are taken."""
from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, RouterConfig
from control.worker_config import WorkerConfig
from router.policy import RoutingConfig

CPU = WorkerConfig(model_dir="m")
GPU = WorkerConfig(model_dir="m", device="cuda")


@pytest.mark.parametrize("fields,names", [
    ({"kv_store_mib": -1}, "kv_store_mib"),
    ({"kv_store_mib": 64, "kv_store_dir": "/d"}, "--kv-store-disk-gib"),
    ({"kv_store_mib": 64, "kv_store_disk_gib": 1.0}, "--kv-store-dir"),
    ({"kv_store_dir": "/d", "kv_store_disk_gib": 1.0}, "--kv-store-mib"),
    ({"kv_store_mib": 64, "kv_store_direct_io": True}, "--kv-store-direct-io"),
    ({"kv_store_mib": 64, "worker": GPU}, "CPU workers only"),
    ({"prefill_tp": 2, "worker": GPU}, "--prefill-tp"),
    ({"decode_tp": 2, "worker": GPU}, "--decode-tp"),
    ({"decode_tp": 0}, "decode_tp"),
])
def test_settings_that_cannot_work_are_refused_by_name(fields: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        ClusterConfig(**{"worker": CPU, **fields})


def test_settings_that_can_work_are_taken() -> None:
    ClusterConfig(worker=CPU, kv_store_mib=64, kv_store_dir="/d", kv_store_disk_gib=1.0, kv_store_direct_io=True,
                  prefill_tp=2, decode_tp=4)
    ClusterConfig(worker=GPU, decode_tp=2, router=RouterConfig(routing=RoutingConfig(mode="colocated")))
