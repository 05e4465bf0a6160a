"""The engine's scheduling, Redis-free and torch-free: each step decides `{sequence: tokens to compute}`.

`Scheduler` (scheduler.py) is the only writer of a sequence's state (sequence.py); the KV blocks and the prefix
cache are in blocks.py, and which running sequence gives way to more urgent work in preemption.py.
"""

from rqbatcher.workers.scheduler.scheduler import Scheduler, StepPlan

__all__ = ["Scheduler", "StepPlan"]
