"""A time limit on one call of a user's function (`--reward_timeout`), and what to do when it is spent.

    out = call_with_deadline(lambda: fn(prompts=..., completions=...), seconds=600, what="reward function exact")

On the main thread (where the trainers call rewards) the function runs where it always ran, so whatever is
thread-bound still works there: signal-based timeouts inside it (math_verify's `parse` / `verify` use SIGALRM and
refuse to run on another thread), torch's grad mode, the CUDA device a rank set. A watchdog thread waits out the
limit, then sends SIGURG (default action: ignore, so a stray one harms nothing) to the main thread, whose handler
raises `_Interrupt` inside the call: a sleep, a socket read, a subprocess wait or a pure-Python loop stops there.
`_Interrupt` is a BaseException, so the `except Exception` blocks reward functions wrap their parsing in let it
through. A call that does not stop (C code holding the interpreter or retrying its system call itself, or a
bare `except:` that swallows every interrupt) is given `HARD_EXIT_AFTER_S` more seconds, then the process ends with the same message on stderr (exit 2,
a user input error's): a hang never outlives its limit by more than that.

Off the main thread (a notebook's worker, Windows) the call runs in a daemon thread the caller waits for; on
timeout the caller raises and the thread is left running (nothing can stop it) without keeping the process alive.
"""

from __future__ import annotations

import contextvars
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

SIGNAL = getattr(signal, "SIGURG", None)  # default action: ignore
RESEND_EVERY_S = 1.0  # a caught interrupt is sent again until the call ends
HARD_EXIT_AFTER_S = 10.0  # then the process ends: the call is stuck outside Python
HARD_EXIT_CODE = 2  # the CLI's code for a user input error


class CallTimedOut(Exception):
    """The call did not return within `seconds`; `where`: the innermost frames it was running ("" if unknown)."""

    def __init__(self, seconds: float, where: str = ""):
        self.seconds, self.where = seconds, where
        super().__init__(f"no answer after {seconds:g} s" + (f" (it was at {where})" if where else ""))


class _Interrupt(BaseException):
    """Raised inside the call by the watchdog's signal; a BaseException so `except Exception` does not hold it."""


def call_with_deadline(call: Callable[[], T], seconds: float, what: str = "the call") -> T:
    """`call()`, or CallTimedOut after `seconds` (0 = no limit). `what` names the call in the last-resort exit."""
    if not seconds:
        return call()
    on_main = threading.current_thread() is threading.main_thread()
    if SIGNAL is not None and hasattr(signal, "pthread_kill") and on_main:
        return _on_main_thread(call, seconds, what)
    return _on_worker_thread(call, seconds)


class _Watch:
    """The watchdog's side: wait out the limit, interrupt the main thread, and at last end the process."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.expired = False  # the limit passed before the call ended
        self.where = ""

    def run(self, target: int) -> None:
        if self.ended.wait(self.seconds):
            return
        waited = 0.0
        while waited < HARD_EXIT_AFTER_S:
            with self.lock:  # never a signal after end(): the handler is restored right after it
                if self.ended.is_set():
                    return
                self.expired = True
                signal.pthread_kill(target, SIGNAL)
            if self.ended.wait(RESEND_EVERY_S):
                return
            waited += RESEND_EVERY_S
        os.write(2, f"rlhflab: {self.what} did not return within {self.seconds:g} s and did not stop when "
                    f"interrupted {HARD_EXIT_AFTER_S:g} s later (it catches every exception, or is stuck outside Python): "
                    "ending the process. -> make it faster or give it its own time limit, or raise --reward_timeout "
                    "(0 = no limit)\n".encode())
        os._exit(HARD_EXIT_CODE)

    def end(self) -> bool:
        """Mark the call ended; True when its limit had passed."""
        with self.lock:
            self.ended.set()
            return self.expired


def _on_main_thread(call: Callable[[], T], seconds: float, what: str) -> T:
    watch = _Watch(seconds, what)

    def handler(signum, frame):
        if watch.expired and not watch.ended.is_set():
            if frame is not None and frame.f_code.co_filename == __file__:
                return  # between the call's end and end() here: the call is over (and resent to if not)
            watch.where = watch.where or frames_at(frame)
            raise _Interrupt
        if callable(previous):  # someone else's SIGURG
            previous(signum, frame)

    previous = signal.signal(SIGNAL, handler)
    try:
        threading.Thread(target=watch.run, args=(threading.get_ident(),), daemon=True,
                         name="rlhflab-deadline").start()
        try:
            out = call()
        except BaseException:  # noqa: BLE001 - _Interrupt, or what the call made of it (caught, re-raised)
            if watch.end():
                raise CallTimedOut(seconds, watch.where) from None
            raise
        if watch.end():  # interrupted, but the function swallowed the interrupt and returned
            raise CallTimedOut(seconds, watch.where)
        return out
    finally:
        watch.end()
        signal.signal(SIGNAL, previous)


def _on_worker_thread(call: Callable[[], T], seconds: float) -> T:
    box: dict = {}
    context = contextvars.copy_context()

    def run() -> None:
        try:
            box["out"] = context.run(call)
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["err"] = err

    worker = threading.Thread(target=run, daemon=True, name="rlhflab-user-call")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise CallTimedOut(seconds, frames_at(sys._current_frames().get(worker.ident)))
    if "err" in box:
        raise box["err"]
    return box["out"]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rlhflab's own frames are not shown


def frames_at(frame, depth: int = 3) -> str:
    """`file:line (function)` of the innermost `depth` frames of the user's code (up to rlhflab's), innermost first."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        if os.path.abspath(code.co_filename).startswith(_PACKAGE + os.sep):
            break
        parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})")
        frame = frame.f_back
    return " <- ".join(parts)
