"""The `splitserve` command line as a user runs it (a real subprocess)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "cluster.cli"]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, check=False)


def _digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_make_tiny_model_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        r = run(["make-tiny-model", str(tmp_path / name), "--arch", "qwen2", "--seed", "3"])
        assert r.returncode == 0, r.stderr
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(_digest(tmp_path / "a"))
    r = run(["make-tiny-model", str(tmp_path / "c"), "--arch", "qwen2", "--seed", "4"])
    assert _digest(tmp_path / "c")["model.safetensors"] != _digest(tmp_path / "a")["model.safetensors"]


def test_generate_creates_the_default_model_on_first_use(tmp_path: Path) -> None:
    env = {"SPLITSERVE_CACHE": str(tmp_path / "cache")}
    r = run(["generate", "Once upon a time", "--max-tokens", "8", "--threads", "1"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time")
    assert "8 tokens" in r.stderr and "finish reason length" in r.stderr
    assert (tmp_path / "cache/models/llama-tiny-seed0/config.json").is_file()
    again = run(["generate", "Once upon a time", "--max-tokens", "8", "--threads", "1"], env)
    assert again.stdout == r.stdout  # greedy: the same text


def test_generate_reports_bad_input(tmp_path: Path, tiny_llama_dir: str) -> None:
    r = run(["generate", "hi", "--model", tiny_llama_dir, "--top-p", "0"])
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    r = run(["generate", "hi", "--model", str(tmp_path)])
    assert r.returncode == 2 and "config.json" in r.stderr
