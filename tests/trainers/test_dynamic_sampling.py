"""--dynamic_sampling (DAPO): all-equal groups dropped, the batch refilled from the next prompts in order, padded
with the earliest dropped groups at the cap; the trained batch's advantages by hand; a GRPO run with it trains,
counts what it generated, and is refused where the advantages are not group-relative."""

import json

import pytest
import torch
from tinyhf import save_suite_model

from rlhflab.config import GRPOConfig, PPOConfig, REINFORCEConfig
from rlhflab.errors import UserInputError
from rlhflab.rollout.rollout import Rollout
from rlhflab.trainers import grpo, ppo, reinforce
from rlhflab.trainers.online.dynamic import Round, informative_groups, refill
from rlhflab.trainers.online.loop import scored_batch

PAD = 0


def fake_round(scores: list[float], first_id: int, prompt_width: int, response_width: int) -> Round:
    """A scored round of len(scores) answers: answer b's prompt ids are first_id + b (left-padded with PAD to
    `prompt_width`, 2 real tokens), its response 1 + b % response_width real tokens of value 100 + first_id + b."""
    b = len(scores)
    lengths = torch.tensor([1 + i % response_width for i in range(b)])
    response_mask = torch.arange(response_width).unsqueeze(0) < lengths.unsqueeze(1)
    query_mask = (torch.arange(prompt_width) >= prompt_width - 2).expand(b, prompt_width)
    ids = torch.arange(first_id, first_id + b).unsqueeze(1)
    rollout = Rollout(
        query_ids=torch.where(query_mask, ids, PAD), query_mask=query_mask,
        response_ids=torch.where(response_mask, 100 + ids, PAD), response_mask=response_mask,
        logprobs=torch.where(response_mask, -1.0, 0.0), ref_logprobs=torch.where(response_mask, -1.0, 0.0),
        values=torch.zeros(b, response_width), entropy=torch.where(response_mask, 2.0, 0.0),
        ended_with_eos=torch.ones(b, dtype=torch.bool), seconds={"generation": 1.0, "forward": 0.5})
    return Round(list(range(first_id, first_id + b)), rollout, torch.tensor(scores), torch.ones(b, dtype=torch.bool),
                 0.25)


# four groups of 2: one pass and one fail (informative), all pass, all fail, one fail and one pass
ROUND_0 = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
ROUND_1 = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # the next prompts: all pass, informative x 2, all fail


def test_informative_groups_need_two_valid_answers_that_differ():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.3, 0.9])
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    assert informative_groups(scores, valid, 2).tolist() == [True, False, False, True]  # group 3: one valid answer


def test_two_dull_groups_are_dropped_and_refilled_from_the_next_prompts_in_order():
    first, second = fake_round(ROUND_0, 0, 3, 2), fake_round(ROUND_1, 8, 4, 3)  # the refill is wider
    asked = []

    def sample_round(r):
        asked.append(r)
        return second

    batch, metrics = refill(first, sample_round, groups=4, group=2, max_rounds=3, pad_id=PAD)
    assert asked == [1]  # one extra round found the two groups missing
    # round 0's groups 0 and 3, then round 1's groups 1 and 2, in that order
    assert batch.batch_ids == [0, 1, 6, 7, 10, 11, 12, 13]
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    rollout = batch.rollout
    assert rollout.query_ids.shape == (8, 4) and rollout.response_ids.shape == (8, 3)
    assert rollout.query_ids[0].tolist() == [PAD, PAD, 0, 0] and rollout.query_mask[0].tolist() == [False, False,
                                                                                                  True, True]
    assert rollout.query_ids[4].tolist() == [PAD, PAD, 10, 10]  # round 1's row 2: its own prompt width was 4
    assert rollout.response_mask[0].tolist() == [True, False, False]  # round 0's row 0: 1 token, padded to 3
    assert rollout.response_ids[4].tolist() == [110, 110, 110]  # round 1's row 2: 3 tokens
    assert rollout.response_ids[5].tolist() == [111, PAD, PAD] and rollout.response_mask[5].tolist() == [True, False,
                                                                                                         False]
    assert metrics == {"dynamic/refill_rounds": 1, "dynamic/generated": 16, "dynamic/informative_groups": 4,
                       "dynamic/padded_groups": 0, "dynamic/surplus_groups": 0, "dynamic/dropped_all_pass": 2,
                       "dynamic/dropped_all_fail": 2}
    # the trained batch's GRPO advantages by hand: every group is one pass and one fail, mean 0.5, std (unbiased)
    # sqrt(0.5), so the pass gets +0.5 / sqrt(0.5) = +0.7071 and the fail -0.7071 (on each of its tokens)
    cfg = GRPOConfig(model="unused", num_generations=2, batch_size=8, scale_rewards="group")
    adv = grpo.GRPO(cfg).advantages(scored_batch(rollout, batch.scores, batch.valid, 2))
    expected = torch.tensor([1, -1, -1, 1, -1, 1, 1, -1]) * 0.5 / (0.5 ** 0.5 + 1e-4)
    assert torch.allclose(adv.advantages[:, 0], expected, atol=1e-6)
    assert adv.metrics["frac_reward_zero_std"] == 0.0


def test_at_the_cap_the_batch_is_filled_with_the_earliest_dropped_groups():
    first = fake_round(ROUND_0, 0, 3, 2)
    batch, metrics = refill(first, lambda r: pytest.fail("no refill round at max_rounds 0"), groups=4, group=2,
                            max_rounds=0, pad_id=PAD)
    assert batch.batch_ids == [0, 1, 6, 7, 2, 3, 4, 5]  # informative first, then the dropped all-pass, all-fail
    assert metrics["dynamic/padded_groups"] == 2 and metrics["dynamic/informative_groups"] == 2
    assert metrics["dynamic/generated"] == 8 and metrics["dynamic/refill_rounds"] == 0


def test_a_batch_with_nothing_dropped_is_the_first_round_itself():
    first = fake_round([1.0, 0.0, 0.0, 1.0], 0, 3, 2)
    batch, metrics = refill(first, lambda r: pytest.fail("nothing to refill"), groups=2, group=2, max_rounds=3,
                            pad_id=PAD)
    assert batch.rollout is first.rollout and batch.batch_ids == first.batch_ids
    assert metrics["dynamic/generated"] == 4 and metrics["dynamic/refill_rounds"] == 0


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def coarse(prompts, responses, rows):
    """0 / 1 by a coin the answer's first character throws: many groups come back all-equal."""
    return [float(len(r) > 0 and ord(r[0]) % 2 == 0) for r in responses]


def test_a_grpo_run_with_dynamic_sampling_refills_and_counts_what_it_generated(policy_dir, tmp_path):
    cfg = GRPOConfig(model=policy_dir, output_dir=str(tmp_path / "run"), num_generations=4, batch_size=16,
                     total_episodes=64, response_length=6, eval_every=0, eval_prompts=4, progress=False,
                     write_report=False, threads=1, save_every=-1, dynamic_sampling=True, max_refill_rounds=2,
                     headroom_samples=0)
    result = grpo.train(cfg, reward_fn=coarse)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "dynamic/generated" in r]
    assert len(updates) == 4
    for r in updates:
        assert r["dynamic/generated"] == 16 * (1 + r["dynamic/refill_rounds"]) and r["dynamic/refill_rounds"] <= 2
        assert r["dynamic/informative_groups"] + r["dynamic/padded_groups"] == 4
        dropped = r["dynamic/dropped_all_pass"] + r["dynamic/dropped_all_fail"]
        assert dropped + r["dynamic/informative_groups"] + r["dynamic/surplus_groups"] == r["dynamic/generated"] // 4
    assert any(r["dynamic/refill_rounds"] > 0 for r in updates)  # the coin made dull groups: refills happened
    generated = sum(r["dynamic/generated"] for r in updates)
    assert updates[-1]["episodes_generated"] == generated == result.summary["episodes_generated"] > 64
    assert result.summary["episodes"] == 64  # the budget counts trained answers


@pytest.mark.parametrize(("stage", "cls", "extra", "match"), [
    (ppo, PPOConfig, {}, "ppo's advantages do not compare"),
    (reinforce, REINFORCEConfig, {"num_generations": 2}, "not relative to the prompt's group"),
    (grpo, GRPOConfig, {"num_generations": 4, "async_generation": True}, "not supported"),
])
def test_dynamic_sampling_is_refused_where_it_means_nothing(policy_dir, tmp_path, stage, cls, extra, match):
    with pytest.raises(UserInputError, match=match):
        stage.train(cls(model=policy_dir, output_dir=str(tmp_path / "run"), dynamic_sampling=True, **extra))
