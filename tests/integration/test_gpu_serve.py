"""benchmarks/gpu/gpu_serve.py's whole flow on CPU, as the GPU machine runs it: plain-process
P/D and colocated clusters around a Redis of their own, `splitserve bench` over a
conversation trace, the prefill worker's hand-offs from its /metrics, one JSON line a phase.
Its CUDA-only parts (nvidia-smi's samples, the workers' GPU flags) are checked with what
only a GPU answers injected."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu import gpu_serve
from tests.integration.reference import make_engine

SCRIPT = Path(gpu_serve.__file__)
pytestmark = pytest.mark.timeout(240)


def run(out: Path, *flags: str) -> tuple[int, dict[str, dict]]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=220)
    lines = [json.loads(line) for line in (out / "gpu_serve.jsonl").read_text().splitlines()]
    assert all(line["bench"] == "gpu_serve" for line in lines), done.stderr[-2000:]
    return done.returncode, {line["phase"]: line for line in lines}


def test_pd_and_colocated_serve_the_same_trace_and_compare(tiny_llama_dir: str, tmp_path: Path) -> None:
    code, phases = run(tmp_path, "--model", tiny_llama_dir, "--budget-s", "200", "--arms", "pd,colocated,pd-fp8")
    assert code == 0, phases
    assert list(phases) == ["preflight", "model", "trace", "pd", "colocated", "pd-fp8", "compare"]
    n = phases["trace"]["requests"]
    assert n == 8 and len((tmp_path / "trace.jsonl").read_text().splitlines()) == n  # 4 conversations x 2 turns
    pd, co, fp8 = phases["pd"], phases["colocated"], phases["pd-fp8"]
    assert (pd["mode"], co["mode"], fp8["mode"]) == ("disaggregated", "colocated", "disaggregated")
    for arm in (pd, co, fp8):
        assert arm["results"]["num_ok"] == arm["results"]["num_requests"] == n, arm["results"]["errors"]
        assert arm["results"]["ttft_ms"]["p50"] > 0 and arm["gpu"] is None  # no nvidia-smi on CPU
    block_bytes = make_engine(tiny_llama_dir, block_size=16, num_blocks=8).layout.block_bytes
    moved = pd["handoffs"]
    assert 1 <= moved["count"] <= n and moved["mean_ms"] > 0
    routed = pd["prefills"]  # a request that ends at its first token (max_tokens 1 here) hands nothing off
    assert routed["prefill_worker"] + routed["decode_worker"] == n and routed["prefill_worker"] >= moved["count"]
    assert co["prefills"] == {"prefill_worker": 0, "decode_worker": n}
    assert moved["bytes"] > 0 and moved["bytes"] % block_bytes == 0  # whole blocks, pushed over shm
    assert co["handoffs"] is None and fp8["handoffs"]["bytes"] % block_bytes == 0  # FP8 weights: 16-bit KV
    name, blocks = Path(tiny_llama_dir).name, 16 * 2**20 // block_bytes  # --kv-cache-mib 16 each
    assert pd["workers"] == {w: {"kv_id": name, "kv_blocks": blocks, "block_size": 16}
                             for w in ("prefill-0", "decode-0")}
    assert {w["kv_id"] for w in fp8["workers"].values()} == {name + "+fp8"}  # quantized at load: KV of its own
    ratios = phases["compare"]["ratios"]
    assert set(ratios) == {"pd/colocated", "pd-fp8/pd"}  # the pairs both of whose arms ran
    assert set(ratios["pd/colocated"]) == {"ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "goodput_rps",
                                           "slo_attainment", "output_tokens_per_s"}
    assert ratios["pd/colocated"]["slo_attainment"] == ratios["pd-fp8/pd"]["slo_attainment"] == 1.0
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["colocated-decode-0.log", "colocated-decode-1.log", "colocated-router.log",
                    "pd-decode-0.log", "pd-fp8-decode-0.log", "pd-fp8-prefill-0.log", "pd-fp8-router.log",
                    "pd-prefill-0.log", "pd-router.log"]


def test_an_arm_the_budget_cannot_hold_is_skipped_and_the_run_still_reports(tiny_llama_dir: str,
                                                                          tmp_path: Path) -> None:
    code, phases = run(tmp_path, "--model", tiny_llama_dir, "--budget-s", "30")
    assert code == 0
    assert list(phases) == ["preflight", "model", "trace", "pd", "colocated"]  # no compare without both
    for arm in ("pd", "colocated"):
        assert "an arm needs 60" in phases[arm]["skipped"]


def test_a_worker_that_cannot_start_fails_its_arm_with_its_log_named(tiny_llama_dir: str, tmp_path: Path) -> None:
    code, phases = run(tmp_path, "--model", tiny_llama_dir, "--budget-s", "200", "--arms", "pd",
                       "--quantization", "int3")  # the worker refuses it at once
    assert code == 1
    assert "prefill-0 exited with code 2" in phases["pd"]["error"] and "pd-prefill-0.log" in phases["pd"]["error"]
    assert "invalid choice: 'int3'" in (tmp_path / "logs" / "pd-prefill-0.log").read_text()


def test_on_cuda_the_workers_share_the_gpu_by_utilization(tmp_path: Path) -> None:
    args = gpu_serve.parse(["--out", str(tmp_path), "--device", "cuda", "--kv-transport", "nixl"])
    assert (args.size, args.conversations, args.trace_block_tokens, args.itl_slo_ms) == ("llama3-8b", 64, 512, 50.0)
    flags = gpu_serve.worker_args(args, "decode", "decode-0", "/m")
    assert flags[flags.index("--gpu-memory-utilization") + 1] == "0.45" and "--kv-cache-mib" not in flags
    assert flags[flags.index("--device") + 1] == "cuda" and flags[-2:] == ["--kv-transport", "nixl"]
    assert gpu_serve.worker_args(args, "decode", "decode-0", "/m", fp8=True)[-2:] == ["--quantization", "fp8"]
    budget = gpu_serve.Budget(100.0)
    cmd = gpu_serve.bench_command(args, "127.0.0.1:1", tmp_path / "t.jsonl", 128256, tmp_path / "b.json", budget)
    assert cmd[cmd.index("--duration-s") + 1] == "70"  # the budget less the arm's teardown and the bench's start


def test_nvidia_smis_samples_become_utilisation_and_peak_memory(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '37, 1000\\n55, 1200\\nnot a sample\\n'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_serve.GpuSampler(enabled=True) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert sampler.summary() == {"samples": 2, "util_mean_pct": 46.0, "util_p50_pct": 46.0, "memory_max_mib": 1200.0}
    with gpu_serve.GpuSampler(enabled=False) as off:
        pass
    assert off.summary() is None
