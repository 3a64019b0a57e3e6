"""Critic-free pieces of core by hand: NaN-aware group baselines (RLOO, GRPO group / batch / none), group_std,
GRPO's token aggregations (grpo / bnpo / dapo / dr_grpo) and their micro-batch additivity, the clipped ratio
with DAPO's clip-higher, and the sequence ratios of GSPO (token mean) and RLOO (sum)."""

import math

import pytest
import torch

from rlhflab.core import aggregate_token_loss, clipped_ratio_loss, group_std, grpo_advantages, rloo_advantages
from rlhflab.core import sequence_log_ratio

NAN = float("nan")
# three groups of 4: one NaN (a reward that failed) among [1, 2, 6]; one scored sample only; no NaN
SCORES = torch.tensor([1.0, 2.0, NAN, 6.0, 3.0, NAN, NAN, NAN, 0.0, 0.0, 1.0, 1.0])


def test_rloo_leaves_a_nan_out_of_its_siblings_baselines_and_a_lone_scored_sample_gets_zero():
    got = rloo_advantages(SCORES, group_size=4)
    # group 1, siblings among the scored {1, 2, 6}: 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5; NaN -> 0
    # group 2: the one scored sample has no scored sibling -> 0, like the NaN rows
    # group 3: 0 - (0+1+1)/3 = -2/3; 1 - (0+0+1)/3 = 2/3
    want = torch.tensor([-3.0, -1.5, 0.0, 4.5, 0.0, 0.0, 0.0, 0.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3])
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all()


def test_grpo_advantages_with_group_std_batch_std_and_none():
    centred = torch.tensor([-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5, 0.5, 0.5])  # group means 3, 3, 0.5
    group1_std = math.sqrt((4 + 1 + 9) / 2)  # unbiased over the 3 scored samples, the NaN left out: sqrt(7)
    group3_std = math.sqrt(4 * 0.25 / 3)
    group = torch.cat([centred[:4] / (group1_std + 1e-4), centred[4:8], centred[8:] / (group3_std + 1e-4)])
    torch.testing.assert_close(grpo_advantages(SCORES, 4, scale="group"), group)
    # batch: the unbiased std of the 8 scored values [1, 2, 6, 3, 0, 0, 1, 1] (mean 1.75): sum of squares 27.5
    batch_std = math.sqrt(27.5 / 7)
    torch.testing.assert_close(grpo_advantages(SCORES, 4, scale="batch"), centred / (batch_std + 1e-4))
    # none (Dr. GRPO): the group-centred rewards as they are; NaN rows 0
    torch.testing.assert_close(grpo_advantages(SCORES, 4, scale="none"), centred)
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(SCORES, 4, scale="std")


def test_group_std_is_the_unbiased_std_of_the_scored_samples_zero_below_two():
    spread = group_std(SCORES, 4)
    torch.testing.assert_close(spread, torch.tensor([math.sqrt(7.0), 0.0, math.sqrt(1 / 3)]))
    assert ((spread == 0).float().mean() == 1 / 3)  # frac_reward_zero_std of these groups
    torch.testing.assert_close(group_std(torch.tensor([5.0, 5.0, 1.0, 3.0]), 2), torch.tensor([0.0, math.sqrt(2.0)]))


# a 2 x 3 per-token loss; row 2 has 2 real tokens, its padding holds NaN (which must reach nothing)
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, NAN]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize("loss_type,want", [
    ("grpo", (2.0 + 5.0) / 2),  # row means 6/3 and 10/2, then their mean
    ("bnpo", 16.0 / 5),  # token sum / the step's 5 real tokens
    ("dapo", 16.0 / 5),  # the same sum over the tokens the caller passes
    ("dr_grpo", 16.0 / (2 * 4)),  # token sum / (rows x max_length 4), whatever the tensor's width
])
def test_aggregations_by_hand_on_a_ragged_mask(loss_type, want):
    got = aggregate_token_loss(PER_TOKEN, MASK, loss_type, rows=2, tokens=5, max_length=4)
    assert got.item() == pytest.approx(want, rel=1e-7)
    if loss_type == "dapo":  # dapo's denominator is what the caller passes (the rollout's tokens per step)
        assert aggregate_token_loss(PER_TOKEN, MASK, "dapo", rows=2, tokens=8, max_length=4).item() == 2.0
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_token_loss(PER_TOKEN, MASK, "mean", rows=2, tokens=5, max_length=4)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_micro_batches_passing_their_steps_totals_add_up_to_the_full_batch_loss(loss_type):
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=gen)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    per_token = torch.where(mask, per_token, torch.full_like(per_token, NAN))
    totals = dict(rows=6, tokens=float(mask.sum()), max_length=7)
    full = aggregate_token_loss(per_token, mask, loss_type, **totals)
    for split in ([1, 5], [2, 2, 2], [1] * 6, [4, 2]):
        parts = [aggregate_token_loss(p, m, loss_type, **totals)
                 for p, m in zip(per_token.split(split), mask.split(split))]
        torch.testing.assert_close(torch.stack(parts).sum(), full)
    assert torch.isfinite(full)


def test_aggregations_give_no_gradient_to_padding():
    per_token = PER_TOKEN.nan_to_num(7.0).requires_grad_(True)
    for loss_type in ("bnpo", "dapo", "dr_grpo", "grpo"):  # grpo's gradient is checked last
        per_token.grad = None
        aggregate_token_loss(per_token, MASK, loss_type, rows=2, tokens=5, max_length=4).backward()
        assert per_token.grad[1, 2] == 0 and (per_token.grad[MASK] > 0).all()
    # grpo weighs a token by 1 / (rows x its response's length)
    torch.testing.assert_close(per_token.grad, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 4, 1 / 4, 0.0]]))


def test_clipped_ratio_loss_and_its_clip_flags_with_clip_higher():
    # DAPO's clip-higher: ratio kept within [1 - 0.2, 1 + 0.28]
    ratio = torch.tensor([0.7, 0.9, 1.0, 1.25, 1.35, 0.7, 1.35])
    adv = torch.tensor([-1.0, -1.0, 2.0, 2.0, 2.0, 1.0, -1.0])
    log_ratio = ratio.log().requires_grad_(True)
    loss, low, high = clipped_ratio_loss(log_ratio, adv, epsilon_low=0.2, epsilon_high=0.28)
    # -min(rA, clip(r)A): 0.7,-1 -> -min(-0.7, -0.8) = 0.8 (low clip active); 0.9,-1 -> 0.9; 1,2 -> -2;
    # 1.25,2 -> -2.5 (inside 1.28: not clipped, where a symmetric 0.2 would clip); 1.35,2 -> -min(2.7, 2.56) = -2.56
    # (high clip); 0.7,+1 -> -0.7 (the min keeps the unclipped term); 1.35,-1 -> -min(-1.35, -1.28) = 1.35
    torch.testing.assert_close(loss, torch.tensor([0.8, 0.9, -2.0, -2.5, -2.56, -0.7, 1.35]))
    assert low.tolist() == [True, False, False, False, False, False, False]
    assert high.tolist() == [False, False, False, False, True, False, False]
    loss.sum().backward()
    # d/d log r of -rA is -rA where the unclipped term is active; 0 where the clip is
    torch.testing.assert_close(log_ratio.grad, torch.tensor([0.0, 0.9, -2.0, -2.5, 0.0, -0.7, 1.35]))
    _, _, symmetric_high = clipped_ratio_loss(ratio.log(), adv, 0.2, 0.2)
    assert symmetric_high.tolist() == [False, False, False, True, True, False, False]


LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.1]])
OLD = torch.tensor([[-1.1, -1.7, -1.0], [-1.7, NAN, NAN]])  # row 2: one real token, NaN padding
SEQ_MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_sequence_log_ratios_gspo_mean_and_rloo_sum():
    # per-token log-ratios: [0.1, -0.3, 0.5] and [0.2]
    torch.testing.assert_close(sequence_log_ratio(LOGPROBS, OLD, SEQ_MASK, "mean"), torch.tensor([[0.1], [0.2]]))
    summed = sequence_log_ratio(LOGPROBS, OLD, SEQ_MASK, "sum")
    torch.testing.assert_close(summed, torch.tensor([[0.3], [0.2]]))
    # the sum is the log-ratio of the whole sequence's probability: exp(sum) = product of the token ratios
    token_ratios = torch.where(SEQ_MASK, (LOGPROBS - OLD).exp(), torch.ones(()))
    torch.testing.assert_close(summed.exp().squeeze(1), token_ratios.prod(dim=1))
    with pytest.raises(ValueError, match="reduce"):
        sequence_log_ratio(LOGPROBS, OLD, SEQ_MASK, "max")


def test_gspo_per_token_gradient_equals_the_sequences():
    """GSPO (Zheng et al. 2025, eq. 10): every token of a response gets the gradient of its sequence ratio,
    s_i A_i / |y_i|, the same for each of its tokens, and nothing for padding."""
    logprobs = LOGPROBS.clone().requires_grad_(True)
    adv = torch.tensor([[1.5], [-2.0]])
    log_s = sequence_log_ratio(logprobs, OLD, SEQ_MASK, "mean")  # (2, 1): s = exp(0.1), exp(0.2), unclipped
    per_seq, low, high = clipped_ratio_loss(log_s, adv, 0.2, 0.2)
    assert not low.any() and not high.any()
    loss = aggregate_token_loss(per_seq.expand_as(logprobs), SEQ_MASK, "grpo", rows=2, tokens=4, max_length=3)
    loss.backward()
    s = torch.tensor([math.exp(0.1), math.exp(0.2)])
    want = torch.tensor([[-1.5 * s[0] / 3] * 3, [2.0 * s[1] / 1, 0.0, 0.0]]) / 2  # / rows
    torch.testing.assert_close(logprobs.grad, want)
    # the same as differentiating the sequence-level objective -mean_i A_i s_i directly
    direct = LOGPROBS.clone().requires_grad_(True)
    seq = torch.where(SEQ_MASK, direct - OLD.nan_to_num(0.0), torch.zeros(())).sum(1) / SEQ_MASK.sum(1)
    (-(adv.squeeze(1) * seq.exp()).mean()).backward()
    torch.testing.assert_close(logprobs.grad, direct.grad)
