"""The training loop's side duties as an ordered list of hooks, each saying at which steps it runs.

After every step the loop hands a :class:`StepState` to :meth:`Hooks.after_step`,
which runs the hooks that are due, in the order they were added. The duties a
run has by default, in their order (``seqjax.train.loop``):

    flush        fetch the step window's metrics, check them, log them   every train.log_every steps
    checkpoint   save params, optimizer, RNG and the data position        every train.checkpoint_every, stop
    validate     score the validation split, log it                      every train.eval_every
    stop         a SIGTERM/SIGINT arrived: wait for the save, exit         when asked
    profile      train.profile's trace stopped after its last step          once

Every hook also runs at the run's last step unless it says ``at_last=False``.

One rule sits here and nowhere else: **the metrics are flushed before any
other hook runs.** Flushing is what checks each step's loss for NaN (under
``train.nonfinite``), so a bad step stops the run before a checkpoint can hold
it, and validation time never counts as training throughput.

A feature attaches without editing the loop, as Levanter's
``trainer.add_hook(fn, every=N)`` does::

    def log_norm(state):
        print(state.step, optax.global_norm(state.params))

    train(config, hooks=[Hook("param_norm", log_norm, every=100)])

Extra hooks run after the built-in ones, so they see the step's checkpoint and validation already
done. :func:`builtin_hooks` defines the built-in ones, here, over the objects the loop hands it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from typing import Any, Callable, Sequence

from seqjax.train.signals import Interrupted


@dataclasses.dataclass(frozen=True)
class StepState:
    """What a hook may read after step ``step``: the new parameters and optimizer state (device
    arrays, not to be donated or changed), the RNG, the data iterator's position after the step's
    batch, and whether a stop was requested at this step."""

    step: int
    params: Any
    opt_state: Any
    rng: Any
    position: Any
    stopping: bool = False


@dataclasses.dataclass
class Hook:
    """``run(state)`` after every ``every``-th step, at the last step (``at_last``), and whenever
    ``when(state)``."""

    name: str
    run: Callable[[StepState], Any]
    every: int | None = None
    at_last: bool = True
    when: Callable[[StepState], bool] | None = None
    # False: it neither waits for nor forces the metrics flush (the profiler's trace)
    after_flush: bool = True

    def due(self, state: StepState, last_step: int) -> bool:
        return bool((self.every and state.step % self.every == 0)
                    or (self.at_last and state.step == last_step)
                    or (self.when is not None and self.when(state)))


class Hooks:
    """The ordered hooks of one run; the first is the metrics flush, which runs whenever any hook is
    due."""

    def __init__(self, flush: Hook, last_step: int):
        self.last_step = last_step
        self._hooks = [flush]

    def add(self, hook: Hook) -> Hook:
        if any(h.name == hook.name for h in self._hooks):
            raise ValueError(f"hook {hook.name!r} is already added; expected a new name")
        self._hooks.append(hook)
        return hook

    def extend(self, hooks: Sequence[Hook]) -> None:
        for hook in hooks:
            self.add(hook)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self._hooks]

    def after_step(self, state: StepState) -> None:
        flush, *others = self._hooks
        due = [h for h in others if h.due(state, self.last_step)]
        if any(h.after_flush for h in due) or flush.due(state, self.last_step):
            flush.run(state)  # first, always: a non-finite step must never reach a checkpoint
        for hook in due:
            hook.run(state)


@dataclasses.dataclass
class Duties:
    """What the built-in hooks act on, handed over by the loop.

    ``steps``: the StepLogger (the metrics window and its flush); ``checkpoints``: the Checkpointer;
    ``meta()``: what a checkpoint records besides the state; ``config``: the resolved config, saved
    with each checkpoint; ``validate(state)``: one validation, logged (None: the run has no
    validation data); ``stop_signal()``: the signal a stop was requested with; ``profiler``: the
    ProfileWindow; ``critical()``: a context in which no signal cuts a checkpoint write short.
    """

    steps: Any
    checkpoints: Any
    meta: Callable[[], dict[str, Any]]
    config: Any
    validate: Callable[[StepState], Any] | None
    stop_signal: Callable[[], int | None]
    profiler: Any
    critical: Callable[[], Any] = contextlib.nullcontext


def builtin_hooks(duties: Duties, *, last_step: int, checkpoint_every: int, eval_every: int) -> Hooks:
    """The run's own duties, in their order: flush, checkpoint, validate, stop, profile (see the
    table above)."""

    def flush(state: StepState) -> None:
        duties.steps.flush(state.step)
        duties.checkpoints.check()  # a background save that failed stops the run here, not later

    def checkpoint(state: StepState) -> None:
        with duties.critical():  # a Ctrl-C never cuts a save in half: the write finishes first
            duties.checkpoints.save(state.step, state.params, state.opt_state, state.rng,
                                    state.position, duties.meta(), duties.config.to_dict())

    def validate(state: StepState) -> None:
        duties.validate(state)
        duties.steps.restart()  # validation time is not training throughput

    def stop(state: StepState) -> None:
        with duties.critical():
            duties.checkpoints.wait()
        raise Interrupted(duties.stop_signal() or signal.SIGTERM, state.step)

    hooks = Hooks(Hook("flush", flush, when=lambda s: duties.steps.due(s.step)), last_step=last_step)
    hooks.add(Hook("checkpoint", checkpoint, every=checkpoint_every, when=lambda s: s.stopping))
    if duties.validate is not None:
        hooks.add(Hook("validate", validate, every=eval_every))
    hooks.add(Hook("stop", stop, at_last=False, when=lambda s: s.stopping))
    profiler = duties.profiler
    hooks.add(Hook("profile", profiler.after, at_last=False, when=profiler.due, after_flush=False))
    return hooks
