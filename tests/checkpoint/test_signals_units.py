"""StopSignals in-process: which signals it catches, the first one a stop request, a second one out at once (exit 4),
the handlers from before given back on the way out, and the repeat window under torchrun (TORCHELASTIC_RUN_ID).

Signals go to this process with os.kill. The module's `os._exit` raises instead of ending pytest, and so does its
re-sending of a signal whose action is the default one (GuardedOs); its clock is a fake one, so the 5 s window is
crossed without waiting. The CLI runs that a real
SIGTERM / SIGINT stops are in test_signals.py."""

import logging
import os
import signal
import threading
import time

import pytest

from rlhflab.checkpoint import signals
from rlhflab.checkpoint.signals import REPEAT_WINDOW_S, StopSignals
from rlhflab.errors import ABORTED_EXIT_CODE


class Clock:
    """Stands in for the module's `time`: `monotonic()` reads `now`, which the test moves."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class Exited(Exception):
    """What the stand-in `os._exit` raises, with the code it was given."""

    def __init__(self, code) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def before():
    """A recording handler installed for SIGINT, SIGTERM and SIGUSR1 before each test; the real ones put back after."""
    caught: list[int] = []

    def handler(signum, frame):
        caught.append(signum)

    handler.caught = caught
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield handler
    for signum, old in previous.items():
        signal.signal(signum, old)


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(signals, "time", fake)
    return fake


class Died(Exception):
    """What the module's `os.kill` raises for a signal whose action here is the default one: the end of pytest."""


class GuardedOs:
    """The module's `os` in every test here: `_exit` raises Exited, and `kill` of this process raises Died where the
    signal's action is the default one, so a handler wrongly given up or left out fails its test instead of ending
    pytest (which mutmut would not count as a kill); everything else is the real `os`."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def _exit(code):
        raise Exited(code)

    @staticmethod
    def kill(pid, signum):
        if pid == os.getpid() and signal.getsignal(signum) in (signal.SIG_DFL, None):
            raise Died(signal.Signals(signum).name)
        os.kill(pid, signum)


@pytest.fixture(autouse=True)
def guarded_os(monkeypatch):
    monkeypatch.setattr(signals, "os", GuardedOs())


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")


@pytest.fixture
def no_launcher(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.005)  # the Python-level handler runs at the next bytecode boundary; the sleep makes sure


def test_while_entered_sigint_and_sigterm_are_caught_and_no_other_signal(before, no_launcher):
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle and signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGUSR1) is before
        assert stop._previous == {signal.SIGINT: before, signal.SIGTERM: before}
        send(signal.SIGUSR1)  # not a stop request: the handler from before gets it
        assert before.caught == [signal.SIGUSR1] and stop.requested is None
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)] == [before] * 3
    assert stop._previous == {} and stop.requested is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("launched", [False, True])
def test_the_first_signal_is_a_stop_request_and_the_step_goes_on(before, clock, monkeypatch, caplog, signum, launched):
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    stop = StopSignals()
    assert stop.requested is None
    with caplog.at_level(logging.WARNING, logger="rlhflab"), stop:
        clock.now = 123.0
        send(signum)
        after_the_signal = True  # the handler returned: the step finishes
    assert after_the_signal and stop.requested == signum and stop._first_at == 123.0
    assert before.caught == []
    name = signal.Signals(signum).name
    assert caplog.messages == [f"{name}: finishing the current step, then writing a checkpoint "
                               "(send it again to quit at once)"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_the_handlers_from_before_are_back_at_once_without_a_launcher(before, clock, no_launcher):
    with StopSignals() as stop:
        send(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    assert stop._previous == {}
    send(signal.SIGTERM)  # within the window, but no launcher: not a late copy
    assert before.caught == [signal.SIGTERM]

    with pytest.raises(ValueError), StopSignals() as stop:  # leaving with an error: the same
        raise ValueError("boom")
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    assert stop._previous == {} and stop.requested is None

    with StopSignals() as stop:  # nothing sent, no error
        pass
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    assert stop._previous == {}


def test_under_a_launcher_without_a_signal_or_an_error_the_handlers_from_before_are_back_at_once(before, launcher):
    with StopSignals() as stop:
        pass
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    assert stop._previous == {}
    send(signal.SIGTERM)
    assert before.caught == [signal.SIGTERM]


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)])
def test_a_second_signal_without_a_launcher_exits_at_once_with_code_4_and_says_so(
        before, clock, no_launcher, monkeypatch, first, second):
    seen = []

    class Stderr:  # the line must be flushed before os._exit, which flushes nothing
        def write(self, text):
            seen.append(("write", text))

        def flush(self):
            seen.append(("flush",))

    monkeypatch.setattr(signals.sys, "stderr", Stderr())
    with pytest.raises(Exited) as exited, StopSignals() as stop:
        send(first)
        clock.now += 0.5  # well within the window: without a launcher any repeat means "quit now"
        send(second)
        pytest.fail("the second signal returned")  # pragma: no cover
    assert exited.value.code == ABORTED_EXIT_CODE == 4
    name = signal.Signals(second).name
    assert seen == [("write", f"rlhflab: second {name}: exiting now, no checkpoint written\n"), ("flush",)]
    assert stop.requested == first
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is before


def test_under_a_launcher_the_same_signal_again_within_the_window_is_one_notice(before, clock, launcher,
                                                                                caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="rlhflab"), StopSignals() as stop:
        send(signal.SIGTERM)
        clock.now += 2.0
        send(signal.SIGTERM)  # torchrun's copy: logged, the step still finishes
        clock.now += REPEAT_WINDOW_S - 2.0 - 1e-6
        send(signal.SIGTERM)  # still within the window
        assert stop.requested == signal.SIGTERM
    assert caplog.messages[1] == ("SIGTERM again, 2.0 s after the first: the same notice through the launcher, still "
                                  "finishing the step (send it after 5 s to quit at once)")
    assert caplog.messages[2].startswith("SIGTERM again, 5.0 s after the first")
    assert len(caplog.messages) == 3 and capsys.readouterr().err == ""


def test_under_a_launcher_the_same_signal_at_the_end_of_the_window_exits_at_once(before, clock, launcher,
                                                                                 capsys):
    with pytest.raises(Exited) as exited, StopSignals():
        send(signal.SIGTERM)
        clock.now += REPEAT_WINDOW_S  # the window is [first, first + 5 s)
        send(signal.SIGTERM)
    assert exited.value.code == ABORTED_EXIT_CODE
    assert "rlhflab: second SIGTERM: exiting now" in capsys.readouterr().err


def test_under_a_launcher_another_signal_within_the_window_exits_at_once(before, clock, launcher, capsys):
    with pytest.raises(Exited) as exited, StopSignals():
        send(signal.SIGTERM)
        clock.now += 0.1
        send(signal.SIGINT)  # a Ctrl-C on top of the notice: a request to quit now
    assert exited.value.code == ABORTED_EXIT_CODE
    assert "rlhflab: second SIGINT: exiting now" in capsys.readouterr().err


def test_same_notice_needs_the_same_signal_a_launcher_and_the_window(clock, monkeypatch):
    stop = StopSignals()
    assert not stop._same_notice(signal.SIGTERM)  # nothing requested yet
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    stop.requested, stop._first_at = signal.SIGTERM, 100.0
    clock.now = 100.0 + REPEAT_WINDOW_S - 0.25
    assert stop._same_notice(signal.SIGTERM)
    assert not stop._same_notice(signal.SIGINT)
    clock.now = 100.0 + REPEAT_WINDOW_S
    assert not stop._same_notice(signal.SIGTERM)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    clock.now = 100.0
    assert not stop._same_notice(signal.SIGTERM)


def test_launched_reads_torchelastic_run_id(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert signals.launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert signals.launched() is True
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "")  # set but empty: torchrun still started it
    assert signals.launched() is True


def test_under_a_launcher_after_the_stop_the_late_copy_is_dropped_until_the_window_ends(before, clock, launcher):
    with StopSignals() as stop:
        send(signal.SIGTERM)  # at 100
    assert signal.getsignal(signal.SIGTERM) == stop._late_copy and signal.getsignal(signal.SIGINT) is before
    assert stop._previous == {signal.SIGTERM: before}
    clock.now = 100.0 + REPEAT_WINDOW_S - 1e-6
    send(signal.SIGTERM)  # the launcher's copy: dropped, and the next one still watched
    assert before.caught == [] and signal.getsignal(signal.SIGTERM) == stop._late_copy
    send(signal.SIGINT)  # not the signal that stopped the run: the handler from before
    assert before.caught == [signal.SIGINT]
    clock.now = 100.0 + REPEAT_WINDOW_S
    send(signal.SIGTERM)  # the window is over: the handler from before is back and gets this one
    assert before.caught == [signal.SIGINT, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before and stop._previous == {}
    send(signal.SIGTERM)
    assert before.caught == [signal.SIGINT, signal.SIGTERM, signal.SIGTERM]


def test_under_a_launcher_a_stop_leaving_after_the_window_gives_the_handlers_back_at_once(before, clock, launcher):
    with StopSignals() as stop:
        send(signal.SIGINT)
        clock.now += REPEAT_WINDOW_S  # a long step: the notice's copy, if any, came and went
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is before
    assert stop._previous == {}


def test_under_a_launcher_a_stop_that_leaves_with_an_error_keeps_its_own_signal_s_window(before, clock, launcher):
    with pytest.raises(RuntimeError), StopSignals() as stop:
        send(signal.SIGINT)  # at 100
        clock.now += 1.0
        raise RuntimeError("the checkpoint failed")
    assert signal.getsignal(signal.SIGINT) == stop._late_copy and signal.getsignal(signal.SIGTERM) is before
    send(signal.SIGTERM)  # not the stop's signal, not late: the handler from before
    assert before.caught == [signal.SIGTERM]
    clock.now = 100.0 + REPEAT_WINDOW_S
    send(signal.SIGINT)
    assert before.caught == [signal.SIGTERM, signal.SIGINT] and signal.getsignal(signal.SIGINT) is before


def test_under_a_launcher_an_error_drops_sigterm_for_the_window_from_when_it_left(before, clock, launcher):
    with pytest.raises(RuntimeError), StopSignals() as stop:
        clock.now = 150.0  # the error leaves at 150: the window starts there, not at the enter
        raise RuntimeError("Connection reset by peer")
    assert stop.requested is None and stop._first_at == 150.0
    assert signal.getsignal(signal.SIGTERM) == stop._late_copy and signal.getsignal(signal.SIGINT) is before
    clock.now = 150.0 + REPEAT_WINDOW_S - 1e-6
    send(signal.SIGTERM)
    assert before.caught == [] and signal.getsignal(signal.SIGTERM) == stop._late_copy
    clock.now = 150.0 + REPEAT_WINDOW_S
    send(signal.SIGTERM)
    assert before.caught == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_no_handler_is_installed(before, clock):
    seen = {}

    def run():
        with StopSignals() as stop:
            seen["inside"] = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        seen["stop"] = stop

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=5)
    assert seen["inside"] == (before, before)
    assert seen["stop"].requested is None and seen["stop"]._previous == {}
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is before


# moved from test_signals.py (whose other tests start the CLI): the same rules on the real clock


def test_under_torchrun_the_same_signal_twice_within_seconds_is_one_notice(monkeypatch):
    """A scheduler that signals every process of a job (Slurm) reaches each rank twice: directly and through
    torchrun, which forwards it. That second SIGTERM must not be taken as 'quit at once' (exit 4, no checkpoint)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # without the rule: os._exit(4) here
        time.sleep(0.01)
    assert stop.requested == signal.SIGTERM
    assert not stop._same_notice(signal.SIGINT)  # another signal is a second request
    stop._first_at -= REPEAT_WINDOW_S
    assert not stop._same_notice(signal.SIGTERM)  # so is the same one, later
    stop._first_at += REPEAT_WINDOW_S
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not stop._same_notice(signal.SIGTERM)  # and any repeat in a process no launcher started


def test_under_torchrun_the_launcher_s_late_copy_after_the_stop_is_dropped_and_a_later_signal_acts_again(monkeypatch):
    """The ranks may finish the step and leave the loop before torchrun's forwarded copy arrives: it must not
    kill a rank that is closing after its checkpoint (exit -15 instead of 143)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    caught = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # the late copy: dropped
        time.sleep(0.01)
        assert caught == []
        stop._first_at -= REPEAT_WINDOW_S
        os.kill(os.getpid(), signal.SIGTERM)  # later: the handler from before the run gets it
        time.sleep(0.01)
        assert caught == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) != stop._late_copy
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_under_torchrun_a_rank_leaving_with_an_error_outlives_the_launcher_s_sigterm_to_say_why(monkeypatch):
    """A rank whose collective failed because another rank died leaves the loop with the error while torchrun, which
    saw that rank die, SIGTERMs the ranks left. That SIGTERM must not kill this rank before the CLI prints which rank
    ended and how to resume (seen once in 6 launches on a loaded machine: exit -15 and no line). Without a launcher,
    or leaving without an error, the handlers from before come back at once."""

    def send(signum):
        os.kill(os.getpid(), signum)
        time.sleep(0.01)

    caught = []
    before = lambda signum, frame: caught.append(signum)  # noqa: E731
    previous = {s: signal.signal(s, before) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        with pytest.raises(RuntimeError), StopSignals() as stop:
            raise RuntimeError("Connection reset by peer")
        send(signal.SIGTERM)  # the launcher's, on its way as the error leaves: dropped
        assert caught == [] and stop.requested is None
        send(signal.SIGINT)  # only the launcher's SIGTERM: a Ctrl-C acts as before
        assert caught == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is before
        stop._first_at -= REPEAT_WINDOW_S
        send(signal.SIGTERM)  # later: the handler from before gets it, and stays
        assert caught == [signal.SIGINT, signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is before

        with StopSignals():  # under the launcher, leaving without an error: restored at once
            pass
        assert signal.getsignal(signal.SIGTERM) is before
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        with pytest.raises(RuntimeError), StopSignals():  # no launcher: restored at once
            raise RuntimeError("Connection reset by peer")
        assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
