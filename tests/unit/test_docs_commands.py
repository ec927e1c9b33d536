"""Every command the README and the docs show is run by a test, or is a measurement run by
hand: each `./dev ...` line (inline or in a code block) names a program, and each program
is either in `RUN_BY`, with the test file that runs it (which must name it, so the map
cannot rot), or in `BY_HAND` with why the suite does not run it. A new command in the docs
fails here until it is given one or the other."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN_BY = {
    "splitserve serve": ("tests/integration/test_cli.py", '"serve"'),
    "splitserve status": ("tests/integration/test_cli.py", '"status"'),
    "splitserve generate": ("tests/integration/test_cli.py", '"generate"'),
    "splitserve scale": ("tests/integration/test_cli.py", '"scale"'),
    "splitserve make-tiny-model": ("tests/integration/test_cli.py", '"make-tiny-model"'),
    "splitserve router": ("tests/integration/test_plain_processes.py", '["router"'),
    "splitserve kv-store": ("tests/integration/test_plain_processes.py", '["kv-store"'),
    "splitserve metrics-targets": ("tests/integration/test_metrics.py", '"metrics-targets"'),
    "splitserve simulate": ("tests/unit/test_sim_fleet.py", '"simulate"'),
    "splitserve plan": ("tests/integration/test_plan.py", '["plan"'),
    "python -m cluster.cli_reference": ("tests/unit/test_docs.py", "cli_reference"),
    "python -m proto.regen": ("tests/unit/test_proto_generated.py", "regen"),
    "python -m mkdocs": ("tests/unit/test_docs.py", '"-m", "mkdocs"'),  # its strict build (serve serves that)
    "python benchmarks/suite_timeline.py": ("tests/unit/test_suite_timeline.py", "suite_timeline"),
    "test": (".ci/run", "./dev test"),
}
"""Program -> (the file that runs it, a string that file holds where it does)."""

BY_HAND = {
    "python benchmarks/engine/engine_throughput.py", "python benchmarks/kv/kvfabric_bandwidth.py",
    "python benchmarks/serving/observe_overhead.py", "python benchmarks/serving/http_overhead.py",
    "python benchmarks/serving/serving_compare.py", "python benchmarks/serving/router_cpu.py",
    "python benchmarks/serving/agent_apis.py",
    "python benchmarks/sim/sim_goodput.py", "python benchmarks/sim/plan_validate.py",
    "python benchmarks/sim/sim_speed.py", "python benchmarks/sim/sim_validate.py", "python -m benchmarks.kv.tp_handoff",
    "python -m benchmarks.kv.kv_tier_trace", "python -m benchmarks.kv.kv_tier_hosts",
    "python -m benchmarks.kv.kv_tier_fetch",
}
"""Measurements: each runs for minutes to hours against clusters it starts, and reports JSON
lines (benchmarks/; docs/benchmarks.md). Their flags are checked by test_readme_flags.py, and
integration tests run short versions of several (the separate hosts, the abort storm, the
simulator's validation)."""


def shown_commands() -> list[tuple[str, str]]:
    """(page, command) for each `./dev ...` the README and the docs pages show."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        lines = re.findall(r"`(\./dev [^`\n]+)`", text) + re.findall(r"^\s*(\./dev [^\n]+)$", text, re.M)
        out += [(page.name, line.strip()) for line in lines]
    return out


def program(command: str) -> str:
    words = command.split()[1:]
    if words[0] == "splitserve":
        return " ".join(words[:2])
    if words[0] == "python":
        return " ".join(words[:3]) if words[1] == "-m" else " ".join(words[:2])
    return words[0]


def test_every_command_the_docs_show_is_run_by_a_test_or_is_a_measurement_by_hand() -> None:
    commands = shown_commands()
    assert len(commands) > 30  # the pages were read
    unknown = sorted({f"{page}: {c}" for page, c in commands if program(c) not in RUN_BY | dict.fromkeys(BY_HAND)})
    assert not unknown, f"commands no test runs and no measurement explains: {unknown}"
    for prog, (path, mark) in RUN_BY.items():
        assert mark in (ROOT / path).read_text(), f"{path} no longer runs `{prog}`"
    assert all((ROOT / p.split()[1]).is_file() or p.startswith("python -m") for p in BY_HAND)
