"""Numbers a request carries as text (a query parameter, a header): an optional minus and ASCII digits, never so many
that reading them fails (Python's int() refuses text past 4300 digits, and takes `²`, `+1` or `1_0` too). Any other
text is no number, for the caller to answer 400 (or to ignore, for a header the server has checked already)."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?[0-9]{1,18}")  # every int64 but the least; far past any size or limit


def number_of(text: str | None) -> int | None:
    """The integer `text` spells, or None."""
    return int(text) if text is not None and NUMBER.fullmatch(text) else None
