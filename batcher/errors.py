"""Faults that a user causes or can fix (a bad name, an unknown job, a model that cannot load), as opposed to bugs.

Each carries a message meant for the user: the CLI prints it as one line on stderr and exits non-zero
(`--debug` shows the traceback). `readable` turns pydantic's complaint about a user's input into such a message.
A message quotes what the user sent with `quoted`: a short prefix of it, since a client may send megabytes.
"""

from collections.abc import Callable, Iterable

from pydantic import ValidationError

MAX_LISTED_PROBLEMS = 5  # a request with thousands of bad items gets a reason of a few lines, not megabytes
MAX_PROBLEM_CHARS = 200
MAX_QUOTED_CHARS = 40  # of a value the user sent: enough to recognise it
MAX_LISTED_NAMES = 5  # of the unknown fields a request names


class BatcherError(Exception):
    """An expected fault, with a message meant for the user."""


class InvalidName(BatcherError, ValueError):
    """A job id, queue name or priority that cannot go into a Redis key."""


def quoted(value: object) -> str:
    """`value` as a message quotes it: its repr, cut to MAX_QUOTED_CHARS and marked `...` where cut."""
    text = repr(value[:MAX_QUOTED_CHARS + 1] if isinstance(value, (str, bytes)) else value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


def short_name(name: str) -> str:
    """A field name the user sent, as a message or an error's `param` names it: cut to MAX_QUOTED_CHARS."""
    return name if len(name) <= MAX_QUOTED_CHARS else name[:MAX_QUOTED_CHARS] + "..."


def shortened(message: str, *values: str) -> str:
    """`message` with each of `values` it holds (an id the user sent, say) cut to a short prefix."""
    for value in values:
        if len(value) > MAX_QUOTED_CHARS:
            message = message.replace(value, short_name(value))
    return message


def names(fields: Iterable[str]) -> str:
    """Field names the user sent, for a message: the first MAX_LISTED_NAMES in order, each cut short."""
    fields = sorted(fields)
    listed = ", ".join(short_name(f) for f in fields[:MAX_LISTED_NAMES])
    return listed if len(fields) <= MAX_LISTED_NAMES else f"{listed} and {len(fields) - MAX_LISTED_NAMES} more"


def dotted(loc: tuple) -> str:
    """A pydantic error's location as the schema names it (`sampling.max_tokens`)."""
    return ".".join(str(p) for p in loc)


def readable(exc: ValidationError, where: Callable[[tuple], str] = dotted) -> str:
    """What pydantic says, without its URLs or the input: the first few problems, each naming its field (`where`
    names it from the error's location), and how many there were in all."""
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_LISTED_PROBLEMS]:
        parts.append(f"{where(err['loc']) or 'request'}: {err['msg']}"[:MAX_PROBLEM_CHARS])
    if len(errors) > MAX_LISTED_PROBLEMS:
        parts.append(f"and {len(errors) - MAX_LISTED_PROBLEMS} more ({len(errors)} problems in all)")
    return "; ".join(parts)
