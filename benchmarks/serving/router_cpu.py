"""The router's own CPU time per HTTP chat request, A/B between two checkouts in one run.

Each arm is one process running a router's request path and nothing else: its OpenAI HTTP
door on loopback, `Generation` (prepare, admission, the request flow) and the flow's worker
calls answered in-process by the flow tests' fake workers (tests/unit/router_fakes.py: a
decode worker that prefills locally and streams --output-len tokens). No Redis, no Ray, no
timers: what the process spends is the request path's. The client, in this process, sends
chat requests one at a time (a small prompt through the model's chat template) and reads
the arm's CPU time (every thread's, /proc/PID/task/*/schedstat) around each round; the arms alternate round by round.

    ./dev python benchmarks/serving/router_cpu.py [--base DIR] [--rounds 6] [--requests 200]

`--base DIR`: another checkout of splitserve (e.g. `git worktree add /tmp/base COMMIT`),
run with its own code (PYTHONPATH); without it, this checkout against itself (the noise
floor). One JSON line per round and arm, then the medians and the ratio this / base.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def serve(model_dir: str, output_len: int) -> None:
    """The arm: a router's HTTP door over fake workers, on a free loopback port (printed)."""
    import asyncio

    from proto import generate_pb2 as pb
    from router.admission import AdmissionConfig
    from router.frontend import Frontend
    from router.gate import AdmissionGate
    from router.http_api import OpenAIServer
    from router.servicer import Generation
    from tests.unit.router_fakes import make_flow

    def decode(request: object) -> list[object]:  # a local prefill, then one token an event
        n = output_len
        return [pb.DecodeEvent(tokens=pb.Tokens(token_ids=[100 + i], finish_reason=pb.FINISH_REASON_LENGTH
                                                 if i == n - 1 else 0)) for i in range(n)]

    async def main() -> None:
        flow, _ = make_flow({"d0": decode}, mode="colocated")
        frontend = Frontend(model_dir)
        generation = Generation(frontend, AdmissionGate(AdmissionConfig(), time.monotonic), flow, flow.members)
        server = OpenAIServer(generation, frontend, flow.members, None, 1 << 20)
        print(await server.start("127.0.0.1", 0, False), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client closes it
        await server.stop()

    asyncio.run(main())


class Arm:
    def __init__(self, name: str, checkout: Path, model_dir: str, output_len: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"}  # the same dict layouts in both
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", model_dir, "--output-len", str(output_len)],
                                     cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/v1/chat/completions"

    def cpu_s(self) -> float:
        """The arm's CPU time so far, every thread's, in ns (schedstat; /proc/PID/stat counts 10 ms ticks)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError):  # a thread that ended meanwhile
                pass
        return total / 1e9

    def chat(self, i: int, output_len: int) -> float:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"Say something, {i}."}],
                           "max_tokens": output_len, "temperature": 0}).encode()
        started = time.perf_counter()
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == output_len, answer
        return time.perf_counter() - started

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="another checkout to compare with (default: this one)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=200, help="per arm and round")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.output_len)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "tiny")
        subprocess.run([sys.executable, "-m", "cluster.cli", "make-tiny-model", model_dir], cwd=ROOT, check=True,
                       capture_output=True)
        base = Path(args.base).resolve() if args.base else ROOT
        arms = [Arm("this", ROOT, model_dir, args.output_len), Arm("base", base, model_dir, args.output_len)]
        config = {"requests": args.requests, "output_len": args.output_len, "this": str(ROOT), "base": str(base),
                  "cpus": os.cpu_count()}
        cpu: dict[str, list[float]] = {a.name: [] for a in arms}
        try:
            for a in arms:  # warm: imports, first compilations, the template
                for i in range(20):
                    a.chat(i, args.output_len)
            for r in range(args.rounds):
                for a in arms if r % 2 == 0 else arms[::-1]:
                    before, walls = a.cpu_s(), []
                    for i in range(args.requests):
                        walls.append(a.chat(r * args.requests + i, args.output_len))
                    per_request_ms = (a.cpu_s() - before) / args.requests * 1e3
                    cpu[a.name].append(per_request_ms)
                    print(json.dumps({"bench": "router_cpu", "round": r, "arm": a.name,
                                      "router_cpu_ms_per_request": round(per_request_ms, 3),
                                      "wall_ms_p50": round(statistics.median(walls) * 1e3, 3), "config": config}),
                          flush=True)
        finally:
            for a in arms:
                a.close()
        this, other = statistics.median(cpu["this"]), statistics.median(cpu["base"])
        print(json.dumps({"bench": "router_cpu", "this_ms_per_request": round(this, 3),
                          "base_ms_per_request": round(other, 3), "ratio_this_over_base": round(this / other, 3),
                          "config": config}), flush=True)


if __name__ == "__main__":
    main()
