"""SIGINT / SIGTERM: finish the current step, write a checkpoint, exit with a code that says so.

Exit codes (docs/reading-a-run.md "Checkpoints and resume"; the CLI returns them):
  130  SIGINT: the current step finished and a checkpoint was written
  143  SIGTERM (e.g. a scheduler's pre-emption notice): same, checkpoint written
  4    a second SIGINT / SIGTERM while the first was being handled: out at once; the last
       complete checkpoint is untouched (a half-written `.tmp-*` folder is ignored on resume)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from rlhflab.errors import ABORTED_EXIT_CODE, EXIT_CODES, Interrupted  # torch-free: the CLI imports them there

log = logging.getLogger("rlhflab")

__all__ = ["ABORTED_EXIT_CODE", "EXIT_CODES", "Interrupted", "StopSignals"]


class StopSignals:
    """While entered, SIGINT / SIGTERM set `requested` instead of killing the process.

    Handlers can only be installed from the main thread; elsewhere (a notebook worker
    thread, a test runner thread) the default behaviour stays and `requested` stays None.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            sys.stderr.write(f"rlhflab: second {signal.Signals(signum).name}: exiting now, no checkpoint written\n")
            sys.stderr.flush()
            os._exit(ABORTED_EXIT_CODE)  # touches no file: the last complete checkpoint stays as it was
        self.requested = signum
        log.warning("%s: finishing the current step, then writing a checkpoint (send it again to quit at once)",
                    signal.Signals(signum).name)
