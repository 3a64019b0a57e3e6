"""SIGTERM / SIGINT on a real `rlhflab sft` process: checkpoint + distinct exit code; a second SIGINT quits at once."""

import signal

from runcheck import assert_same_weights, kill_after, metrics, sft_args, start_cli, train, wait_for

from rlhflab.checkpoint import ABORTED_EXIT_CODE, MARKER, complete_checkpoints


def test_sigterm_finishes_the_step_checkpoints_and_exits_143_then_resume_is_exact(tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    proc = start_cli(*sft_args(out), "--save_every", "4")
    code, err = kill_after(out / "checkpoints" / "step-4" / MARKER, proc, signal.SIGTERM)
    assert code == 143, err
    assert "interrupted: SIGTERM after step" in err and "--resume latest" in err
    latest = complete_checkpoints(out / "checkpoints")[-1]
    stopped_at = int(latest.name.split("-")[1])
    assert 4 <= stopped_at < 16 and f"after step {stopped_at}:" in err  # the signal's own checkpoint
    assert not (out / "model").exists()
    train([*sft_args(out), "--save_every", "4", "--resume", "latest"])
    train([*sft_args(reference), "--save_every", "4"])
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)


def test_a_second_sigint_exits_at_once_and_leaves_the_last_checkpoint_alone(tmp_path):
    out = tmp_path / "run"
    slow = ["--batch_size", "64", "--sft_examples", "256", "--max_steps", "40", "--keep_last_n", "0"]
    proc = start_cli(*sft_args(out), *slow)
    wait_for(out / "checkpoints" / "step-3" / MARKER, proc)
    before = {p.name: (p / MARKER).read_bytes() for p in complete_checkpoints(out / "checkpoints")}
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:  # the first handler has run once it says so
        if "send it again to quit at once" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ABORTED_EXIT_CODE, err
    assert "second SIGINT: exiting now" in err
    after = {p.name: (p / MARKER).read_bytes() for p in complete_checkpoints(out / "checkpoints")}
    assert after.items() >= before.items()  # every checkpoint complete before is still there, unchanged
    assert not (out / "model").exists()


def test_under_torchrun_the_same_signal_twice_within_seconds_is_one_notice(monkeypatch):
    """A scheduler that signals every process of a job (Slurm) reaches each rank twice: directly and through
    torchrun, which forwards it. That second SIGTERM must not be taken as 'quit at once' (exit 4, no checkpoint)."""
    import os
    import time

    from rlhflab.checkpoint.signals import REPEAT_WINDOW_S, StopSignals

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
    import os
    import time

    from rlhflab.checkpoint.signals import REPEAT_WINDOW_S, StopSignals

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
    import os
    import time

    import pytest

    from rlhflab.checkpoint.signals import REPEAT_WINDOW_S, StopSignals

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
