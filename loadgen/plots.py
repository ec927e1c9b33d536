"""PNG plots of one run or several (`bench compare`): TTFT and ITL CDFs, and throughput and
in-flight requests (the client's queue depth) over time. Runs are given as their per-request
records (`records()`: what `--output` saves), so a saved run plots like a live one.
matplotlib is the `bench` extra; without it, plotting says what to install.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadgen.runner import Run

Records = list[dict[str, Any]]


def records(run: Run) -> Records:
    return [{"code": o.code, "sent_s": round(o.sent_s, 4), "end_s": round(o.end_s, 4), "ttft_s": o.ttft_s,
             "itls_s": [round(x, 5) for x in o.itls_s], "num_prompt": o.num_prompt, "num_cached": o.num_cached,
             "num_out": o.num_out, "route": o.route} for o in run.outcomes]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plots needs matplotlib: pip install 'splitserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax: Any, values: list[float], label: str) -> None:
    v = sorted(x * 1e3 for x in values)
    if v:
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{label} (n={len(v)})")


def plot(runs: dict[str, Records], out_dir: Path) -> list[Path]:
    """Writes ttft_cdf.png, itl_cdf.png and timeline.png into `out_dir`; returns their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, title, pick in (
            ("ttft_cdf.png", "Time to first token", lambda rs: [r["ttft_s"] for r in rs if r["code"] == "OK"]),
            ("itl_cdf.png", "Inter-token latency", lambda rs: [x for r in rs if r["code"] == "OK" for x in r["itls_s"]])):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in runs.items():
            _cdf(ax, pick(rs), label)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if "ttft" in name else "fraction of tokens",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        paths.append(_save(plt, fig, out_dir / name))
    paths.append(_timeline(plt, runs, out_dir / "timeline.png"))
    return paths


def _timeline(plt: Any, runs: dict[str, Records], path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    tokens_ax = top.twinx()
    for i, (label, rs) in enumerate(runs.items()):
        color = f"C{i}"
        seconds = list(range(math.ceil(max((r["end_s"] for r in rs), default=0.0)) + 1))
        done, tokens = [0] * len(seconds), [0] * len(seconds)
        for r in rs:
            if r["code"] == "OK":
                done[int(r["end_s"])] += 1
                tokens[int(r["end_s"])] += r["num_out"]
        top.plot(seconds, done, color=color, label=f"{label}: requests/s")
        tokens_ax.plot(seconds, tokens, color=color, linestyle="--", label=f"{label}: output tokens/s")
        bottom.plot(seconds, [sum(r["sent_s"] <= t < r["end_s"] for r in rs) for t in seconds], color=color,
                    label=label)
    top.set(title="Throughput (completions per second)", ylabel="requests/s")
    tokens_ax.set_ylabel("output tokens/s (dashed)")
    bottom.set(title="In flight (sent, not ended)", xlabel="seconds from the start", ylabel="requests")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
