"""SIGINT / SIGTERM: finish the current step, write a checkpoint, exit with a code that says so.

Exit codes (docs/reading-a-run.md "Checkpoints and resume"; the CLI returns them):
  130  SIGINT: the current step finished and a checkpoint was written
  143  SIGTERM (e.g. a scheduler's pre-emption notice): same, checkpoint written
  4    a second SIGINT / SIGTERM while the first was being handled: out at once; the last
       complete checkpoint is untouched (a half-written `.tmp-*` folder is ignored on resume)

Under torchrun / accelerate launch (TORCHELASTIC_RUN_ID set) the same signal again within REPEAT_WINDOW_S
of the first is the same notice delivered twice, not a request to quit at once: a scheduler that signals
every process of the job (Slurm's preemption and scancel do) reaches each rank directly and once more through
torchrun, which forwards what it receives to every worker (docs/scaling-out.md "Pre-emption and a rank
that dies"). A rank leaving the loop with an error likewise drops a SIGTERM within that window: the launcher's,
sent to the ranks left once one ended, must not cut short the line that says which one ended.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from rlhflab.errors import ABORTED_EXIT_CODE, EXIT_CODES, Interrupted  # torch-free: the CLI imports them there

log = logging.getLogger("rlhflab")

__all__ = ["ABORTED_EXIT_CODE", "EXIT_CODES", "Interrupted", "StopSignals"]

REPEAT_WINDOW_S = 5.0


class StopSignals:
    """While entered, SIGINT / SIGTERM set `requested` instead of killing the process.

    Handlers can only be installed from the main thread; elsewhere (a notebook worker
    thread, a test runner thread) the default behaviour stays and `requested` stays None.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}
        self._first_at = 0.0  # time.monotonic() of the signal in `requested`

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # under a launcher, a signal still on its way for what already happened is dropped for REPEAT_WINDOW_S:
        # - stopping after the checkpoint: the launcher's copy of the notice;
        # - leaving with an error (a collective failed because another rank ended): the SIGTERM the launcher sends
        #   the ranks left once it sees one end, which would kill this rank before the CLI says which rank ended
        #   and how to resume (cli.peer_lost; seen on a loaded machine: exit -15 and no line)
        if self.requested is not None:
            late = {self.requested} if self._same_notice(self.requested) else set()
        elif exc_type is not None and launched():
            late, self._first_at = {signal.SIGTERM}, time.monotonic()
        else:
            late = set()
        for signum, handler in self._previous.items():
            signal.signal(signum, self._late_copy if signum in late else handler)
        self._previous = {signum: handler for signum, handler in self._previous.items() if signum in late}

    def _late_copy(self, signum: int, frame) -> None:
        """After the stop or the error: a signal within the window is dropped; anything later acts as before."""
        if launched() and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            return
        signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
        os.kill(os.getpid(), signum)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None and self._same_notice(signum):
            log.warning("%s again, %.1f s after the first: the same notice through the launcher, still finishing "
                        "the step (send it after %.0f s to quit at once)", signal.Signals(signum).name,
                        time.monotonic() - self._first_at, REPEAT_WINDOW_S)
            return
        if self.requested is not None:
            sys.stderr.write(f"rlhflab: second {signal.Signals(signum).name}: exiting now, no checkpoint written\n")
            sys.stderr.flush()
            os._exit(ABORTED_EXIT_CODE)  # touches no file: the last complete checkpoint stays as it was
        self.requested, self._first_at = signum, time.monotonic()
        log.warning("%s: finishing the current step, then writing a checkpoint (send it again to quit at once)",
                    signal.Signals(signum).name)

    def _same_notice(self, signum: int) -> bool:
        """A repeat that a launched worker gets twice for one notice (module doc)."""
        return signum == self.requested and launched() and time.monotonic() - self._first_at < REPEAT_WINDOW_S


def launched() -> bool:
    """Whether torchrun / accelerate launch started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ
