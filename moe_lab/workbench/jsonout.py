"""JSON that every parser reads: non-finite numbers become ``null``.

Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` for non-finite
floats, which are not JSON: ``jq``, JavaScript and most other parsers refuse the whole
document. A command that prints ``--json`` goes through `dumps`, which writes ``null``
there instead (a figure that could not be measured is absent, not a number), and checks
with ``allow_nan=False`` that nothing non-finite slipped through.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples, at any depth)
    replaced by ``None``; everything else unchanged (tuples become lists, as in JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` with non-finite floats written as ``null`` (`finite`).

    ``default`` (e.g. ``str``) still applies to what JSON has no type for; its results are
    not rewritten, so it must not return non-finite floats."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
