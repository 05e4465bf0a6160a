"""Preemption for urgency: which running sequence gives way to a more urgent waiting one, and which waiting
sequence is admitted next (pure Python, used by `rqbatcher.workers.scheduler`).

A sequence's `urgency` is (class rank, priority level), lower first (`rqbatcher.service_class.urgency_of`). When a
waiting sequence of a more urgent class finds no slot or KV block free, the least urgent running sequence of a
less urgent class is preempted by recompute: its blocks are released, the full ones keep their place in the
prefix cache, and it resumes (to the same tokens) when room comes back. Only a difference of class preempts;
levels within a class only order admission, so equal work never churns.

Bounded so that batch work still progresses: batch sequences keep `batch_floor` slots (the engine's
`min_batch_share` of `max_num_seqs`), are never preempted below it, and are admitted first while under it.

Preemption for fairness, between interactive tenants: when an interactive request of a tenant that holds no slot
waits and no slot is free, one interactive sequence of the most-served tenant (the one holding the most slots,
more than one and above its fair share of them) gives way. The engine counts service by slots held, where the
worker's pick counts tokens (VTC): the pick chose the waiting request because its tenant was the least served.
Bounded so that it never churns: a sequence is preempted for fairness at most once per FAIRNESS_INTERVAL_S
(seconds of the scheduler's clock, so the bound means the same on a slow CPU and a fast GPU), never when it will
end within NEAR_END_S at the measured decode step (in time too: eight tokens are a tenth of a second on a GPU and
four seconds on a slow CPU), and priority work is never preempted by interactive work. The bound is per victim, not
per tenant served: each request of a slotless tenant finds a victim among the most-served tenant's other sequences,
however many of its requests came before, so it is admitted within one interval. Among waiting sequences of equal
urgency, the one whose tenant holds the fewest slots is admitted first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from rqbatcher.service_class import BATCH, INTERACTIVE, RANK

BATCH_RANK = RANK[BATCH]
FAIRNESS_INTERVAL_S = 1.0  # seconds between two fairness preemptions of one sequence, at least
NEAR_END_S = 0.25  # a sequence that will reach its max_tokens this soon finishes rather than gives way


def batch_floor(min_batch_share: float, max_num_seqs: int) -> int:
    """The slots batch work keeps under any load of more urgent work."""
    return math.ceil(min_batch_share * max_num_seqs)


def count_batch(seqs: Iterable) -> int:
    return sum(1 for s in seqs if s.service_class == BATCH)


def next_waiting(waiting, running, floor: int, free_slots: int):
    """The waiting sequence to admit next: the most urgent, of equals the one whose tenant holds the fewest slots
    (the first of those: preempted sequences wait at the front, the rest in arrival order); but a batch one while
    batch work runs under its floor and the more urgent waiting work would take every free slot."""
    if count_batch(running) < floor and sum(1 for s in waiting if s.urgency[0] < BATCH_RANK) >= free_slots:
        for seq in waiting:
            if seq.service_class == BATCH:
                return seq
    held = Counter(s.tenant for s in running)
    return min(waiting, key=lambda s: (s.urgency, held[s.tenant]))


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


def fairness_victim(tenant, running, now: float, step_s: float, max_num_seqs: int):
    """The running sequence to preempt so that an interactive request of `tenant`, which holds no slot, gets one:
    of the tenant holding the most interactive slots, above its fair share of them, the latest admitted that may
    give way (`may_give_way`; `step_s`: a decode step's measured time). None if `tenant` holds a slot, or there is
    no such sequence."""
    if any(s.tenant == tenant for s in running):
        return None
    held = Counter(s.tenant for s in running if s.service_class == INTERACTIVE)
    share = max_num_seqs / (len(held) + 1)
    for most_served, slots in held.most_common():
        if slots <= max(1.0, share):  # one slot is never above a share: it would only change hands
            return None
        for seq in reversed(running):
            if seq.tenant == most_served and seq.service_class == INTERACTIVE and may_give_way(seq, now, step_s):
                return seq
    return None


def may_give_way(seq, now: float, step_s: float) -> bool:
    """Whether a sequence may be preempted for fairness at `now`: not preempted so within the interval, and not
    ending within NEAR_END_S, at `step_s` a token (0 while no step is measured: none is near its end)."""
    recent = seq.fairness_preempted_at is not None and now - seq.fairness_preempted_at < FAIRNESS_INTERVAL_S
    ends_soon = step_s > 0 and (seq.sampling.max_tokens - seq.num_output_tokens) * step_s <= NEAR_END_S
    return not recent and not ends_soon


class _NewTenant:
    """A tenant no sequence has: what `fair_room` asks `fairness_victim` about."""


def fair_room(running, waiting, now: float, step_s: float, max_num_seqs: int) -> int:
    """How many interactive requests of a tenant holding no slot the engine could take beyond its free slots (0 or
    1), each to preempt one sequence of the most-served tenant. 0 while one such request already waits."""
    if len(running) + len(waiting) < max_num_seqs:
        return 0  # a slot is free: the pick fills it
    holders = {s.tenant for s in running}
    if any(s.service_class == INTERACTIVE and s.tenant not in holders for s in waiting):
        return 0
    return int(fairness_victim(_NewTenant(), running, now, step_s, max_num_seqs) is not None)
