"""--async_generation: rollouts sampled in a second process with weights at most k updates old. k = 0 is the
synchronous run bit for bit; k = 1 trains on rollouts exactly one update stale after the first, corrected by the
importance weights; a generator that dies ends the run with a clear message; a resume asks again for the
rollouts that were in flight."""

import json
import multiprocessing
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab.config import GRPOConfig, PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import grpo, ppo

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


@pytest.mark.parametrize(("stage", "cls", "extra"), [(grpo, GRPOConfig, {"num_generations": 4}), (ppo, PPOConfig, {})])
def test_k0_is_the_synchronous_run_bit_for_bit(policy_dir, tmp_path, stage, cls, extra):
    sync = stage.train(cls(model=policy_dir, output_dir=str(tmp_path / "sync"), **SMALL, **extra))
    asynchronous = stage.train(cls(model=policy_dir, output_dir=str(tmp_path / "async"), async_generation=True,
                                   max_staleness=0, **SMALL, **extra))
    assert [u["async/staleness"] for u in updates(asynchronous.run_dir)] == [0, 0, 0, 0]
    a, b = weights(sync.run_dir), weights(asynchronous.run_dir)
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


def test_a_resume_asks_again_for_the_rollouts_in_flight(policy_dir, tmp_path):
    from rlhflab.checkpoint import load_checkpoint

    settings = dict(SMALL, save_every=2, total_episodes=48)
    first = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                                  num_generations=4, **settings))
    _, _, state = load_checkpoint(first.run_dir / "checkpoints" / "step-2")
    (in_flight,) = state["progress"]["in_flight"]  # rollout 3: asked after update 1, not trained at the checkpoint
    assert in_flight[0] == 3 and len(in_flight[1]) == 16
    assert updates(first.run_dir)[-1]["async/staleness"] == 1
    resumed = grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), async_generation=True,
                                    num_generations=4, resume=str(first.run_dir / "checkpoints" / "step-2"),
                                    **settings))
    seen = updates(resumed.run_dir)
    assert [u["step"] for u in seen] == [1, 2, 3]
    # rollout 3 asked again for the same prompts, now sampled with update 2's weights (the uninterrupted run used
    # update 1's): the promise is the same prompts and noise, not the same weights after a resume
    assert seen[-1]["async/staleness"] == 0


def test_what_async_generation_does_not_do_is_refused(policy_dir, tmp_path):
    with pytest.raises(UserInputError, match="max_staleness must be >= 0"):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "a"), async_generation=True,
                              max_staleness=-1, num_generations=4, **SMALL))
    with pytest.raises(UserInputError, match="lora_merge_generation"):
        grpo.train(GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "b"), async_generation=True, lora_r=4,
                              lora_merge_generation=True, num_generations=4, **SMALL))
