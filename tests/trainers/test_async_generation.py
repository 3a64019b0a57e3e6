"""--async_generation: rollouts sampled in a second process with weights at most k updates old. k = 0 is the
synchronous run bit for bit; k = 1 trains on rollouts exactly one update stale after the first, corrected by the
importance weights; a generator that dies ends the run with a clear message; a resume takes back the rollouts in
flight from the checkpoint and ends with the uninterrupted run's weights, after a SIGKILL too; at k = 1 a run learns
on the suite beyond noise."""

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab.config import GRPOConfig, PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.intervals import rate_interval
from rlhflab.trainers import grpo, ppo
from rlhflab.trainers.online.async_rollouts import check_async

# one thread each side: the same arithmetic in both processes (what k = 0's bitwise equality needs)
SMALL = dict(batch_size=16, total_episodes=64, response_length=8, eval_every=0, eval_prompts=8, progress=False,
             write_report=False, threads=1, save_every=-1, learning_rate=1e-3, warmup_steps=0)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def varied(prompts, responses, rows):
    """Scores that differ within a group, so every update moves the policy (the random model never ends: the
    missing-EOS penalty alone would give every answer the same score and GRPO nothing to learn)."""
    return [len(set(r)) / 10 for r in responses]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def updates(run_dir):
    return [r for r in rows(run_dir) if "time/training" in r]


def weights(run_dir):
    return load_file(str(run_dir / "model" / "model.safetensors"))


def all_weights(run_dir):
    """Every tensor the run saved (policy, adapters, value head or adapter), by file and name."""
    return {(p.relative_to(run_dir).as_posix(), k): t for p in sorted(run_dir.glob("*/*.safetensors"))
            for k, t in load_file(str(p)).items()}


@pytest.mark.parametrize(("stage", "cls", "extra"), [
    (grpo, GRPOConfig, {"num_generations": 4}),
    (ppo, PPOConfig, {}),
    (grpo, GRPOConfig, {"num_generations": 4, "lora_r": 4, "lora_merge_generation": True}),  # merged in the copy
    (ppo, PPOConfig, {"lora_r": 4, "value_mode": "lora_adapter"}),  # the copy samples with the policy adapter
], ids=["grpo", "ppo", "grpo-lora-merged", "ppo-lora-value-adapter"])
def test_k0_is_the_synchronous_run_bit_for_bit(policy_dir, tmp_path, stage, cls, extra):
    sync = stage.train(cls(model=policy_dir, output_dir=str(tmp_path / "sync"), **SMALL, **extra))
    asynchronous = stage.train(cls(model=policy_dir, output_dir=str(tmp_path / "async"), async_generation=True,
                                   max_staleness=0, **SMALL, **extra))
    assert [u["async/staleness"] for u in updates(asynchronous.run_dir)] == [0, 0, 0, 0]
    a, b = all_weights(sync.run_dir), all_weights(asynchronous.run_dir)
    assert a.keys() == b.keys() and len(a) > 2
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [u["objective/scores"] for u in updates(sync.run_dir)] == [u["objective/scores"]
                                                                      for u in updates(asynchronous.run_dir)]


def test_k1_trains_on_rollouts_one_update_stale_with_importance_weights(policy_dir, tmp_path):
    result = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                                   max_staleness=1, num_generations=4, **SMALL), reward_fn=varied)
    seen = updates(result.run_dir)
    assert [u["async/staleness"] for u in seen] == [0, 1, 1, 1]  # rollouts 1 and 2 both from the start weights
    stale = seen[1:]
    # a stale sampler: the trainer's probabilities differ from the sampler's, the weights show it (not all 1)
    assert all(u["sampler/logprob_diff_mean"] > 1e-3 and u["sampler/is_weight_min"] < 1.0 < u["sampler/is_weight_max"]
               for u in stale), stale
    assert all(0 < u["sampler/is_weight_mean"] < 3 for u in stale)
    assert "sampler/is_weight_mean" not in seen[0]  # staleness 0: nothing to correct, as in the synchronous loop
    sync = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "sync"), num_generations=4, **SMALL),
                      reward_fn=varied)
    assert updates(sync.run_dir)[0]["objective/scores"] == seen[0]["objective/scores"]  # same prompts and noise


def test_a_generator_that_dies_ends_the_run_with_its_exit_code(policy_dir, tmp_path):
    def kill_the_generator(prompts, responses, rows):
        for child in multiprocessing.active_children():
            if child.name == "rlhflab-generator":
                os.kill(child.pid, signal.SIGKILL)
        return [0.0] * len(prompts)

    with pytest.raises(RuntimeError, match=r"generator process ended \(exit code -9\) before rollout 2"):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                              max_staleness=0, num_generations=4, **SMALL), reward_fn=kill_the_generator)
    assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-generator"]


def test_a_resume_takes_back_the_rollouts_in_flight_and_ends_with_the_uninterrupted_weights(policy_dir, tmp_path):
    import shutil

    from rlhflab.checkpoint import load_checkpoint

    settings = dict(SMALL, save_every=2, num_generations=4, async_generation=True)
    whole = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "whole"), **settings), reward_fn=varied)
    _, kept, state = load_checkpoint(whole.run_dir / "checkpoints" / "step-2")
    # rollouts 3 and 4, asked after updates 1 and 2 and sampled with their weights, not trained at the checkpoint
    in_flight = state["progress"]["in_flight"]
    assert [(u, len(ids), version) for u, ids, version in in_flight] == [(3, 16, 1), (4, 16, 2)]
    assert state["in_flight_rollouts"]["in_flight.4.response_ids"].shape[0] == 16 and not any(
        name.startswith("in_flight") for name in kept)  # beside the optimiser state, not among the weights
    shutil.copytree(whole.run_dir, tmp_path / "cut")  # the same run, stopped at its step-2 checkpoint
    resumed = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "cut"),
                                    resume=str(tmp_path / "cut" / "checkpoints" / "step-2"), **settings),
                         reward_fn=varied)
    assert [u["async/staleness"] for u in updates(resumed.run_dir)] == [0, 1, 1, 1]
    assert [u["objective/scores"] for u in updates(resumed.run_dir)] == [u["objective/scores"]
                                                                         for u in updates(whole.run_dir)]
    a, b = weights(whole.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_what_async_generation_does_not_do_is_refused(policy_dir, tmp_path):
    with pytest.raises(UserInputError, match="max_staleness must be >= 0"):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "a"), async_generation=True,
                              max_staleness=-1, num_generations=4, **SMALL))
    with pytest.raises(UserInputError, match="runs under ddp, not fsdp2"):
        check_async(GRPOConfig(model=policy_dir, async_generation=True), "fsdp2")


def test_ctrl_c_reaching_the_generator_too_still_checkpoints_and_the_run_resumes(policy_dir, tmp_path):
    """Ctrl-C signals the whole process group: the generator ignores it, the trainer finishes the update, writes a
    checkpoint holding the rollouts in flight (read from the live generator) and stops it."""
    from rlhflab.checkpoint import Interrupted

    calls = []

    def interrupt_at_the_second_update(prompts, responses, rows):
        calls.append(1)
        if len(calls) == 2:
            for child in multiprocessing.active_children():
                if child.name == "rlhflab-generator":
                    os.kill(child.pid, signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return varied(prompts, responses, rows)

    settings = dict(SMALL, num_generations=4, async_generation=True, save_every=10)
    with pytest.raises(Interrupted):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), **settings),
                   reward_fn=interrupt_at_the_second_update)
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
    assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-generator"]
    resumed = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), resume="latest", **settings),
                         reward_fn=varied)
    assert [u["step"] for u in updates(resumed.run_dir)] == [1, 2, 3, 4]


def test_a_trainer_that_fails_stops_its_generator(policy_dir, tmp_path):
    def failing(prompts, responses, rows):
        raise ValueError("the reward broke")

    with pytest.raises(ValueError, match="the reward broke"):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                              num_generations=4, **SMALL), reward_fn=failing)
    assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-generator"]


MOSTLY_DIGITS = """def mostly_digits(prompts, completions, **columns):
    return [sum(c.isdigit() for c in t) * 2 > max(len(t), 1) for t in completions]
"""


def digit_share(prompts, responses, rows):
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def test_k1_learns_on_the_suite_beyond_noise(policy_dir, tmp_path):
    """GRPO at staleness 1 on the suite's prompts, rewarded by the share of digits: the held-out pass rate of a
    verifier (more than half the characters digits) rises from near 0 to a rate whose 95 % interval lies above
    the start's, and every rollout trained on was at most one update old."""
    (tmp_path / "verify.py").write_text(MOSTLY_DIGITS)
    settings = {**SMALL, "total_episodes": 16 * 20, "eval_prompts": 24, "response_length": 6, "learning_rate": 2e-2,
                "beta": 0.0, "missing_eos_penalty": 0.0}
    result = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                                   max_staleness=1, num_generations=4, verifier=f"{tmp_path / 'verify.py'}:mostly_digits",
                                   **settings), reward_fn=digit_share)
    held_out = result.summary["validation_pass_rate"]
    start, end = rate_interval(held_out["start"], 24), rate_interval(held_out["end"], 24)
    assert end.low > start.high, (held_out, start, end)
    assert max(u["async/staleness"] for u in updates(result.run_dir)) == 1


VARIED = "def varied(prompts, completions, **columns):\n    return [len(set(c)) / 10 for c in completions]\n"


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_weights_bit_for_bit(policy_dir, tmp_path):
    """The CLI run killed (SIGKILL to the trainer) right after its step-2 checkpoint, while the generator samples
    ahead: the generator ends by itself, and `--resume latest` trains on the rollouts the checkpoint kept in flight,
    ending bit for bit where the uninterrupted run ends (the in-flight rollouts are the checkpoint's, and every
    later one is sampled from the weights of a fixed update with that update's own seed: nothing depends on timing)."""
    from runcheck import assert_same_weights, start_cli, wait_for

    from rlhflab.checkpoint import MARKER
    from rlhflab.config import STAGES, parse_config

    (tmp_path / "varied.py").write_text(VARIED)
    args = ["grpo", "--model", policy_dir, "--reward_fn", f"{tmp_path / 'varied.py'}:varied", "--num_generations", "4",
            "--async_generation", "true", "--max_staleness", "1", "--batch_size", "16", "--total_episodes", "96",
            "--response_length", "8", "--eval_every", "0", "--eval_prompts", "8", "--progress", "false",
            "--threads", "1", "--save_every", "2", "--learning_rate", "1e-3", "--warmup_steps", "0",
            "--headroom_samples", "0"]
    whole = grpo.train(parse_config(STAGES["grpo"], [*args[1:], "--output_dir", str(tmp_path / "whole")], prog="grpo"))
    cut = tmp_path / "cut"
    proc = start_cli(*args, "--output_dir", str(cut))
    wait_for(cut / "checkpoints" / "step-2" / MARKER, proc)
    generator = [pid for pid in children_of(proc.pid)  # (the other child is multiprocessing's resource tracker)
                 if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(generator) == 1 and not (cut / "summary.json").exists()
    deadline = time.time() + 10  # the orphaned generator notices within a second (POLL_S) and ends
    while running(generator[0]):
        assert time.time() < deadline, "the generator outlived its trainer"
        time.sleep(0.1)
    resumed = start_cli(*args, "--output_dir", str(cut), "--resume", "latest")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert_same_weights(whole.run_dir, cut)
    assert [u["async/staleness"] for u in updates(cut)] == [0, 1, 1, 1, 1, 1]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (ended, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
