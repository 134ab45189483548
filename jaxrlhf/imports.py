"""Objects named by import path on the command line ("package.module:name"): reward
functions (`reward.fns`), environment classes (`env.cls`), tools (`env.tools`)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str, *, label: str, what: str = "package.module:name") -> Any:
    """The object at import path `spec` ("package.module:name", dotted attributes allowed);
    a ValueError that starts with `label` (e.g. `env.cls='pkg.mod:Env'`) when the path is
    not of the form `what`, the module does not import or has no such attribute."""
    module_name, sep, attr = str(spec).strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{label}: expected an import path '{what}'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or any error the module raises on import
        raise ValueError(f"{label}: module {module_name!r} does not import ({type(e).__name__}: {e}); "
                         "is its folder on PYTHONPATH?") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{label}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
