"""Preemption for urgency: which running sequence gives way to a more urgent waiting one, and which waiting
sequence is admitted next (pure Python, used by `batcher.scheduler`).

A sequence's `urgency` is (class rank, priority level), lower first (`batcher.service_class.urgency_of`). When a
waiting sequence of a more urgent class finds no slot or KV block free, the least urgent running sequence of a
less urgent class is preempted by recompute: its blocks are released, the full ones keep their place in the
prefix cache, and it resumes (to the same tokens) when room comes back. Only a difference of class preempts;
levels within a class only order admission, so equal work never churns.

Bounded so that batch work still progresses: batch sequences keep `batch_floor` slots (the engine's
`min_batch_share` of `max_num_seqs`), are never preempted below it, and are admitted first while under it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from batcher.service_class import BATCH, RANK

BATCH_RANK = RANK[BATCH]


def batch_floor(min_batch_share: float, max_num_seqs: int) -> int:
    """The slots batch work keeps under any load of more urgent work."""
    return math.ceil(min_batch_share * max_num_seqs)


def count_batch(seqs: Iterable) -> int:
    return sum(1 for s in seqs if s.service_class == BATCH)


def next_waiting(waiting, running, floor: int, free_slots: int):
    """The waiting sequence to admit next: the most urgent (the first of equals: preempted sequences wait at the
    front, the rest in arrival order); but a batch one while batch work runs under its floor and the more urgent
    waiting work would take every free slot."""
    if count_batch(running) < floor and sum(1 for s in waiting if s.urgency[0] < BATCH_RANK) >= free_slots:
        for seq in waiting:
            if seq.service_class == BATCH:
                return seq
    return min(waiting, key=lambda s: s.urgency)


def victim_for(seq, running, floor: int):
    """The running sequence to preempt for `seq`: the least urgent of a less urgent class, the latest admitted
    of equals, and a batch one only while batch work runs above its floor. None if there is none."""
    above_floor = count_batch(running) > floor
    victims = [s for s in running if s.urgency[0] > seq.urgency[0] and (s.service_class != BATCH or above_floor)]
    return max(reversed(victims), key=lambda s: s.urgency) if victims else None


def least_urgent(running):
    """The running sequence that gives way when KV blocks run out: the least urgent, the latest admitted of equals."""
    return max(reversed(running), key=lambda s: s.urgency)


def urgent_room(running, waiting, floor: int, max_num_seqs: int) -> int:
    """How many more priority or interactive requests could be taken beyond the free slots, each to preempt a
    running batch sequence above the floor. The engine then holds at most `max_num_seqs` plus the preemptible
    batch sequences, whatever the jobs taken turn out to be."""
    preemptible = sum(1 for s in running if s.service_class == BATCH and s.urgency[0] == BATCH_RANK)
    preemptible = min(preemptible, count_batch(running) - floor)
    return max(0, preemptible - max(0, len(running) + len(waiting) - max_num_seqs))


def batch_deficit(running, waiting, floor: int) -> int:
    """How many batch requests the worker takes before anything else: what batch work lacks of its floor."""
    return max(0, floor - count_batch(running) - count_batch(waiting))
