"""The generated API pages are current, and the docs' links point at existing pages."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_api_pages_match_the_docstrings():
    result = subprocess.run([sys.executable, str(REPO / "docs" / "generate_api.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_relative_links_resolve():
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|ipynb|py))(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: broken link to {target}"
