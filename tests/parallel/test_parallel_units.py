"""rlhflab.parallel in one process: the global-batch split, the batch-size rule, reductions as no-ops, the
strategy choice, the resume layout check, the follower's run folder. (Two processes: test_two_processes.py.)"""

import logging
import os

import pytest
import torch
import torch.distributed as dist

from rlhflab import parallel
from rlhflab.checkpoint.ranks import FollowerRun, check_layout
from rlhflab.errors import UserInputError


def world(rank: int, size: int) -> parallel.World:
    return parallel.World(rank=rank, world_size=size, local_world_size=size)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [0, 1, 5, 7, 8])
def test_shares_cover_the_global_batch_once_in_order_with_equal_row_counts(size, total):
    shares = [parallel.share_of(total, world(r, size)) for r in range(size)]
    real = [p for s in shares for p in s.positions[: s.real]]
    assert real == list(range(total))  # by position: rank 0 first, each once
    assert len({len(s.positions) for s in shares}) == 1  # every rank runs the same number of rows
    assert all(p == 0 for s in shares for p in s.positions[s.real:])  # padding repeats row 0
    assert sum(s.weight for s in shares) == pytest.approx(1.0 if total else 0.0)


def test_a_partial_batch_gives_the_last_rank_padding_only():
    last = parallel.share_of(1, world(1, 2))
    assert (last.positions, last.real, last.weight) == ([0], 0, 0.0)
    first = parallel.share_of(7, world(0, 2))
    assert (first.positions, first.real, first.weight) == ([0, 1, 2, 3], 4, 4 / 7)


def test_a_global_batch_that_does_not_divide_is_refused_with_the_fix():
    assert parallel.local_batch_size(8, world(1, 2)) == 4
    with pytest.raises(UserInputError) as err:
        parallel.local_batch_size(7, world(0, 2), "batch_size")
    assert "--batch_size: batch_size 7 does not divide over 2 processes" in str(err.value)
    assert "--batch_size 6 or 8" in str(err.value)


def test_in_one_process_every_collective_returns_its_input():
    one = parallel.SINGLE
    t = torch.tensor([1.0, 2.0])
    assert parallel.all_sum(t, one) is t and parallel.gather_rows(t, one) is t and parallel.all_mean(t, one) is t
    assert parallel.total(7, one) == 7 and parallel.gather_objects("x", one) == ["x"]
    assert parallel.mean_metrics({"a": 2.0}, one, weight=5) == {"a": 2.0}
    assert one.from_main(lambda: 3) == 3 and one.broadcast("y") == "y" and one.any(True) and not one.any(False)
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    mean, std = parallel.masked_mean_std(values, mask, one)
    assert (mean.item(), std.item()) == pytest.approx((2.5, torch.tensor([1.0, 2, 3, 4]).std().item()))


def test_the_strategy_follows_the_request_then_the_accelerate_config_then_ddp(monkeypatch):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    assert parallel.resolve_strategy("fsdp2", parallel.SINGLE) == "none"  # one process: nothing to wrap
    assert parallel.resolve_strategy("auto", world(0, 2)) == "ddp"
    assert parallel.resolve_strategy("fsdp2", world(0, 2)) == "fsdp2"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert parallel.resolve_strategy("auto", world(0, 2)) == "fsdp2"
    with pytest.raises(UserInputError, match="unknown parallel_strategy 'zero'"):
        parallel.resolve_strategy("zero", world(0, 2))


def test_one_process_wraps_nothing_and_runs_the_forward_it_is_given():
    model = torch.nn.Linear(2, 1)
    wrapped = parallel.wrap_model(model, parallel.SINGLE, "fsdp2")
    assert wrapped.strategy == "none" and wrapped.model is model and not wrapped.layout.sharded
    assert wrapped(lambda m, x: m(x).sum() * 0 + 5.0, torch.ones(1, 2)).item() == 5.0
    with wrapped.gathered() as plain:
        assert plain is model


def test_the_test_hook_raises_on_its_rank_after_its_step_only(monkeypatch):
    monkeypatch.setenv("RLHFLAB_FAIL_AT", "1:3")
    parallel.fail_if_asked(world(0, 2), 3)
    parallel.fail_if_asked(world(1, 2), 2)
    with pytest.raises(RuntimeError, match="deliberate failure on rank 1 after step 3"):
        parallel.fail_if_asked(world(1, 2), 3)


def test_a_sharded_checkpoint_resumes_only_in_its_own_layout_a_whole_one_anywhere(caplog):
    two_fsdp2 = {"strategy": "fsdp2", "world_size": 2, "sharded_state": True}
    with pytest.raises(UserInputError) as err:
        check_layout(two_fsdp2, parallel.Layout("ddp", world(0, 2)), "--resume latest")
    assert "written by 2 process(es) with parallel_strategy fsdp2; this run has 2 with ddp" in str(err.value)
    assert "--parallel_strategy fsdp2" in str(err.value)
    check_layout(two_fsdp2, parallel.Layout("fsdp2", world(1, 2)), "--resume latest")
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        check_layout({"strategy": "ddp", "world_size": 2, "sharded_state": False},
                     parallel.Layout("none", parallel.SINGLE), "--resume latest")
        check_layout(None, parallel.Layout("ddp", world(0, 4)), "--resume latest")  # written before issue 15
    assert "resuming a checkpoint of 2 process(es) with 1" in caplog.text
    assert "resuming a checkpoint of 1 process(es) with 4" in caplog.text


def test_a_follower_run_writes_nothing(tmp_path):
    run = FollowerRun(tmp_path / "run")
    run.log({"loss": 1.0}, step=1)
    run.add_samples([{"answer": "x"}])
    run.write_versions(0)
    assert run.update_summary(stage="sft") == {"stage": "sft"}
    run.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("finished", [True, False])
def test_leaving_the_group_waits_for_the_peers_only_after_a_finished_run(monkeypatch, tmp_path, finished):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1) or real_barrier(*a, **k))
    parallel.shutdown_world(finished=finished)
    assert not dist.is_initialized()
    assert barriers == ([1] if finished else [])  # after an error a peer may wait in another collective: no barrier
    parallel.shutdown_world()  # nothing joined: nothing to do


def test_a_peer_that_died_is_named_with_its_signal_and_a_reaped_one_as_ended(monkeypatch):
    """parallel/peers.py reads a dead peer's exit status from /proc (a zombie the launcher has not reaped yet)."""
    import signal
    import socket
    import subprocess
    import time

    from rlhflab.parallel import peers

    if not os.path.exists("/proc/self/stat"):
        pytest.skip("reads /proc (Linux)")
    killed, failed, running = (subprocess.Popen(cmd) for cmd in (["sleep", "60"], ["sh", "-c", "exit 3"],
                                                                    ["sleep", "60"]))
    killed.send_signal(signal.SIGKILL)
    host = socket.gethostname()
    monkeypatch.setattr(peers, "_PEERS", [(host, os.getpid()), (host, killed.pid), (host, failed.pid),
                                          (host, running.pid), ("elsewhere", 1)])
    try:
        while peers.exit_status(killed.pid) is None or peers.exit_status(failed.pid) is None:
            time.sleep(0.01)  # both end, and stay zombies: nobody reaps them yet
        said = peers.ended_peers(0, 5)
        assert "rank 1 of 5 (pid %d on this host) was killed by SIGKILL" % killed.pid in said
        assert "rank 2 of 5 (pid %d on this host) exited with code 3" % failed.pid in said
        assert "rank 3" not in said  # still running
        assert peers.exit_status(running.pid) is None
    finally:
        for proc in (killed, failed, running):
            proc.kill()
            proc.wait()
    assert peers.exit_status(killed.pid).startswith("ended (the launcher already collected")  # reaped: gone
    monkeypatch.setattr(peers, "_PEERS", [(host, os.getpid()), ("elsewhere", 1)])
    assert "a rank on another host (elsewhere) ended or became unreachable" in peers.ended_peers(0, 2)


def test_transport_errors_are_told_from_other_errors_through_the_chain_and_a_checkpoint_s_failures():
    from torch.distributed.checkpoint.api import CheckpointException

    from rlhflab.parallel.peers import is_transport_error

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40683: "
                        "Connection reset by peer")
    assert is_transport_error(gloo) and is_transport_error(dist.DistBackendError("anything"))
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("while saving") from err
    except ValueError as err:
        assert is_transport_error(err)
    assert is_transport_error(CheckpointException("save failed", {0: (gloo, [])}))
    assert not is_transport_error(RuntimeError("CUDA out of memory")) and not is_transport_error(
        ConnectionResetError("Connection reset by peer"))  # e.g. a reward function's HTTP call: not a collective
