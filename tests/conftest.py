"""Suite-wide pytest settings: fast-compiling XLA flags (`_xla.py`), the `heavy` marker, and
the slowest files start first.

Every test runs by default (`python -m pytest -q -n 2 tests`, what CI runs). Tests marked
`@pytest.mark.heavy` — end-to-end runs, and further parameters of a property whose path an
unmarked test already covers — are left out by the quick command
`python -m pytest -q -n 2 -m "not heavy" tests`.

With `-n 2 --dist loadfile` (pyproject.toml) each file runs whole on one worker, in the
order the files are collected; a file that takes minutes collected last leaves the other
worker idle while it finishes. So files run longest first, by the per-file seconds in
`tests/durations.json`, which a run writes when asked:

    python -m pytest -q -n 2 tests --write-durations=tests/durations.json

Files the JSON does not name (new ones) keep their collection order after the named ones.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import _xla

os.environ["XLA_FLAGS"] = _xla.flags(base=os.environ.get("XLA_FLAGS"))  # before any test imports jax

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--write-durations", metavar="PATH", default=None,
                     help="write each test file's summed setup + call + teardown seconds to PATH (JSON), "
                          "the order tests/durations.json gives the files")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0].removeprefix("tests/")


def pytest_collection_modifyitems(session, config, items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    # Longest first; unnamed files after, in collection order (sort is stable).
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), -1.0))


_FILE_SECONDS: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    # Called in a plain run, and on xdist's controller for every worker's report.
    _FILE_SECONDS[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--write-durations")
    if not path or hasattr(session.config, "workerinput"):
        return
    ordered = {name: round(s, 1) for name, s in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])}
    Path(path).write_text(json.dumps(ordered, indent=1) + "\n")
