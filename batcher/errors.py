"""Faults that a user causes or can fix (a bad name, an unknown job, a model that cannot load), as opposed to bugs.

Each carries a message meant for the user: the CLI prints it as one line on stderr and exits non-zero
(`--debug` shows the traceback).
"""


class BatcherError(Exception):
    """An expected fault, with a message meant for the user."""


class InvalidName(BatcherError, ValueError):
    """A job id, queue name or priority that cannot go into a Redis key."""
