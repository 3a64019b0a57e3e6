"""The time limit on one call of a user's function (rewards/deadline.py, issue 36), piece by piece and fast: limits
of 0.1-0.2 s, the grace before the last-resort exit shortened and the exit itself stood in for, so the whole
path of a call that never stops runs in-process in under a second."""

from __future__ import annotations

import contextvars
import functools
import signal
import sys
import threading
import time

import pytest

from rlhflab.rewards import deadline
from rlhflab.rewards.deadline import CallTimedOut, call_with_deadline, frames_at


def test_the_promised_numbers():
    """docs: SIGURG (ignored by default, so a stray one harms nothing), resent every second, and a hang never
    outlives its limit by more than 10 s before the process ends with a user input error's exit code, 2."""
    assert deadline.SIGNAL == signal.SIGURG
    assert (deadline.RESEND_EVERY_S, deadline.HARD_EXIT_AFTER_S, deadline.HARD_EXIT_CODE) == (1.0, 10.0, 2)


def test_call_timed_out_says_how_long_and_where():
    err = CallTimedOut(0.5, "f.py:3 (g)")
    assert (err.seconds, err.where, str(err)) == (0.5, "f.py:3 (g)", "no answer after 0.5 s (it was at f.py:3 (g))")
    assert str(CallTimedOut(2.0)) == "no answer after 2 s" and CallTimedOut(2.0).where == ""


def watchers(before=frozenset()):
    """{name: daemon} of rlhflab's threads alive now and not among `before` (other tests may leave a worker)."""
    return {t.name: t.daemon for t in threading.enumerate() if t.name.startswith("rlhflab-") and t not in before}


def test_no_limit_calls_directly_and_a_limit_installs_a_daemon_watchdog_only_during_the_call():
    seen, before = [], frozenset(threading.enumerate())
    assert call_with_deadline(lambda: seen.append((signal.getsignal(signal.SIGURG), watchers(before))) or 7, 0) == 7
    assert seen == [(signal.SIG_DFL, {})]
    assert call_with_deadline(lambda: seen.append((signal.getsignal(signal.SIGURG), watchers(before))) or 8, 5.0) == 8
    handler, threads = seen[1]
    assert callable(handler) and threads == {"rlhflab-deadline": True}
    assert signal.getsignal(signal.SIGURG) == signal.SIG_DFL


def three_deep():
    return two_deep()


def two_deep():
    return one_deep()


def one_deep():
    time.sleep(5)


def test_a_sleep_on_the_main_thread_is_interrupted_at_the_limit_and_its_innermost_three_frames_named():
    started = time.monotonic()
    with pytest.raises(CallTimedOut) as err:
        call_with_deadline(lambda: three_deep(), 0.2)
    assert 0.2 <= time.monotonic() - started < 4  # not the 5 s sleep
    line = one_deep.__code__.co_firstlineno
    assert err.value.seconds == 0.2 and err.value.where == (
        f"test_deadline.py:{line + 1} (one_deep) <- test_deadline.py:{line - 3} (two_deep) <- "
        f"test_deadline.py:{line - 7} (three_deep)")
    assert err.value.__cause__ is None and err.value.__suppress_context__  # not the _Interrupt's traceback
    assert signal.getsignal(signal.SIGURG) == signal.SIG_DFL


def test_frames_stop_at_rlhflab_s_own():
    frame = call_with_deadline(lambda: sys._getframe(1), 0)  # call_with_deadline's own frame
    assert frames_at(frame) == "" and frames_at(None) == ""
    mine = sys._getframe()
    assert frames_at(mine, depth=1) == f"test_deadline.py:{mine.f_lineno} (test_frames_stop_at_rlhflab_s_own)"


def test_an_interrupt_the_call_swallows_still_names_where_it_was():
    def swallows():
        try:
            time.sleep(5)
        except BaseException:  # noqa: BLE001 - a bare except in a user's function
            return 1.0

    with pytest.raises(CallTimedOut) as err:
        call_with_deadline(swallows, 0.1)
    line = swallows.__code__.co_firstlineno
    assert err.value.where.startswith(f"test_deadline.py:{line + 2} (swallows)")


def test_a_signal_that_lands_in_rlhflab_s_own_frame_is_not_an_interrupt():
    """The guard for a call that ends just as its limit passes: a signal handled while rlhflab's frame runs (here: a
    C function called straight from it, so no frame of the user's is on top) must not raise there, where nothing
    would turn it into CallTimedOut. The call runs out its 0.4 s and is then reported as over its limit."""
    started = time.monotonic()
    with pytest.raises(CallTimedOut) as err:
        call_with_deadline(functools.partial(time.sleep, 0.4), 0.1)
    assert time.monotonic() - started >= 0.39 and err.value.where == ""


def test_an_interrupt_caught_once_is_sent_again(monkeypatch):
    monkeypatch.setattr(deadline, "RESEND_EVERY_S", 0.1)
    caught = []

    def catches_the_first():
        try:
            time.sleep(5)
        except BaseException as err:  # noqa: BLE001 - a user's bare except around a slow step
            caught.append(type(err).__name__)
        time.sleep(5)

    started = time.monotonic()
    with pytest.raises(CallTimedOut):
        call_with_deadline(catches_the_first, 0.1)
    assert caught == ["_Interrupt"] and time.monotonic() - started < 4  # not the second 5 s sleep


def test_someone_else_s_sigurg_handler_still_gets_its_signals_and_is_put_back():
    got = []
    previous = signal.signal(signal.SIGURG, lambda signum, frame: got.append((signum, frame is not None)))
    try:
        def signals_itself():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGURG)
            time.sleep(0.05)  # the handler runs here
            return "done"

        assert call_with_deadline(signals_itself, 5.0) == "done"  # before the limit: not an interrupt
        assert got == [(signal.SIGURG, True)]
        assert call_with_deadline(lambda: "fast", 0.1) == "fast"
        time.sleep(0.25)  # past the limit of the call that ended: no signal from its watchdog
        assert got == [(signal.SIGURG, True)]
        assert signal.getsignal(signal.SIGURG) is not previous and callable(signal.getsignal(signal.SIGURG))
    finally:
        signal.signal(signal.SIGURG, previous)


def test_a_call_that_never_takes_the_interrupt_ends_the_process_after_the_grace(monkeypatch, capfd):
    monkeypatch.setattr(deadline, "RESEND_EVERY_S", 0.125)  # exact in binary: 3 x 0.125 == 0.375
    monkeypatch.setattr(deadline, "HARD_EXIT_AFTER_S", 0.375)
    exited, codes, sent = threading.Event(), [], []
    monkeypatch.setattr(deadline.os, "_exit", lambda code: codes.append(code) or exited.set())
    kill = signal.pthread_kill
    monkeypatch.setattr(deadline.signal, "pthread_kill", lambda ident, signum: sent.append(signum) or kill(ident,
                                                                                                          signum))

    def stuck():  # as C code that never returns to Python: the signal stays pending until the (stand-in) exit
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})
        try:
            exited.wait(5)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGURG})
        time.sleep(5)

    started = time.monotonic()
    with pytest.raises(CallTimedOut):
        call_with_deadline(stuck, 0.1, "reward function stuck")
    assert time.monotonic() - started < 4  # not the 5 s wait
    assert codes == [2] and sent == [signal.SIGURG] * 3  # sent at 0.1, 0.225 and 0.35 s; the exit at 0.475 s
    assert capfd.readouterr().err == (
        "rlhflab: reward function stuck did not return within 0.1 s and did not stop when interrupted 0.375 s later "
        "(it catches every exception, or is stuck outside Python): ending the process. -> make it faster or give it "
        "its own time limit, or raise --reward_timeout (0 = no limit)\n")


def test_off_the_main_thread_the_worker_returns_raises_and_sees_the_caller_s_context_variables(monkeypatch):
    var = contextvars.ContextVar("var", default="unset")
    results, before, stop = [], frozenset(threading.enumerate()), threading.Event()

    def caller():
        var.set("caller's")
        results.append(call_with_deadline(lambda: (var.get(), threading.current_thread().name, watchers(before)),
                                          5.0))
        try:
            call_with_deadline(lambda: 1 / 0, 5.0)
        except ZeroDivisionError as err:
            results.append(type(err).__name__)
        try:
            call_with_deadline(lambda: stop.wait(5), 0.1)
        except CallTimedOut as err:
            results.append((err.seconds, "test_deadline.py" in err.where))
        stop.set()  # the worker it left running ends

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(5)
    assert results == [("caller's", "rlhflab-user-call", {"rlhflab-user-call": True}), "ZeroDivisionError",
                       (0.1, True)]
    monkeypatch.setattr(deadline, "SIGNAL", None)  # no SIGURG (Windows): a worker on the main thread too
    assert call_with_deadline(lambda: threading.current_thread().name, 5.0) == "rlhflab-user-call"
    monkeypatch.setattr(deadline, "SIGNAL", signal.SIGURG)
    monkeypatch.delattr(deadline.signal, "pthread_kill")
    assert call_with_deadline(lambda: threading.current_thread().name, 5.0) == "rlhflab-user-call"
