"""`splitserve bench` against a real cluster (Ray actors, redis-server, gRPC), run as a user runs it.

A short run prints a table whose numbers are the JSON line's, saves a run that `bench
compare` reads, and writes PNG files that open; a run whose every request fails says so
and exits non-zero.
"""
from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from cluster.local import LocalCluster
from tests.integration.cluster_checks import one_and_one

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str) -> Iterator[LocalCluster]:
    config = one_and_one(tiny_llama_dir)
    with LocalCluster(dataclasses.replace(config, router=dataclasses.replace(config.router, http_port=0))) as c:
        yield c


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300)


def test_the_same_run_over_the_openai_http_api(cluster: LocalCluster) -> None:
    out = bench("--target", f"http://{cluster.info['http_address']}", "--num-requests", "8", "--concurrency", "4",
                "--prompt-len", "40", "--output-len", "6", "--no-progress")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert (s["num_requests"], s["num_ok"], s["errors"]) == (8, 8, {})
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0  # tokens counted per streamed chunk
    assert sum(r["num_requests"] for r in cluster.router_stats()) >= 8  # through the router's request path


def table_row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if re.search(rf"\b{name}\b", line) and "│" in line)
    return [c.strip() for c in line.split("│")[1:-1]]


def test_a_short_run_prints_a_table_that_matches_its_json_and_writes_plots(cluster: LocalCluster,
                                                                             tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    out = bench("--target", cluster.address, "--num-requests", "12", "--rate", "20", "--prompt-len", "40",
                "--output-len", "6", "--shared-prefix-fraction", "0.5", "--prefix-len", "32", "--no-progress",
                "--output", str(saved), "--plots", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    s = line["results"]
    assert line["config"]["rate"] == 20 and (s["num_requests"], s["num_ok"], s["errors"]) == (12, 12, {})
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("end to end", "e2e_ms")):
        assert table_row(out.stdout, name.split()[0])[1:] == [f"{s[key][q]:.1f}" for q in ("p50", "p90", "p99")]
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert f"{s['num_ok']} ok / {s['num_requests']} sent" in out.stdout
    assert f"{s['goodput_rps']} req/s" in out.stdout and 0 < s["slo_attainment"] <= 1
    assert s["goodput_rps"] <= s["requests_per_s"]
    for png in ("ttft_cdf.png", "itl_cdf.png", "timeline.png"):
        with Image.open(tmp_path / "plots" / png) as image:
            assert image.format == "PNG" and image.size[0] >= 600

    records = json.loads(saved.read_text())["requests"]
    assert len(records) == 12 and all(r["code"] == "OK" and r["num_out"] >= 1 for r in records)
    assert sum(len(r["itls_s"]) for r in records) == sum(r["num_out"] - 1 for r in records)
    compare = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "compare", str(saved), str(saved),
                              "--plots", str(tmp_path / "both")], capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0, compare.stderr
    ratios = json.loads(compare.stdout.strip().splitlines()[-1])["b_over_a"]
    assert ratios["requests_per_s"] == 1.0 and ratios["ttft_ms_p50"] == 1.0
    assert (tmp_path / "both" / "ttft_cdf.png").stat().st_size > 1000


def test_a_run_whose_requests_all_fail_says_so_and_exits_non_zero(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = bench("--target", f"127.0.0.1:{port}", "--num-requests", "3", "--concurrency", "1",  # with the progress bar
                "--timeout-s", "5")
    assert out.returncode == 1
    assert json.loads(out.stdout.strip().splitlines()[-1])["results"]["errors"] == {"UNAVAILABLE": 3}
    assert "all 3 requests failed" in out.stderr


def test_a_run_ends_at_its_duration_and_reports_what_ended(cluster: LocalCluster, tmp_path: Path) -> None:
    """--duration-s: no request is sent after it, those still streaming are cut (counted apart,
    saved with their code), and what ended is reported; in both arrival modes."""
    for mode in (["--rate", "20"], ["--concurrency", "4"]):
        saved = tmp_path / f"{mode[0][2:]}.json"
        out = bench("--target", cluster.address, "--num-requests", "400", *mode, "--prompt-len", "40",
                    "--output-len", "200", "--duration-s", "1.5", "--no-progress", "--output", str(saved))
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout.strip().splitlines()[-1])["results"]
        records = json.loads(saved.read_text())["requests"]
        assert 1.5 <= s["elapsed_s"] < 10 and s["num_requests"] + s["num_cut"] == len(records) < 400
        assert s["num_cut"] >= 1 and sum(r["code"] == "CUT" for r in records) == s["num_cut"]
        assert s["errors"] == {} and s["num_ok"] == s["num_requests"]
        assert all(r["sent_s"] < 1.5 for r in records)
