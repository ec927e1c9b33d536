"""`ray up deploy/onprem.yaml` onto three SSH test hosts (head `h`, `p`, `d`; ssh_hosts.py),
measured: seconds from `ray up` to the first served token and from `ray down` to nothing
left on any host, and the cross-host disaggregation overhead of
`serving_compare.py --scenario overhead --cross-host` on the launched cluster. Two arms,
each a `ray up` of its own, one request at a time on the same prompts:
  disaggregated  the file as written (prefill on host p, decode on host d, KV over tcp)
  colocated      `--mode colocated`, no prefill pool, a decode worker on each of p and d
One JSON line per arm, then one with the ratio; root, iproute2, sshd and rsync (as the test).

  ./dev python benchmarks/serving/ray_up.py [--num-requests 24] [--prompt-len 768]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving.load_gen import run_load, synthetic  # noqa: E402
from benchmarks.serving.ssh_hosts import (checkout, onprem_file, ray_cli, ray_down_quietly, ssh_hosts,  # noqa: E402
                                           unavailable)

SMOLLM2_VOCAB = 49152
COLOCATED = {
    '*" 10.0.0.11 "*) ROLE=\'{"prefill": 4}\' ;;': '*" 10.0.0.11 "*) ROLE=\'{"decode": 4}\' ;;',
    "--num-prefill 1 --num-decode 1": "--num-prefill 0 --num-decode 2 --mode colocated",
}
"""The colocated arm's edits: host p offers `decode` too, and serve runs two decode workers."""


def run_arm(name: str, args: argparse.Namespace, items: list, warm: list, root: Path) -> dict[str, object]:
    cluster = f"splitserve-bench-{os.getpid()}-{name}"
    source = checkout(root / name / "checkout")
    with ssh_hosts(("h", "p", "d"), root / name) as hosts:
        for host in ("h", "p", "d"):
            hosts.preinstall(host)
        config = root / f"{name}.yaml"
        config.write_text(onprem_file(hosts, cluster, COLOCATED if name == "colocated" else {}))
        try:
            started = time.monotonic()
            up_s, _ = ray_cli("up", "-y", str(config), timeout_s=900, cwd=source)
            target = f"{hosts.address('h')}:50051"
            asyncio.run(run_load(target, warm[:1], None, 1))
            first_token_s = time.monotonic() - started
            asyncio.run(run_load(target, warm, None, 1))
            result = asyncio.run(run_load(target, items, None, 1))
            down_started = time.monotonic()
            ray_cli("down", "-y", str(config), timeout_s=300, cwd=source)
            while hosts.left_running():
                if time.monotonic() - down_started > 300:
                    raise RuntimeError(f"left 300 s after ray down: {hosts.left_running()}")
                time.sleep(0.5)
            gone_s = time.monotonic() - down_started
        finally:
            ray_down_quietly(config, cluster, source)
    line = {"benchmark": "ray_up", "arm": name, "ray_up_s": round(up_s, 1),
            "ray_up_to_first_token_s": round(first_token_s, 1), "ray_down_to_nothing_left_s": round(gone_s, 1),
            "results": result}
    print(json.dumps(line), flush=True)
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=768, help="mean prompt tokens (0.5x-1.5x), past auto's 256")
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if (why := unavailable()) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    items = synthetic(args.num_requests, args.prompt_len, args.output_len, 0.0, 0, 0, SMOLLM2_VOCAB, args.seed)
    warm = synthetic(2, args.prompt_len, args.output_len, 0.0, 0, 0, SMOLLM2_VOCAB, args.seed + 99)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["chmod", "755", tmp], check=True)
        d = run_arm("disaggregated", args, items, warm, Path(tmp))
        c = run_arm("colocated", args, items, warm, Path(tmp))
    dr, cr = d["results"], c["results"]
    overhead = float(dr["ttft_p50_ms"]) - float(cr["ttft_p50_ms"])  # type: ignore[index]
    print(json.dumps({"benchmark": "ray_up", "config": vars(args), "ratios": {
        "ttft_p50_disagg_over_coloc": round(float(dr["ttft_p50_ms"]) / float(cr["ttft_p50_ms"]), 3),  # type: ignore[index]
        "ttft_overhead_ms": round(overhead, 2)},
        "ray_up_to_first_token_s": [d["ray_up_to_first_token_s"], c["ray_up_to_first_token_s"]],
        "ray_down_to_nothing_left_s": [d["ray_down_to_nothing_left_s"], c["ray_down_to_nothing_left_s"]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
