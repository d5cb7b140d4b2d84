"""The callback protocol: what the engine calls on the concerns attached to it (they see its
objects through ``training.context.RunContext``).

A callback is one concern of a training run (routing quality, hang detection, mirroring to object
storage, the summary, ...). The engine calls every callback at each event, in the order of its
list, on every rank: a callback may run collectives in any event except the two around a
checkpoint's promotion (which run on one rank). Callbacks see the engine's objects through the
``RunContext`` and receive their own settings when they are made; none sees the whole run
configuration.

Events, in the order of a run::

    setup            model, optimizer and data exist; nothing resumed yet
    newer_checkpoint a checkpoint to resume from that is newer than the newest local one
    load_state_dict  this callback's state from the checkpoint the run resumes (if any)
    evaluate         after each held-out evaluation (``record["eval_loss"]`` is set): before
                     training, during it, and the final one (``BEFORE``, ``DURING``, ``FINAL``)
    start            before the first step of this attempt (``record``: the run's start record)
    before_step      with the global batch's micro-batches, before forward and backward
    after_step       with the step's record (loss, lr, grad norm, evaluation); fill it in
    checkpoint_promoting / checkpoint_promoted   around each checkpoint becoming the newest
    state_dict       what to save with each checkpoint
    finish           once training is done; fill in the summary
    stopped          the run ends abnormally (an exception, SIGTERM, a hang): record why
    close            always, last (release threads, files, processes)
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from megatron_slmoe.training.context import RunContext

log = logging.getLogger("megatron_slmoe.training")

BEFORE, DURING, FINAL = "before training", "during training", "after training"
"""When an evaluation happens: before the first step, at ``--eval-interval``, or the final one (at
the last step, or at the end of a run resumed there)."""


class Callback:
    """One concern of a training run; override the events it needs (all do nothing here).

    ``name`` keys the callback's state in a checkpoint; it must be unique within a run."""

    name = "callback"

    def setup(self, ctx: RunContext) -> None:
        pass

    def newer_checkpoint(self, ctx: RunContext, local: Optional[str]) -> Optional[str]:
        """A checkpoint newer than ``local`` (the newest intact one in the run's folder, or None)
        brought into the run's checkpoint folder, or None; collective: every rank returns the
        same."""
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def evaluate(self, ctx: RunContext, record: dict, when: str) -> None:
        pass

    def start(self, ctx: RunContext, record: dict) -> None:
        pass

    def before_step(self, ctx: RunContext, microbatches: list) -> None:
        pass

    def after_step(self, ctx: RunContext, record: dict) -> None:
        pass

    def checkpoint_promoting(self) -> None:
        """On each rank, before a checkpoint becomes the newest (older ones may then be pruned);
        no collective."""

    def checkpoint_promoted(self, path: str) -> None:
        """On each rank, once the checkpoint at ``path`` is the newest; no collective."""

    def state_dict(self) -> Optional[dict]:
        return None

    def finish(self, ctx: RunContext, summary: dict) -> None:
        pass

    def stopped(self, ctx: Optional[RunContext], reason: str, iteration: int) -> None:
        """The run ends abnormally (any thread may call it; once per reason at most)."""

    def close(self) -> None:
        pass


class Callbacks:
    """The run's callbacks, each event dispatched to all of them in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        names = [c.name for c in callbacks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"callback names must be unique: {duplicates}")
        self.items = list(callbacks)

    def __iter__(self):
        return iter(self.items)

    def setup(self, ctx: RunContext) -> None:
        for c in self.items:
            c.setup(ctx)

    def newer_checkpoint(self, ctx: RunContext, local: Optional[str]) -> Optional[str]:
        offered = [c.newer_checkpoint(ctx, local) for c in self.items]  # every one: collective
        return next((path for path in offered if path), None)

    def load_state_dict(self, states: dict) -> None:
        for c in self.items:
            if c.name in states:
                c.load_state_dict(states[c.name])

    def evaluate(self, ctx: RunContext, record: dict, when: str) -> None:
        for c in self.items:
            c.evaluate(ctx, record, when)

    def start(self, ctx: RunContext, record: dict) -> None:
        for c in self.items:
            c.start(ctx, record)

    def before_step(self, ctx: RunContext, microbatches: list) -> None:
        for c in self.items:
            c.before_step(ctx, microbatches)

    def after_step(self, ctx: RunContext, record: dict) -> None:
        for c in self.items:
            c.after_step(ctx, record)

    def checkpoint_promoting(self) -> None:
        for c in self.items:
            c.checkpoint_promoting()

    def checkpoint_promoted(self, path: str) -> None:
        for c in self.items:
            c.checkpoint_promoted(path)

    def state_dict(self) -> dict:
        states = {}
        for c in self.items:
            state = c.state_dict()
            if state is not None:
                states[c.name] = state
        return states

    def finish(self, ctx: RunContext, summary: dict) -> None:
        for c in self.items:
            c.finish(ctx, summary)

    def stopped(self, ctx: Optional[RunContext], reason: str, iteration: int) -> None:
        for c in self.items:
            try:
                c.stopped(ctx, reason, iteration)
            except Exception:  # noqa: BLE001  (the run is ending: every callback gets its say)
                log.exception("callback %s failed while the run was stopping", c.name)

    def close(self) -> None:
        for c in reversed(self.items):
            try:
                c.close()
            except Exception:  # noqa: BLE001
                log.exception("callback %s failed to close", c.name)
