"""The LLM-bound limit of a training step: the same calls, their drawn service times, the concurrency limit and
a stage dependency structure, list-scheduled with zero pipeline overhead.

Designs:
- ``barrier``: all rollouts, then all summaries, then all extractions (a repair re-ask right after its own
  first ask), then consolidation;
- ``pipelined``: per group rollouts -> its summaries -> its extraction (-> repair); worked examples written
  (rationalize) once every group is done, as the flow runs them; consolidation after all of them.
Consolidation calls depend on every consolidation call that ended before they started (chunk plans, then the
final pass), as observed at the server.

Agent rollouts: a policy call with a ``parent`` (a later turn) depends on the turn whose tool call it follows
and becomes ready ``gap_s`` (that tool's time) after it ends; the tool does not hold a slot. "A group's
rollouts" are all turns of its samples, so the chain is turn0 -> tool -> turn1 -> ... -> summaries -> ...

Scheduling is greedy: whenever a slot is free, the ready call that became ready first (ties: request order)
starts. ``lower_bound`` is max(longest chain, total service time / concurrency), which no schedule beats.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from latency_server import CallRecord

POLICY = "policy"
SUMMARIZER = "trajectory summarizer"
EXTRACTOR = "experience extractor"
WRITER = "worked-example writer"  # rationalize: a stage after the pipeline (it waits for every group), before
CONSOLIDATOR = "library consolidator"  # consolidation
LEVELS = {POLICY: 0, SUMMARIZER: 1, EXTRACTOR: 2, WRITER: 2.75, CONSOLIDATOR: 3}


@dataclass(frozen=True)
class Limits:
    barrier_s: float  # makespan of the barrier design
    pipelined_s: float  # makespan of the pipelined design
    lower_bound_s: float
    chain_s: float  # longest dependency chain (infinite concurrency, pipelined)


def _level(call: CallRecord) -> float:
    return LEVELS[call.role] + (0.5 if call.repair else 0.0)


def dependencies(calls: Sequence[CallRecord], design: str) -> list[list[int]]:
    """For each call, the indices of the calls it waits for."""
    if design not in ("barrier", "pipelined"):
        raise ValueError(f"unknown design {design!r}")
    consolidation = [i for i, c in enumerate(calls) if c.role == CONSOLIDATOR]
    learning = [i for i, c in enumerate(calls) if c.role != CONSOLIDATOR]
    by_level: dict[float, list[int]] = defaultdict(list)
    by_group: dict[tuple[str | None, float], list[int]] = defaultdict(list)
    for i in learning:
        by_level[_level(calls[i])].append(i)
        by_group[(calls[i].group, _level(calls[i]))].append(i)
    deps: list[list[int]] = [[] for _ in calls]
    tagged = {c.tag: i for i, c in enumerate(calls) if c.tag is not None}
    for i in learning:
        if calls[i].parent is not None and calls[i].parent in tagged:  # a later agent turn
            deps[i] = [tagged[calls[i].parent]]
            continue
        level = _level(calls[i])
        earlier = [lv for lv in by_level if lv < level]
        if not earlier:
            continue
        if (design == "barrier" or calls[i].role == WRITER) and not calls[i].repair:
            deps[i] = [j for lv in earlier for j in by_level[lv]]
        else:  # pipelined, and a repair re-ask in either design: right after its own first ask
            own = [lv for lv in earlier if by_group.get((calls[i].group, lv))]
            deps[i] = list(by_group[(calls[i].group, max(own))]) if own else []
    for i in consolidation:
        started = calls[i].ended - calls[i].service_s
        before = [j for j in consolidation if calls[j].ended <= started]
        deps[i] = learning + before
    return deps


def makespan(calls: Sequence[CallRecord], deps: list[list[int]], concurrency: int) -> float:
    """Greedy list scheduling of the calls on ``concurrency`` slots (a call with ``gap_s`` becomes ready that
    long after its dependencies end, without holding a slot meanwhile)."""
    waiting = [len(d) for d in deps]
    children: list[list[int]] = [[] for _ in calls]
    for i, d in enumerate(deps):
        for j in set(d):
            children[j].append(i)
        waiting[i] = len(set(d))
    ready = [(0.0, i) for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    waking: list[tuple[float, int]] = []  # in a tool gap: (ready at, call)
    running: list[tuple[float, int]] = []
    now, done = 0.0, 0
    while done < len(calls):
        while waking and waking[0][0] <= now:
            heapq.heappush(ready, heapq.heappop(waking))
        while ready and len(running) < concurrency:
            ready_at, i = heapq.heappop(ready)
            heapq.heappush(running, (max(now, ready_at) + calls[i].service_s, i))
        if waking and (not running or waking[0][0] < running[0][0]):
            now = waking[0][0]
            continue
        now, i = heapq.heappop(running)
        done += 1
        for child in children[i]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(waking if calls[child].gap_s > 0 else ready, (now + calls[child].gap_s, child))
    return now


def longest_chain(calls: Sequence[CallRecord], deps: list[list[int]]) -> float:
    finish: dict[int, float] = {}
    order = sorted(range(len(calls)), key=lambda i: (_level(calls[i]), calls[i].turn, calls[i].ended))
    for i in order:
        finish[i] = max((finish[j] for j in deps[i]), default=0.0) + calls[i].gap_s + calls[i].service_s
    return max(finish.values(), default=0.0)


def limits(calls: Sequence[CallRecord], concurrency: int) -> Limits:
    calls = sorted(calls, key=lambda c: (_level(c), c.ended - c.service_s))
    barrier = dependencies(calls, "barrier")
    pipelined = dependencies(calls, "pipelined")
    chain = longest_chain(calls, pipelined)
    work = sum(c.service_s for c in calls)
    return Limits(
        barrier_s=makespan(calls, barrier, concurrency),
        pipelined_s=makespan(calls, pipelined, concurrency),
        lower_bound_s=max(chain, work / concurrency),
        chain_s=chain,
    )
