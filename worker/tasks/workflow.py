"""Workflows declared in Python: steps built from ``@task`` handlers, and the dependencies between
them (a chain, a group with an optional join, any graph without cycles).

A ``Workflow`` only describes; ``worker.enqueue_workflow`` writes it (one transaction, by COPY,
see ``tasks.flows``) and ``worker.testing.run_workflow`` runs it in-process. Each step's handler
reads the results of the steps it depends on as ``ctx.inputs``, in the order its ``depends_on``
names them.

    flow = worker.Workflow("report")
    a = flow.add(fetch, {"day": "2024-01-01"})
    b = flow.add(parse, depends_on=[a])
    flow.add(cleanup, depends_on=[worker.after(b, run_on_failure=True)])

    worker.chain(worker.step(fetch, {...}), worker.step(parse), worker.step(store))
    worker.group([worker.step(resize, {"n": n}) for n in range(10)], then=worker.step(total))
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import WorkerError
from .registry import TaskDef


class WorkflowError(WorkerError, ValueError):
    """A workflow that cannot be enqueued: a dependency cycle, a step that depends on itself or
    on a step of another workflow. The message is one line naming the steps."""


@dataclass(eq=False)
class Step:
    """One step: a task and its payload, where it runs, and what it waits for."""

    task: str | TaskDef
    payload: Any = None
    queue: str | None = None
    priority: int = 0
    max_attempts: int | None = None
    limit_key: str | None = None
    key: str | None = None  # a name for messages and for run_workflow's results
    depends_on: list[After] = field(default_factory=list)
    workflow: Workflow | None = field(default=None, repr=False)
    index: int = -1  # its place in its workflow, in the order added

    @property
    def name(self) -> str:
        """How messages name the step: its key, else its task and place."""
        if self.key is not None:
            return self.key
        task = self.task.name if isinstance(self.task, TaskDef) else self.task
        return f"{task}#{self.index + 1}"

    def after(self, *steps: Step | After, run_on_failure: bool = False) -> Step:
        """Add dependencies to this step (after it was added); returns the step."""
        self.depends_on.extend(_edge(s, run_on_failure) for s in steps)
        return self


@dataclass(frozen=True, eq=False)
class After:
    """A dependency on ``step``; ``run_on_failure``: run even when ``step`` fails for good or is
    cancelled (its input is then None). By default such a failure cancels the dependent."""

    step: Step
    run_on_failure: bool = False


def after(step: Step, *, run_on_failure: bool = False) -> After:
    """A dependency on ``step``, for ``depends_on=[...]``, that may run on its failure."""
    return After(step, run_on_failure)


def _edge(dep: Step | After, run_on_failure: bool = False) -> After:
    if isinstance(dep, After):
        return dep
    if isinstance(dep, Step):
        return After(dep, run_on_failure)
    raise TypeError(f"depends_on takes steps (or worker.after(step)), not {type(dep).__name__}")


def step(
    task: str | TaskDef,
    payload: Any = None,
    *,
    queue: str | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    limit_key: str | None = None,
    key: str | None = None,
) -> Step:
    """A step not yet in a workflow, for ``chain`` and ``group`` (or ``Workflow.add``)."""
    return Step(task, payload, queue, priority, max_attempts, limit_key, key)


class Workflow:
    """A graph of steps, enqueued as a whole by ``worker.enqueue_workflow``."""

    def __init__(self, name: str = "") -> None:
        if len(name) > 255:
            raise ValueError("a workflow's name is at most 255 characters")
        self.name = name
        self.steps: list[Step] = []

    def add(
        self,
        task: str | TaskDef | Step,
        payload: Any = None,
        *,
        depends_on: Iterable[Step | After] = (),
        **options: Any,
    ) -> Step:
        """Add a step (a task and its payload, or a ``step(...)``) that runs once every step of
        ``depends_on`` finished done; returns it, for other steps' ``depends_on``."""
        if isinstance(task, Step):
            if payload is not None or options:
                raise TypeError("give a step's payload and options to worker.step(), not add()")
            new = task
        else:
            new = step(task, payload, **options)
        if new.workflow is not None:
            raise WorkflowError(f"step {new.name!r} is in a workflow already")
        new.workflow = self
        new.index = len(self.steps)
        new.depends_on.extend(_edge(d) for d in depends_on)
        self.steps.append(new)
        return new

    def __len__(self) -> int:
        return len(self.steps)

    def order(self) -> list[Step]:
        """The steps in an order where each comes after its dependencies (the order added,
        where it allows). Raises ``WorkflowError`` (one line) for a dependency on itself, on a
        step of no or another workflow, or a cycle."""
        if not self.steps:
            raise WorkflowError(f"workflow {self.name!r} has no steps")
        label = f"workflow {self.name!r}: " if self.name else ""
        waiting: dict[int, int] = {}
        dependents: dict[int, list[Step]] = {}
        for s in self.steps:
            seen: set[int] = set()
            for edge in s.depends_on:
                dep = edge.step
                if dep is s:
                    raise WorkflowError(f"{label}step {s.name!r} depends on itself")
                if dep.workflow is not self:
                    raise WorkflowError(
                        f"{label}step {s.name!r} depends on step {dep.name!r}, which is not in "
                        "this workflow (add it first)"
                    )
                if dep.index in seen:
                    raise WorkflowError(
                        f"{label}step {s.name!r} depends on step {dep.name!r} twice"
                    )
                seen.add(dep.index)
                dependents.setdefault(dep.index, []).append(s)
            waiting[s.index] = len(seen)
        ready = [s.index for s in self.steps if waiting[s.index] == 0]  # a heap: earliest first
        out: list[Step] = []
        while ready:
            s = self.steps[heapq.heappop(ready)]
            out.append(s)
            for d in dependents.get(s.index, ()):
                waiting[d.index] -= 1
                if waiting[d.index] == 0:
                    heapq.heappush(ready, d.index)
        if len(out) < len(self.steps):
            cycle = _cycle([s for s in self.steps if waiting[s.index] > 0])
            raise WorkflowError(f"{label}dependency cycle: {' -> '.join(s.name for s in cycle)}")
        return out


def _cycle(stuck: Sequence[Step]) -> list[Step]:
    """One cycle among steps that never became ready (each has a stuck dependency)."""
    left = {s.index for s in stuck}
    s = stuck[0]
    path: list[Step] = []
    at: dict[int, int] = {}
    while s.index not in at:
        at[s.index] = len(path)
        path.append(s)
        s = next(e.step for e in s.depends_on if e.step.index in left)
    loop = path[at[s.index] :]
    loop.reverse()  # dependency first: a -> b reads "b waits for a"
    first = min(range(len(loop)), key=lambda i: loop[i].index)  # from the earliest added
    loop = loop[first:] + loop[:first]
    return [*loop, loop[0]]


def chain(*steps: Step, name: str = "") -> Workflow:
    """Each step after the one before it, receiving its result as ``ctx.inputs[0]``."""
    flow = Workflow(name)
    prev: Step | None = None
    for s in steps:
        prev = flow.add(s, depends_on=[] if prev is None else [prev])
    return flow


def group(steps: Iterable[Step], *, then: Step | None = None, name: str = "") -> Workflow:
    """The steps in parallel; ``then``, when given, runs once after all of them finished done,
    with their results in the order given as ``ctx.inputs`` (a chord)."""
    flow = Workflow(name)
    members = [flow.add(s) for s in steps]
    if then is not None:
        flow.add(then, depends_on=members)
    return flow


__all__ = ["After", "Step", "Workflow", "WorkflowError", "after", "chain", "group", "step"]
