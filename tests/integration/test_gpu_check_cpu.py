"""benchmarks/gpu/gpu_check.py is run on a GPU machine rarely and briefly: its CPU parts run here,
so a lease is never spent on a script that breaks before it measures anything."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check is the GPU run itself")
def test_the_gpu_check_runs_every_engine_phase_on_the_cpu(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "benchmarks/gpu/gpu_check.py", "--out", str(tmp_path), "--skip", "pytest"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    errors = [x for x in lines if "error" in x or "skipped" in x]
    assert not errors, errors
    checks = [x["check"] for x in lines]
    for check in ("preflight", "floors", "kv_sizing", "decode", "prefill", "worst_step", "engine_vs_transformers",
                  "fp8_floors", "fp8_kv_sizing", "fp8_decode", "fp8_vs_bf16", "fp8_prefill", "fp8_kv_sizing_both",
                  "fp8_kv_decode", "fp8_kv_vs_bf16", "end"):
        assert check in checks, check
    fp8 = [x for x in lines if x["check"] == "fp8_vs_bf16"]  # the FP8 engine's steps beside the bfloat16 one's
    assert [(x["batch"], x["context"]) for x in fp8] == [(1, 64), (8, 64), (1, 256), (8, 256)]
    assert all(x["bf16_ms"] > 0 and x["fp8_ms"] > 0 for x in fp8)
    decode = [x for x in lines if x["check"] == "decode"]
    assert [(x["attention"], x["batch"], x["context"]) for x in decode] == \
        [("native", 1, 64), ("native", 8, 64), ("native", 1, 256), ("native", 8, 256)]
    assert all(x["step_ms"] > 0 and x["over_floor"] > 0 for x in decode)
    assert {x["outcome"] for x in lines if x["check"] == "worst_step"} == {"ran"}
