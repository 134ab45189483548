"""The generated API pages are current (the links in the docs: tests/test_repository.py)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_api_pages_match_the_docstrings():
    result = subprocess.run([sys.executable, str(REPO / "docs" / "generate_api.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
