"""Every command-line flag the README and the docs pages show exists: each `--flag` in them
is an option of a `splitserve` command (cluster/cli.py's parser, subcommands included), of
`./dev` or of a benchmark, or one of `ELSEWHERE` (another program's)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

ELSEWHERE = {
    "--head", "--num-cpus", "--autoscaling-config",  # `ray start`'s, for the fake multi-node cluster
}


def options(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found


def script_flags() -> set[str]:
    """Flags defined by scripts the README runs directly (benchmarks/, tools)."""
    found: set[str] = set()
    for path in [*ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("benchmarks/*.sh"), ROOT / "dev",
                 *ROOT.glob("loadgen/*.py")]:
        found |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text()))
        found |= set(re.findall(r"\s(--[a-z][a-z0-9-]*)\)", path.read_text()))  # shell `case` arms
    return found


def test_every_flag_the_readme_and_the_docs_show_exists() -> None:
    known = options(build_parser()) | script_flags() | ELSEWHERE
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", page.read_text()))
        assert shown - known == set(), page.name
