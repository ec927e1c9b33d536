"""Where a test run's time went, from the timeline its tests wrote (tests/conftest.py `TIMELINE`):

    SPLITSERVE_TEST_TIMELINE=/tmp/t.jsonl ./dev test
    ./dev python benchmarks/suite_timeline.py /tmp/t.jsonl [--top 30]

Prints one JSON line: the run's wall time, each xdist worker's busy time and how long it sat
idle at the end while another still ran, and the modules by busy time (their tests' durations
added up) with the worker that ran them, when it began them, and the CPU-seconds of the test
process and of the processes it ran and waited for (not a cluster's Ray workers: on a CPU-bound
machine busy time well over those is the clusters' processes, or waiting)."""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def summary(lines: list[dict], top: int) -> dict:
    if any(t["worker"] != "main" for t in lines):  # an xdist run: "main" lines are pytest runs its tests started
        lines = [t for t in lines if t["worker"] != "main"]  # (test_nixl_apart's), inside one of its tests
    begin, end = min(t["start"] for t in lines), max(t["end"] for t in lines)
    workers: dict[str, dict[str, float]] = defaultdict(lambda: {"busy_s": 0.0, "last_end": 0.0})
    modules: dict[str, dict] = {}
    for t in lines:
        w = workers[t["worker"]]
        w["busy_s"] += t["end"] - t["start"]
        w["last_end"] = max(w["last_end"], t["end"])
        name = t["test"].split("::", 1)[0]
        m = modules.setdefault(name, {"module": name, "worker": t["worker"], "start": t["start"], "tests": 0,
                                      "busy_s": 0.0, "cpu_s": 0.0, "children_cpu_s": 0.0})
        m["start"], m["tests"] = min(m["start"], t["start"]), m["tests"] + 1
        m["busy_s"] += t["end"] - t["start"]
        m["cpu_s"] += t.get("cpu_s", 0.0)  # (a timeline written before the CPU was recorded: 0)
        m["children_cpu_s"] += t.get("children_cpu_s", 0.0)
    slowest = sorted(modules.values(), key=lambda m: m["busy_s"], reverse=True)[:top]
    return {
        "wall_s": round(end - begin, 1),
        "workers": {k: {"busy_s": round(v["busy_s"], 1), "idle_at_end_s": round(end - v["last_end"], 1)}
                    for k, v in sorted(workers.items())},
        "modules": [{"module": m["module"], "busy_s": round(m["busy_s"], 1), "tests": m["tests"],
                     "cpu_s": round(m["cpu_s"], 1), "children_cpu_s": round(m["children_cpu_s"], 1),
                     "worker": m["worker"], "began_at_s": round(m["start"] - begin, 1)} for m in slowest],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.timeline) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(summary(lines, args.top)))


if __name__ == "__main__":
    main()
