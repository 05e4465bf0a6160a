"""Faults that a user causes or can fix (a bad name, an unknown job, a model that cannot load), as opposed to bugs.

Each carries a message meant for the user: the CLI prints it as one line on stderr and exits non-zero
(`--debug` shows the traceback). `readable` turns pydantic's complaint about a user's input into such a message.
"""

from pydantic import ValidationError

MAX_LISTED_PROBLEMS = 5  # a request with thousands of bad items gets a reason of a few lines, not megabytes
MAX_PROBLEM_CHARS = 200


class BatcherError(Exception):
    """An expected fault, with a message meant for the user."""


class InvalidName(BatcherError, ValueError):
    """A job id, queue name or priority that cannot go into a Redis key."""


def readable(exc: ValidationError) -> str:
    """What pydantic says, without its URLs: the first few problems, each naming its field, and how many
    there were in all."""
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_LISTED_PROBLEMS]:
        where = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{where}: {err['msg']}"[:MAX_PROBLEM_CHARS])
    if len(errors) > MAX_LISTED_PROBLEMS:
        parts.append(f"and {len(errors) - MAX_LISTED_PROBLEMS} more ({len(errors)} problems in all)")
    return "; ".join(parts)
