"""Ctrl-C during training, deferred to the end of the current step.

A KeyboardInterrupt raised in the middle of a step could leave the weights, the optimizer
and the data position out of step with each other, so a checkpoint could only be saved at
the last evaluation and every step since was lost. :class:`DeferredInterrupt` turns the
first Ctrl-C into a request that the training loop honours between steps (it saves a
checkpoint, then raises KeyboardInterrupt); a second Ctrl-C interrupts at once. SIGTERM
(``timeout``, a job scheduler, ``kill``) is deferred the same way where it would end the
process at once: the step ends, the checkpoint and the run's record are saved, then it ends
the process as it would have (:meth:`DeferredInterrupt.end_if_terminated`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class DeferredInterrupt:
    """Context manager: inside it, the first SIGINT (or SIGTERM) sets :attr:`requested`
    instead of raising (or ending the process).

    Installed only in the main thread and only where the signal has its default handling
    (Python's for SIGINT, the system's for SIGTERM; a program, or a search worker with its
    own, keeps its own); elsewhere :attr:`requested` stays False and the signal acts as
    usual. :attr:`terminated`: the request was a SIGTERM.
    """

    def __init__(self) -> None:
        self.requested = False
        self.terminated = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
            for signum, default in defaults.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # a second signal: do not wait for the step to end
            if self.terminated or signum == signal.SIGTERM:
                self.end_if_terminated(now=True)
            raise KeyboardInterrupt
        self.requested = True
        self.terminated = signum == signal.SIGTERM

    def end_if_terminated(self, now: bool = False) -> None:
        """After a deferred SIGTERM (or with ``now``), end the process by SIGTERM, as it
        would have ended at the signal (its status says so to the scheduler)."""
        if self.terminated or now:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous = {}
