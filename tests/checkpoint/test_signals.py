"""SIGTERM / SIGINT on a real `rlhflab sft` process: checkpoint + distinct exit code; a second SIGINT quits at once.

StopSignals' rules in-process (the repeat window under torchrun among them): test_signals_units.py."""

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
