"""Online DPO's algorithm unit (trainers/online_dpo.py) on hand-made batches, no model: which answers make a
pair, the DPO / IPO loss of a pair by hand, a micro-batch's share of the step's pairs and the unit's refusals
(issue 36)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.config import OnlineDPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import online_dpo
from rlhflab.trainers.online.algorithm import ScoredRollout, StepShare

CHOSEN, REJECTED = online_dpo.CHOSEN, online_dpo.REJECTED


def dpo_cfg(**fields) -> OnlineDPOConfig:
    base = {"num_generations": 3, "batch_size": 6, "num_mini_batches": 1, "gradient_accumulation_steps": 1}
    return OnlineDPOConfig(model="unused", **{**base, **fields})


def test_best_and_worst_pick_each_group_s_highest_and_lowest_valid_score_ties_to_the_earliest():
    scores = torch.tensor([0.5, 2.0, -1.0,   1.0, 1.0, 1.0,   3.0, 9.0, 3.0,   0.0, 4.0, 4.0])
    valid = torch.tensor([True, True, True,  True, True, True,  True, False, True,  True, True, True])
    marks = online_dpo.best_and_worst(scores, valid, 3)
    assert marks.tolist() == [0.0, CHOSEN, REJECTED,  # plain
                              0.0, 0.0, 0.0,  # all equal: no pair
                              0.0, 0.0, 0.0,  # the 9.0 was not scored: the valid two are equal
                              REJECTED, CHOSEN, 0.0]  # the tie at 4.0 goes to the earliest


def test_sequence_logps_sum_or_average_the_real_tokens_only():
    logprobs = torch.tensor([[-1.0, -2.0, 50.0], [-3.0, 50.0, 50.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert online_dpo.sequence_logps(logprobs, mask, average=False).tolist() == [-3.0, -3.0]
    assert online_dpo.sequence_logps(logprobs, mask, average=True).tolist() == [-1.5, -3.0]
    empty = torch.zeros(1, 3, dtype=torch.bool)
    assert online_dpo.sequence_logps(torch.ones(1, 3), empty, average=True).tolist() == [0.0]


LENGTHS = [2, 3, 1, 3, 2, 2]
SCORES = [1.0, 0.0, 2.0, 0.5, 0.5, 0.5]  # group 0: row 2 chosen, row 1 rejected; group 1: all equal


def batch(scores=SCORES, ref=None):
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(3).unsqueeze(0) < lengths.unsqueeze(1)
    ref = torch.full((6, 3), -1.0) if ref is None else ref
    rollout = SimpleNamespace(response_mask=mask, ref_logprobs=ref, batch_size=6,
                              ended_with_eos=torch.ones(6, dtype=torch.bool))
    return ScoredRollout(rollout, torch.tensor(scores), torch.ones(6, dtype=torch.bool), mask, torch.zeros(6, 3), 3)


def test_advantages_mark_the_pair_on_every_real_token_and_log_its_scores():
    adv = online_dpo.OnlineDPO(dpo_cfg()).advantages(batch())
    assert adv.advantages[2].tolist() == [CHOSEN, 0.0, 0.0] and adv.advantages[1].tolist() == [REJECTED] * 3
    assert adv.advantages[[0, 3, 4, 5]].abs().sum() == 0 and adv.returns is None
    assert adv.metrics["pairs"] == 1 and adv.metrics["frac_reward_zero_std"] == 0.5
    assert adv.metrics["reward"] == pytest.approx(sum(SCORES) / 6)
    assert adv.metrics["score/chosen"] == 2.0 and adv.metrics["score/rejected"] == 0.0
    none = online_dpo.OnlineDPO(dpo_cfg()).advantages(batch(scores=[1.0] * 6))
    assert none.metrics["pairs"] == 0 and none.metrics["frac_reward_zero_std"] == 1.0
    assert math.isnan(none.metrics["score/chosen"]) and math.isnan(none.metrics["score/rejected"])


def step(unit, logprobs, data, idx, share_index):
    adv = unit.advantages(data)
    share = StepShare(tokens=1.0, rows=len(share_index), rollout_tokens=1.0, response_length=3, steps=1,
                      index=share_index)
    logprobs = logprobs.clone().requires_grad_(True)
    loss, stats = unit.loss(logprobs[idx], None, data, adv, idx, share)  # the micro-batch's rows
    loss.backward()
    return loss, stats, logprobs.grad


LOGPROBS = torch.tensor([[-0.5, -0.5, 0.0], [-1.0, -2.0, -0.5], [-0.2, 9.0, 9.0],
                         [-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])


def test_the_dpo_loss_of_the_pair_by_hand_with_label_smoothing():
    unit = online_dpo.OnlineDPO(dpo_cfg(beta=0.5, label_smoothing=0.1))
    loss, stats, grad = step(unit, LOGPROBS, batch(), torch.arange(6), torch.arange(6))
    # chosen row 2: log pi = -0.2 (1 token), ref -1.0; rejected row 1: -3.5 (3 tokens), ref -3.0
    h = 0.5 * ((-0.2 + 1.0) - (-3.5 + 3.0))
    expected = -0.9 * math.log(1 / (1 + math.exp(-h))) - 0.1 * math.log(1 / (1 + math.exp(h)))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["logps_chosen"].item() == pytest.approx(-0.2) and stats["logps_rejected"].item() == pytest.approx(-3.5)
    assert stats["loss"].item() == loss.item() and unit.step_names["loss"] == "loss"
    assert stats["chosen_rewards"].item() == pytest.approx(0.4) and stats["rejected_rewards"].item() == pytest.approx(-0.25)
    assert grad[[0, 3, 4, 5]].abs().sum() == 0 and grad[2, 1:].abs().sum() == 0  # unpaired rows, padding
    assert grad[2, 0] < 0 < grad[1, 0] and grad[1, 0] == grad[1, 2]  # chosen up, rejected down, every token alike


def test_the_ipo_loss_of_the_pair_by_hand_on_length_averaged_log_probs():
    unit = online_dpo.OnlineDPO(dpo_cfg(beta=0.5, loss_type="ipo"))
    loss, _, _ = step(unit, LOGPROBS, batch(), torch.arange(6), torch.arange(6))
    h = (-0.2 + 1.0) - (-3.5 / 3 + 1.0)  # averaged over 1 and 3 tokens (ref: -1 a token)
    assert loss.item() == pytest.approx((h - 1.0) ** 2, abs=1e-6)  # 1 / (2 beta) = 1


def test_a_micro_batch_weighs_its_pairs_by_the_step_s_pairs_and_one_without_a_pair_gives_zero():
    scores = [1.0, 0.0, 2.0, 0.0, 3.0, 1.0]  # two pairs: rows (2, 1) and (4, 3)
    unit = online_dpo.OnlineDPO(dpo_cfg(beta=0.5))
    whole, _, _ = step(unit, LOGPROBS, batch(scores), torch.arange(6), torch.arange(6))
    first, _, _ = step(unit, LOGPROBS, batch(scores), torch.arange(3), torch.arange(6))
    second, _, _ = step(unit, LOGPROBS, batch(scores), torch.arange(3, 6), torch.arange(6))
    assert (first + second).item() == pytest.approx(whole.item(), abs=1e-6)  # each half of the mean
    alone, _, _ = step(unit, LOGPROBS, batch(scores), torch.arange(3), torch.arange(3))
    assert alone.item() == pytest.approx(2 * first.item(), abs=1e-6)
    loss, stats, grad = step(unit, LOGPROBS, batch([1.0] * 6), torch.arange(6), torch.arange(6))
    assert loss.item() == 0.0 and stats == {} and grad.abs().sum() == 0


WHOLE_GROUPS = ("--num_mini_batches / --gradient_accumulation_steps", "choose them so batch_size / num_mini_batches / "
                "gradient_accumulation_steps is a multiple of num_generations")


@pytest.mark.parametrize("fields, what, where, fix", [
    ({"sampler_correction": "token_truncate"}, "online DPO's pairwise loss has no per-token policy-gradient term for "
     "--sampler_correction token_truncate to weight", "--sampler_correction",
     "leave it at none (the sampler/* metrics still show the mismatch)"),
    ({"mask_truncated_completions": True}, "online DPO trains on pairs of whole answers: --mask_truncated_completions "
     "would leave a pair with an empty side", "--mask_truncated_completions",
     "use --missing_eos_penalty or --overlong_buffer_len, which rank a cut answer lower"),
    ({"num_generations": 1, "batch_size": 6}, "num_generations must be >= 2 to make a pair, got 1", "--num_generations",
     "e.g. --num_generations 4"),
    ({"batch_size": 8, "num_generations": 2, "num_mini_batches": 8},  # 1 answer a minibatch
     "a minibatch (1 answers) and a micro-batch (1) must hold whole groups of num_generations 2 answers", *WHOLE_GROUPS),
    ({"gradient_accumulation_steps": 4},  # micro-batches of 2 of a group of 3
     "a minibatch (6 answers) and a micro-batch (2) must hold whole groups of num_generations 3 answers", *WHOLE_GROUPS),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing applies to loss_type sigmoid only",
     "--label_smoothing", None),
])
def test_what_online_dpo_refuses_names_the_flag_and_the_fix(fields, what, where, fix):
    with pytest.raises(UserInputError) as refused:
        online_dpo.OnlineDPO(dpo_cfg(**fields))
    assert (refused.value.what, refused.value.where, refused.value.fix) == (what, where, fix)


def test_what_online_dpo_accepts_at_the_edges():
    unit = online_dpo.OnlineDPO(dpo_cfg(num_generations=2, batch_size=8, num_mini_batches=2,
                                        gradient_accumulation_steps=2, sampler_correction="none", num_iterations=3))
    assert unit.samples_per_prompt == 2 and unit.epochs == 3
    online_dpo.OnlineDPO(dpo_cfg(sampler_correction="auto", loss_type="ipo", label_smoothing=0.0))
    online_dpo.OnlineDPO(dpo_cfg(batch_size=6, num_generations=6, num_mini_batches=1, gradient_accumulation_steps=1))
    online_dpo.OnlineDPO(dpo_cfg(batch_size=9, num_generations=2, num_mini_batches=2))  # 9 // 2 = 4 answers a step


def test_check_config_hands_the_unit_s_passes_and_group_to_the_online_checks():
    # train() handing everything to the loop: test_algorithm_units.py's test_train_hands_..._to_the_loop
    with pytest.raises(UserInputError, match="num_generations must be >= 2"):
        online_dpo.check_config(dpo_cfg(num_generations=1))
    with pytest.raises(UserInputError, match="num_mini_batches"):
        online_dpo.check_config(dpo_cfg(batch_size=6, num_mini_batches=4))
    with pytest.raises(UserInputError, match="passes over each rollout must be > 0, got 0"):
        online_dpo.check_config(dpo_cfg(num_iterations=0))  # the unit's passes reach the online checks
    with pytest.raises(UserInputError, match="batch_size 7 is not a multiple of num_generations 3"):
        online_dpo.check_config(dpo_cfg(batch_size=7, num_mini_batches=2))  # and its group size
    online_dpo.check_config(dpo_cfg())
