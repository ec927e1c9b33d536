"""cluster/daemon.py without a cluster: the pid record is trusted only for a live serve, and
`stop --ray-worker-hosts` touches nothing where this is not a local-provider head."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster import daemon


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_record_of_a_process_that_is_not_a_serve_is_not_trusted(cache: Path) -> None:
    assert daemon.running_pid() is None  # no record
    daemon.record()  # this process (pytest) is no serve: a reused pid must not be signalled
    assert daemon.pid_file().read_text().strip() == str(os.getpid())
    assert daemon.running_pid() is None
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "cluster.cli", "serve"])
    try:
        daemon.pid_file().write_text(f"{sleeper.pid}\n")
        cmdline = Path(f"/proc/{sleeper.pid}/cmdline")
        deadline = time.monotonic() + 10
        while not cmdline.read_bytes() and time.monotonic() < deadline:  # empty until its exec is through
            time.sleep(0.01)
        assert daemon.running_pid() == sleeper.pid  # looks like `python -m cluster.cli serve`
    finally:
        sleeper.kill()
        sleeper.wait()
    assert daemon.running_pid() is None and not daemon.alive(sleeper.pid)
    daemon.pid_file().write_text("garbage\n")
    assert daemon.running_pid() is None


def test_forget_removes_only_its_own_record(cache: Path) -> None:
    daemon.pid_file().parent.mkdir(parents=True)
    daemon.pid_file().write_text("1\n")
    daemon.forget()
    assert daemon.pid_file().exists()  # another process's
    daemon.record()
    daemon.forget()
    assert not daemon.pid_file().exists()


def test_stop_with_no_serve_says_so_and_clears_a_stale_record(cache: Path, capsys: pytest.CaptureFixture) -> None:
    daemon.pid_file().parent.mkdir(parents=True)
    daemon.pid_file().write_text("999999999\n")
    args = argparse.Namespace(timeout_s=1.0, ray_worker_hosts=False)
    assert daemon.stop(args) == 0
    assert "no serve runs here" in capsys.readouterr().out and not daemon.pid_file().exists()


def test_worker_hosts_are_stopped_only_on_a_local_provider_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")
    monkeypatch.setattr(daemon.subprocess, "run", run)  # no ssh leaves this test: what would run is recorded
    assert daemon.stop_ray_worker_hosts(tmp_path / "absent.yaml") == 0
    cloud = tmp_path / "cloud.yaml"
    cloud.write_text(yaml.safe_dump({"provider": {"type": "aws", "region": "us-west-2", "worker_ips": ["10.0.0.11"]}}))
    assert daemon.stop_ray_worker_hosts(cloud) == 0  # the cloud provider terminates its nodes itself
    no_workers = tmp_path / "alone.yaml"
    no_workers.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": "10.0.0.10", "worker_ips": []}}))
    assert daemon.stop_ray_worker_hosts(no_workers) == 0
    assert ran == []
    local = tmp_path / "local.yaml"
    local.write_text(yaml.safe_dump({"provider": {"type": "local", "head_ip": "10.0.0.10",
                                                  "worker_ips": ["10.0.0.11", "10.0.0.12"]},
                                     "auth": {"ssh_user": "ops", "ssh_private_key": "/keys/k.pem"}}))
    assert daemon.stop_ray_worker_hosts(local) == 0
    assert sorted(argv[argv.index("-i") + 1:][-2] for argv in ran) == ["ops@10.0.0.11", "ops@10.0.0.12"]
    assert all(argv[:3] == ["ssh", "-i", "/keys/k.pem"] and argv[-1].endswith("ray stop'") for argv in ran)
