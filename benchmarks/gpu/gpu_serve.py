"""Disaggregated serving on one GPU, end to end and under load: a router, one prefill and one
decode worker (P/D, the KV over cuda_ipc) against two colocated workers on the same GPU with
the same memory, one conversation trace through each; plain processes (no Ray) around a
Redis of their own, as `splitserve worker` / `router` / `bench` run them.

    python benchmarks/gpu/gpu_serve.py --out DIR [--budget-s 420] [--model DIR | --size llama3-8b]
        [--arms pd,colocated] [--conversations 64] [--turns 4] [--trace-block-tokens 512]
        [--kv-transport nixl] [--quantization fp8] [--kv-cache-dtype fp8]

Phases, each one JSON line in DIR/gpu_serve.jsonl as it ends (a cut run keeps what ended;
each process's log is DIR/logs/ARM-NAME.log):
- preflight: the device, torch / CUDA / Python versions, the commit;
- model: random weights in --size's shapes (`llama3-8b`: Llama-3.1-8B's, drawn on the GPU),
  bfloat16 on a GPU, or --model;
- trace: a synthetic multi-turn conversation trace in Mooncake's format (each turn the
  conversation so far plus a new message; benchmarks/kv/kv_tier_trace.py), lengths scaled by
  --trace-block-tokens / 512 and times by --trace-time-scale;
- pd, colocated: the arm's processes started one after another (each worker sizes its pool
  from what the GPU has free once the one before it holds its share, --gpu-memory-utilization
  each), `splitserve bench` over the trace (its run ends where the budget would: what ended
  is reported, what was still streaming counted apart), then TTFT and ITL p50 / p99,
  goodput under --ttft-slo-ms / --itl-slo-ms, where the requests were prefilled (the prefill
  worker, or their decode worker), the prefill worker's hand-offs (count, mean time from open
  to the decode worker's ack, bytes), the GPU's utilisation and memory sampled by nvidia-smi
  through the run, the start-up time, and each worker's KV id and pool (blocks); an arm the
  budget left cannot hold is skipped, saying so;
- compare: P/D over colocated, figure by figure (and FP8 over 16-bit where the `-fp8` arms ran:
  MODE-fp8 is MODE with `--quantization fp8`).
Without CUDA the same flow runs on the CPU with the tiny model (shm in place of cuda_ipc) and
small shapes: tests/integration/test_gpu_serve.py runs it, so a device run only measures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kv.kv_tier_trace import conversation_trace  # noqa: E402
from benchmarks.serving.separate_hosts import handoffs, heartbeats, scrape, start_serving  # noqa: E402
from cluster.redis_server import EmbeddedRedis, free_port  # noqa: E402

CLI = [sys.executable, "-m", "cluster.cli"]
SECRET = "gpu-serve-secret"
MODES = {  # the router's mode and its workers, started in this order
    "pd": ("disaggregated", (("prefill", "prefill-0"), ("decode", "decode-0"))),
    "colocated": ("colocated", (("decode", "decode-0"), ("decode", "decode-1"))),
}
FP8 = "-fp8"
"""An arm named MODE-fp8 runs MODE's workers with `--quantization fp8`."""
ARMS = (*MODES, *(m + FP8 for m in MODES))
PAIRS = (("pd", "colocated"), ("pd" + FP8, "colocated" + FP8), ("pd" + FP8, "pd"), ("colocated" + FP8, "colocated"))
"""What `compare` divides, where both arms ran: P/D by colocated, FP8 by 16-bit."""
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))
TEARDOWN_S = 20.0
BENCH_OVERHEAD_S = 10.0
"""A bench process's start (imports, connecting) and its report, beside its run."""


@dataclass
class Budget:
    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


class Report:
    """DIR/gpu_serve.jsonl, one line per phase, written (and printed) as each ends."""

    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_serve.jsonl"
        self.path.write_text("")

    def emit(self, phase: str, **fields: Any) -> dict[str, Any]:
        line = {"bench": "gpu_serve", "phase": phase, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        return line


def preflight(device: str) -> dict[str, Any]:
    import torch

    try:  # the device machine's copy of the tree may have no git, or no .git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    found: dict[str, Any] = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                             "commit": commit}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        found.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                     gpu_free_gib=round(free / 2**30, 1), gpu_total_gib=round(total / 2**30, 1))
    return found


def make_model(size: str, device: str, where: Path) -> str:
    from engine.model.tiny_model import make_tiny_model

    return str(make_tiny_model(where / size, size=size, device=device))


def write_trace(path: Path, conversations: int, turns: int, seed: int) -> int:
    records = conversation_trace(conversations, turns, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return len(records)


class GpuSampler:
    """nvidia-smi's utilisation and memory every 500 ms while it runs (nothing without CUDA);
    a context manager: sampling stops as the block ends, however it ends."""

    def __init__(self, enabled: bool) -> None:
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._enabled = enabled and shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuSampler:
        if self._enabled:
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                           "--format=csv,noheader,nounits", "-lms", "500"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                util, mem = (float(x) for x in line.split(",")[:2])
                self.samples.append((util, mem))

    def summary(self) -> dict[str, Any] | None:
        """None without CUDA (or nvidia-smi)."""
        if not self._enabled:
            return None
        if not self.samples:
            return {"samples": 0}
        utils = [u for u, _ in self.samples]
        return {"samples": len(utils), "util_mean_pct": round(statistics.fmean(utils), 1),
                "util_p50_pct": statistics.median(utils), "memory_max_mib": max(m for _, m in self.samples)}


class Processes:
    """One arm's Redis and splitserve processes, stopped in reverse (SIGTERM, then kill)."""

    def __init__(self, logs: Path, arm: str) -> None:
        self.logs, self.arm = logs, arm
        self.redis = EmbeddedRedis()
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], wait_s: float) -> str:
        """Starts `splitserve ARGS` (its log DIR/logs/ARM-NAME.log) and waits for it to serve: its address."""
        try:
            proc, address = start_serving(CLI + args, SECRET, self.logs / f"{self.arm}-{name}.log",
                                          {"SPLITSERVE_REDIS_URL": self.redis.url}, wait_s)
        except RuntimeError as e:
            raise RuntimeError(f"{name} {e}") from None
        self.procs.append(proc)
        return address

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=TEARDOWN_S / 2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.redis.stop()


def worker_args(args: argparse.Namespace, role: str, worker_id: str, model_dir: str, fp8: bool = False) -> list[str]:
    memory = (["--gpu-memory-utilization", str(args.gpu_memory_utilization)] if args.device == "cuda"
              else ["--kv-cache-mib", str(args.kv_cache_mib), "--num-threads", "1"])
    flags = {"kv_transport": args.kv_transport, "quantization": "fp8" if fp8 else args.quantization,
             "kv_cache_dtype": args.kv_cache_dtype}
    passed = [f for flag, value in flags.items() if value for f in ("--" + flag.replace("_", "-"), value)]
    return ["worker", role, "--worker-id", worker_id, "--namespace", "gpu-serve", "--model", model_dir,
            "--device", args.device, "--no-internal-tls", *memory, *passed]


def wait_for_workers(metrics: str, count: int, budget: Budget) -> None:
    deadline = time.monotonic() + min(60.0, max(budget.left(), 1.0))
    while sum(v for k, v in scrape(metrics).items() if k.startswith("splitserve:pool_workers")) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not see its {count} workers within 60 s")
        time.sleep(0.2)


def bench_command(args: argparse.Namespace, address: str, trace: Path, vocab: int, out: Path,
                  budget: Budget) -> list[str]:
    """`splitserve bench` over the trace, its run ending (`--duration-s`) where the budget
    leaves the arm's teardown and the bench its own start and report."""
    duration = max(budget.left() - TEARDOWN_S - BENCH_OVERHEAD_S, 1.0)
    return CLI + ["bench", "--target", address, "--trace", str(trace), "--num-requests", str(args.num_requests),
                  "--trace-block-tokens", str(args.trace_block_tokens), "--trace-time-scale",
                  str(args.trace_time_scale), "--max-prompt-tokens", str(args.max_prompt_tokens),
                  "--vocab", str(vocab), "--ttft-slo-ms", str(args.ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms),
                  "--timeout-s", str(args.request_timeout_s), "--duration-s", f"{duration:.0f}", "--no-progress",
                  "--output", str(out)]


def bench(args: argparse.Namespace, address: str, trace: Path, vocab: int, out: Path, budget: Budget) -> dict:
    """The bench's results (requests its duration cut counted apart: `num_cut`)."""
    done = subprocess.run(bench_command(args, address, trace, vocab, out, budget), capture_output=True, text=True,
                          timeout=max(budget.left() - TEARDOWN_S / 2, 1.0),
                          env={**os.environ, "SPLITSERVE_CLUSTER_SECRET": SECRET})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench gave no result (exit code {done.returncode}): {done.stderr[-1500:]}")
    return json.loads(lines[-1])["results"]


def run_arm(args: argparse.Namespace, arm: str, model_dir: str, vocab: int, trace: Path, out: Path,
            budget: Budget) -> dict[str, Any]:
    mode, workers = MODES[arm.removesuffix(FP8)]
    procs = Processes(out / "logs", arm)
    try:
        started = time.monotonic()
        address = start_arm(args, procs, mode, workers, model_dir, arm.endswith(FP8), budget)
        startup_s = time.monotonic() - started
        saved = out / f"bench-{arm}.json"
        with GpuSampler(args.device == "cuda") as gpu:
            results = bench(args, address, trace, vocab, saved, budget)
        return {"mode": mode, "startup_s": round(startup_s, 1), "results": results, "prefills": prefills(saved),
                "gpu": gpu.summary(), **worker_facts(procs, mode, [w for _, w in workers])}
    finally:
        procs.stop()


def start_arm(args: argparse.Namespace, procs: Processes, mode: str, workers: tuple[tuple[str, str], ...],
              model_dir: str, fp8: bool, budget: Budget) -> str:
    """The arm's workers one after another, then its router once it sees them: its address."""
    for role, wid in workers:
        procs.start(wid, worker_args(args, role, wid, model_dir, fp8), wait_s=min(args.start_s, budget.left()))
    metrics = f"127.0.0.1:{free_port()}"
    address = procs.start("router", ["router", "--namespace", "gpu-serve", "--port", "0", "--http-port", "-1",
                                     "--metrics-port", metrics.rsplit(":", 1)[1], "--mode", mode,
                                     "--no-internal-tls"], wait_s=min(60.0, budget.left()))
    wait_for_workers(metrics, len(workers), budget)
    return address


def prefills(saved: Path) -> dict[str, int]:
    """Where the requests that ended well were prefilled, from the bench's saved routes: by
    the prefill worker (handed off) or by their decode worker (colocated, or a P/D router's
    short uncached part)."""
    routes = [r["route"] for r in json.loads(saved.read_text())["requests"] if r["code"] == "OK"]
    return {"prefill_worker": sum("<-" in r for r in routes),
            "decode_worker": sum(r.endswith(" local") for r in routes)}


def worker_facts(procs: Processes, mode: str, worker_ids: list[str]) -> dict[str, Any]:
    """Each worker's KV id and pool (from its heartbeat), and the prefill worker's hand-offs."""
    beats = heartbeats(procs.redis.url, "gpu-serve")
    pools = {w: {"kv_id": beats[w].facts.model_id, "kv_blocks": beats[w].facts.num_total_blocks,
                 "block_size": beats[w].facts.block_size} for w in worker_ids}
    moved = handoffs(scrape(beats["prefill-0"].metrics_address)) if mode == "disaggregated" else None
    return {"workers": pools, "handoffs": moved}


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """For each of `PAIRS` that ran, "A/B": A's figures over B's (None where either is missing)."""
    out = {}
    for top, bottom in PAIRS:
        if top not in arms or bottom not in arms:
            continue
        a, b = arms[top]["results"], arms[bottom]["results"]
        ratios: dict[str, float | None] = {}
        for figure, q in FIGURES:
            x, y = a[figure][q], b[figure][q]
            ratios[f"{figure}_{q}"] = round(x / y, 3) if x is not None and y else None
        for key in ("goodput_rps", "slo_attainment", "output_tokens_per_s"):
            ratios[key] = round(a[key] / b[key], 3) if b[key] else None
        out[f"{top}/{bottom}"] = ratios
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=420.0, help="every phase within this many seconds")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--model", help="a checkpoint directory (default: one made with --size)")
    ap.add_argument("--size", default=None, help="make-tiny-model size (default llama3-8b on CUDA, tiny on CPU)")
    ap.add_argument("--arms", default="pd,colocated", help=f"of {', '.join(ARMS)}, in this order")
    ap.add_argument("--conversations", type=int, default=None, help="default 64 on CUDA, 4 on CPU")
    ap.add_argument("--turns", type=int, default=None, help="default 4 on CUDA, 2 on CPU")
    ap.add_argument("--num-requests", type=int, default=100_000, help="at most this many of the trace's")
    ap.add_argument("--trace-block-tokens", type=int, default=None, help="default 512 on CUDA, 16 on CPU")
    ap.add_argument("--trace-time-scale", type=float, default=None, help="default 0.5 on CUDA, 0.05 on CPU")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="default 16,384 on CUDA, 480 on CPU")
    ap.add_argument("--ttft-slo-ms", type=float, default=None, help="default 2,000 on CUDA, 20,000 on CPU")
    ap.add_argument("--itl-slo-ms", type=float, default=None, help="default 50 on CUDA, 2,000 on CPU")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each worker's share of the GPU")
    ap.add_argument("--kv-cache-mib", type=int, default=16, help="each worker's pool on CPU")
    ap.add_argument("--kv-transport", help="the workers' --kv-transport (default: per pair, cuda_ipc on one GPU)")
    ap.add_argument("--quantization", help="the workers' --quantization (fp8)")
    ap.add_argument("--kv-cache-dtype", help="the workers' --kv-cache-dtype (fp8)")
    ap.add_argument("--start-s", type=float, default=300.0, help="a worker's longest start (load, profile, graphs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    defaults = {"size": "llama3-8b" if cuda else "tiny", "conversations": 64 if cuda else 4, "turns": 4 if cuda else 2,
                "trace_block_tokens": 512 if cuda else 16, "trace_time_scale": 0.5 if cuda else 0.05,
                "max_prompt_tokens": 16_384 if cuda else 480, "ttft_slo_ms": 2_000.0 if cuda else 20_000.0,
                "itl_slo_ms": 50.0 if cuda else 2_000.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(exist_ok=True)
    report = Report(args.out)
    report.emit("preflight", **preflight(args.device), config={k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()})
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        model_dir = args.model or make_model(args.size, args.device, Path(tmp))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        report.emit("model", model=model_dir if args.model else args.size, vocab=vocab,
                    seconds=round(time.monotonic() - t0, 1))
        trace = args.out / "trace.jsonl"
        n = write_trace(trace, args.conversations, args.turns, args.seed)
        report.emit("trace", requests=min(n, args.num_requests), conversations=args.conversations, turns=args.turns,
                    block_tokens=args.trace_block_tokens, time_scale=args.trace_time_scale)
        return run_arms(args, model_dir, vocab, trace, report, budget)


def run_arms(args: argparse.Namespace, model_dir: str, vocab: int, trace: Path, report: Report,
             budget: Budget) -> int:
    done: dict[str, dict[str, Any]] = {}
    failed = False
    for arm in args.arms.split(","):
        if arm not in ARMS:
            sys.exit(f"--arms: each one of {', '.join(ARMS)}, not {arm!r}")
        needed = 3 * TEARDOWN_S if args.device == "cpu" else 120.0
        if budget.left() < needed:
            report.emit(arm, skipped=f"{budget.left():.0f} s of the budget left, an arm needs {needed:.0f}")
            continue
        t0 = time.monotonic()
        try:
            done[arm] = report.emit(arm, **run_arm(args, arm, model_dir, vocab, trace, args.out, budget),
                                    seconds=round(time.monotonic() - t0, 1))
        except Exception as e:  # noqa: BLE001 - written, and the next arm runs
            failed = True
            report.emit(arm, error=f"{type(e).__name__}: {e}", seconds=round(time.monotonic() - t0, 1))
    if ratios := compare(done):
        report.emit("compare", ratios=ratios)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
