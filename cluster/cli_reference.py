"""The configuration reference (docs/configuration.md), written from the CLI's own parsers:
every `splitserve` command and flag with its default and help, in the order `--help` shows
them. `./dev python -m cluster.cli_reference > docs/configuration.md` rewrites the page; a
test fails when the page and the parsers disagree."""
from __future__ import annotations

import argparse
import sys

from cluster.cli import build_parser

HEADER = """# Configuration reference

Every `splitserve` command and its flags, as the command line parses them (this page is
written from the parsers by `./dev python -m cluster.cli_reference > docs/configuration.md`;
a test fails when it is stale). What the flags do in context: [Serving a cluster](serving.md),
[The APIs](api.md), [Moving KV](kv.md), [Security](security.md).
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    default = action.default
    if default is None or default == argparse.SUPPRESS:
        return ""
    return f"`{_cell(default)}`" if not isinstance(default, list) or default else ""


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        names += " " + "\\|".join(f"`{c}`" for c in action.choices)
    elif action.nargs != 0 and action.option_strings:
        names += f" {_cell(action.metavar or action.dest.upper())}"
    return names


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        rows.append(f"| {_flag(action)} | {_default(action)} | {_cell(action.help or '')} |")
    return rows


def reference() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    out = [HEADER]
    for name, command in sub.choices.items():
        out.append(f"\n## splitserve {name}\n")
        if helps.get(name):
            text = _cell(helps[name])
            out.append(text[0].upper() + text[1:] + ("" if text.endswith(".") else "."))
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        rows = _rows(command)
        if rows:
            out.append("\n| flag | default | what it does |\n|---|---|---|")
            out.extend(rows)
        for group in nested:
            for inner_name, inner in group.choices.items():
                out.append(f"\n### splitserve {name} {inner_name}\n")
                inner_rows = _rows(inner)
                if inner_rows:
                    out.append("| flag | default | what it does |\n|---|---|---|")
                    out.extend(inner_rows)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
