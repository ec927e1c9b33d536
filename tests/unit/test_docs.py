"""The docs site builds in strict mode (a broken link, a page missing from the nav or a nav
entry without its page fails it), the configuration reference is what the CLI's parsers
say today, and the README stays a short front page whose links land on pages."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli_reference import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_the_configuration_reference_is_the_parsers_own() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference(), "stale: ./dev python -m cluster.cli_reference > docs/configuration.md"
    for command in ("serve", "worker", "router", "kv-store", "generate", "simulate"):
        assert f"\n## splitserve {command}\n" in page
    assert "| `--kv-cache-dtype` `auto`\\|`fp8` | `auto` |" in page  # a flag, its choices and default


def test_the_readme_is_a_front_page_whose_links_land() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "./dev splitserve serve" in readme and "./dev test" in readme  # the two commands
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).is_file() for link in links), [x for x in links if not (ROOT / x).is_file()]
