"""The algorithm units on a scored rollout, no model: their refusals and `check_config`, the advantages GRPO, RLOO and
REINFORCE form from a rollout with an unscored row, a lone scored row and a KL in the reward, the rollout metrics,
the state they carry between updates, and the clipped loss's KL term, sampler weights and entropy bonus with
garbage past the mask (issue 36: docs/mutation.md "The algorithm units" lists what these kill)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.config import GRPOConfig, REINFORCEConfig, RLOOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import grpo, reinforce, rloo
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare
from rlhflab.trainers.online.clipped import (STEP_NAMES, ClipSettings, clipped_policy_loss, group_metrics,
                                             sequence_advantages)


def scored(scores, lengths, valid=None, kl=None, eos=None, entropy=None, group: int = 2, width: int = 3,
           old=None, ref=None, sampler_weights=None):
    """A scored rollout of responses of `lengths` tokens (a row not `valid` keeps its response tokens in the
    rollout's mask and none in the batch's); kl (B, T) on the batch's mask, entropy (B, T) on the rollout's."""
    rows = len(scores)
    response_mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    valid = torch.ones(rows, dtype=torch.bool) if valid is None else torch.tensor(valid)
    mask = response_mask & valid.unsqueeze(1)
    old = torch.zeros(rows, width) if old is None else torch.tensor(old)
    rollout = SimpleNamespace(response_mask=response_mask, logprobs=old,
                              ref_logprobs=old if ref is None else torch.tensor(ref), batch_size=rows,
                              entropy=torch.zeros(rows, width) if entropy is None else torch.tensor(entropy),
                              ended_with_eos=torch.ones(rows, dtype=torch.bool) if eos is None else torch.tensor(eos))
    kl = torch.zeros(rows, width) if kl is None else torch.tensor(kl)
    weights = None if sampler_weights is None else torch.tensor(sampler_weights)
    return ScoredRollout(rollout, torch.tensor(scores), valid, mask, kl, group, weights)


def share_of(batch, rows=None, tokens=None) -> StepShare:
    real = float(batch.mask.sum())
    rows = batch.rollout.batch_size if rows is None else rows
    return StepShare(tokens=real if tokens is None else tokens, rows=rows, rollout_tokens=real,
                     response_length=batch.mask.shape[1], steps=1, index=torch.arange(batch.rollout.batch_size))


def per_token(values, mask) -> torch.Tensor:
    """(B,) -> (B, T) on the mask, 0 elsewhere: what sequence_advantages must give."""
    return torch.where(mask, torch.tensor(values).unsqueeze(1), torch.zeros(()))


def grpo_cfg(**fields) -> GRPOConfig:
    return GRPOConfig(**{"model": "unused", "num_generations": 2, "beta": 0.0, **fields})


def rloo_cfg(**fields) -> RLOOConfig:
    return RLOOConfig(**{"model": "unused", "num_generations": 2, "beta": 0.0, **fields})


def reinforce_cfg(**fields) -> REINFORCEConfig:
    return REINFORCEConfig(**{"model": "unused", "kl_coef": 0.0, **fields})


def refusal(make, cfg) -> str:
    with pytest.raises(UserInputError) as caught:
        make(cfg)
    return str(caught.value)


# --- refusals, before anything loads -------------------------------------------------------------------------


@pytest.mark.parametrize("unit, config", [(grpo.GRPO, grpo_cfg), (rloo.RLOO, rloo_cfg)])
def test_the_group_methods_refuse_one_generation_and_a_clip_of_zero_or_below(unit, config):
    assert refusal(unit, config(num_generations=1)) == (
        "--num_generations: num_generations must be >= 2 (a group baseline needs siblings), got 1 "
        "-> e.g. --num_generations 4")
    # epsilon 0 is refused whatever epsilon_high, and a negative epsilon_high whatever epsilon
    for epsilon, high in [(0.0, 0.0), (0.0, 0.28), (0.2, -0.01)]:
        assert refusal(unit, config(epsilon=epsilon, epsilon_high=high)) == (
            f"--epsilon / --epsilon_high: epsilon must be > 0 and epsilon_high >= 0, got {epsilon}, {high}")
    # the bounds themselves are allowed: two generations, the smallest epsilon, epsilon_high 0 (= epsilon)
    made = unit(config(num_generations=2, epsilon=1e-6, epsilon_high=0.0))
    assert made.samples_per_prompt == 2 and made.settings.epsilon_low == made.settings.epsilon_high == 1e-6


def test_reinforce_refuses_a_leave_one_out_without_siblings_no_generation_and_a_decay_outside_0_1():
    assert refusal(reinforce.REINFORCE, reinforce_cfg(baseline="leave_one_out", num_generations=1)) == (
        "--num_generations: baseline=leave_one_out needs num_generations >= 2 "
        "-> e.g. --num_generations 4, or --baseline batch_mean")
    assert refusal(reinforce.REINFORCE, reinforce_cfg(num_generations=0)) == (
        "--num_generations: num_generations must be >= 1, got 0")
    for decay in (1.0, -0.1, 1.5):  # a ValueError of MovingAverageBaseline's own would not do: ours says the flag
        assert refusal(reinforce.REINFORCE, reinforce_cfg(baseline_decay=decay)) == (
            f"--baseline_decay: baseline_decay must be in [0, 1), got {decay} "
            "-> e.g. --baseline_decay 0.9 (the weight of the old average)")
    # allowed: two generations leave one out, one generation with the other baselines, decay 0 and just under 1
    unit = reinforce.REINFORCE(reinforce_cfg(baseline="leave_one_out", num_generations=2))
    assert unit.group_relative is True and unit.samples_per_prompt == 2
    for baseline in ("batch_mean", "moving_average"):
        unit = reinforce.REINFORCE(reinforce_cfg(baseline=baseline, num_generations=1, baseline_decay=0.0))
        assert unit.group_relative is False and unit.samples_per_prompt == 1 and unit.moving.decay == 0.0
    assert reinforce.REINFORCE(reinforce_cfg(baseline_decay=0.999)).moving.decay == 0.999


@pytest.mark.parametrize("module, config", [(grpo, grpo_cfg), (rloo, rloo_cfg),
                                            (reinforce, lambda **f: reinforce_cfg(num_generations=2, **f))])
def test_check_config_hands_the_units_group_and_passes_to_the_online_checks(module, config):
    assert module.check_config(config(batch_size=8)) is None
    with pytest.raises(UserInputError, match="^--batch_size / --num_generations: batch_size 9 is not a multiple of "
                                             "num_generations 2"):
        module.check_config(config(batch_size=9, total_episodes=90))
    if module is not reinforce:  # REINFORCE makes one pass, whatever the config
        with pytest.raises(UserInputError, match="passes over each rollout must be > 0, got 0"):
            module.check_config(config(num_iterations=0))
    with pytest.raises(UserInputError, match="no policy given"):  # the unit's own checks come first, then these
        module.check_config(config(model=""))


# --- GRPO: advantages and the rollout's metrics --------------------------------------------------------------

# three groups of two: (1, 3), (2, 2), (4, unscored): the third's scored row has no sibling to compare with
SCORES, LENGTHS, VALID = [1.0, 3.0, 2.0, 2.0, 4.0, 5.0], [2, 1, 3, 2, 1, 2], [True] * 5 + [False]
EOS = [True, True, False, True, True, True]  # row 2 hit the cap
ENTROPY = [[0.1 * (i + 1)] * 2 + [9.0] for i in range(6)]  # 9 on row 2's third token only counts (length 3)


@pytest.mark.parametrize("scale, divisor", [("group", math.sqrt(2) + 1e-4), ("batch", math.sqrt(1.3) + 1e-4),
                                            ("none", 1.0)], ids=["group", "batch", "none"])
def test_grpo_advantages_and_rollout_metrics_by_hand(scale, divisor):
    # group (1, 3): centred -1, +1, over its std sqrt 2, the batch's std of the 5 scored (1, 3, 2, 2, 4: sqrt 1.3)
    # or 1; (2, 2) and a lone scored row: 0; the unscored row: 0 (its score 5 is in no statistic)
    batch = scored(SCORES, LENGTHS, VALID, eos=EOS, entropy=ENTROPY)
    unit = grpo.GRPO(grpo_cfg(scale_rewards=scale))
    adv = unit.advantages(batch)
    want = per_token([-1 / divisor, 1 / divisor, 0.0, 0.0, 0.0, 0.0], batch.mask)
    torch.testing.assert_close(adv.advantages, want)
    assert adv.returns is None and adv.policy_mask is None
    # the rollout's token entropy over every row's response tokens: (0.2 + 0.2 + 0.3 + 0.3 + 9 + 0.8 + 0.5 + 1.2) / 11
    assert adv.metrics == pytest.approx({
        "reward": 2.4, "reward_std": math.sqrt(1.3), "frac_reward_zero_std": 2 / 3, "completions/mean_length": 11 / 6,
        "entropy": 12.5 / 11, "completions/clipped_ratio": 1 / 6})


def test_grpo_kl_in_reward_moves_the_advantages_and_the_zero_std_share_not_the_reward():
    # row 2's sequence KL 2 x beta 0.5: rewards (1, 3), (1, 2), (4, -): group 2 now has a spread, std sqrt 0.5
    kl = [[0.0] * 3, [0.0] * 3, [1.0, 0.5, 0.5], [0.0] * 3, [0.0] * 3, [0.0] * 3]
    batch = scored(SCORES, LENGTHS, VALID, kl=kl, eos=EOS, entropy=ENTROPY)
    adv = grpo.GRPO(grpo_cfg(beta=0.5, kl_in_reward=True, scale_rewards="none")).advantages(batch)
    torch.testing.assert_close(adv.advantages, per_token([-1.0, 1.0, -0.5, 0.5, 0.0, 0.0], batch.mask))
    assert adv.metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert adv.metrics["reward"] == pytest.approx(2.4)  # the scores, before the KL penalty (TRL)
    # the KL as a loss term instead: the reward is the score
    adv = grpo.GRPO(grpo_cfg(beta=0.5, scale_rewards="none")).advantages(batch)
    torch.testing.assert_close(adv.advantages, per_token([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0], batch.mask))
    assert adv.metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("unit", [lambda **f: grpo.GRPO(grpo_cfg(**f)), lambda **f: rloo.RLOO(rloo_cfg(**f)),
                                  lambda **f: reinforce.REINFORCE(reinforce_cfg(**f))])
def test_mask_truncated_completions_counts_the_truncated_rows_in_the_metrics(unit):
    batch = scored(SCORES, LENGTHS, VALID, eos=EOS, entropy=ENTROPY)
    assert "completions/masked_truncated" not in unit().advantages(batch).metrics
    metrics = unit(mask_truncated_completions=True).advantages(batch).metrics
    assert metrics["completions/masked_truncated"] == 1 and metrics["completions/clipped_ratio"] == pytest.approx(1 / 6)


def test_group_metrics_of_one_scored_response_and_without_the_truncation_flag():
    batch = scored([3.0, 0.0], [1, 2], [True, False], eos=[False, False])
    metrics = group_metrics(batch, batch.scores)
    assert metrics == {"reward": 3.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0,
                       "completions/mean_length": 1.5, "entropy": 0.0, "completions/clipped_ratio": 1.0}


def test_sequence_advantages_put_each_responses_advantage_on_its_real_tokens_only():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    got = sequence_advantages(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), mask)
    assert got.dtype == torch.float64
    assert got.tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]


# --- RLOO: rewards less beta x the sequence KL, leave-one-out, whitened -----------------------------------------


def test_rloo_advantages_reward_less_beta_kl_against_the_siblings_and_whitened_over_the_scored_rows():
    # rewards 1, 3, 2 - 0.5 x 2 = 1, 2, 4, -: leave-one-out (1-3, 3-1), (1-2, 2-1), a lone row and the unscored: 0
    kl = [[0.0] * 3, [0.0] * 3, [1.0, 0.5, 0.5], [0.0] * 3, [0.0] * 3, [0.0] * 3]
    batch = scored(SCORES, LENGTHS, VALID, kl=kl, eos=EOS, entropy=ENTROPY)
    adv = rloo.RLOO(rloo_cfg(beta=0.5)).advantages(batch)
    torch.testing.assert_close(adv.advantages, per_token([-2.0, 2.0, -1.0, 1.0, 0.0, 0.0], batch.mask))
    # kl: the summed KL over the batch's 9 real tokens (TRL's RLOO "kl"); reward: the scores, before the penalty
    assert adv.metrics == pytest.approx({
        "reward": 2.4, "reward_std": math.sqrt(1.3), "frac_reward_zero_std": 1 / 3, "completions/mean_length": 11 / 6,
        "entropy": 12.5 / 11, "completions/clipped_ratio": 1 / 6, "kl": 2 / 9})
    # whitened over the 5 scored rows (-2, 2, -1, 1, 0: mean 0, std sqrt 2.5), the unscored row's 0 left out of both
    adv = rloo.RLOO(rloo_cfg(beta=0.5, normalize_advantages=True)).advantages(batch)
    scale = math.sqrt(2.5) + 1e-4
    torch.testing.assert_close(adv.advantages, per_token([-2 / scale, 2 / scale, -1 / scale, 1 / scale, 0, 0],
                                                         batch.mask))


def test_rloo_whitens_two_scored_rows_and_leaves_a_lone_one_and_logs_the_kl_of_a_one_token_batch():
    batch = scored([1.0, 3.0], [1, 2])
    adv = rloo.RLOO(rloo_cfg(normalize_advantages=True)).advantages(batch)
    torch.testing.assert_close(adv.advantages, per_token([-2 / (math.sqrt(8) + 1e-4), 2 / (math.sqrt(8) + 1e-4)],
                                                         batch.mask))
    assert adv.metrics["reward_std"] == pytest.approx(math.sqrt(2))  # two scores have a spread
    # one scored row of one token: no sibling (advantage 0, nothing to whiten: no NaN), its KL 0.3 over 1 token
    batch = scored([3.0, 0.0], [1, 2], [True, False], kl=[[0.3, 0.0, 0.0], [0.0] * 3])
    adv = rloo.RLOO(rloo_cfg(normalize_advantages=True)).advantages(batch)
    assert adv.advantages.tolist() == [[0.0] * 3] * 2
    assert adv.metrics["kl"] == pytest.approx(0.3) and adv.metrics["reward_std"] == 0.0


# --- REINFORCE: the three baselines ----------------------------------------------------------------------------


def test_reinforce_return_less_the_batch_mean_with_a_per_token_kl_penalty():
    # kl_coef 0.2, KL (0.5, 1) on row 0's two tokens: rewards -0.1, -0.2 + 1; reward-to-go 0.7, 0.8; row 1: 3.
    # Batch-mean baseline (0.7 + 3) / 2 = 1.85; an unscored third row is in no mean
    batch = scored([1.0, 3.0, 5.0], [2, 1, 2], [True, True, False], kl=[[0.5, 1.0, 0.0], [0.0] * 3, [0.0] * 3],
                   group=1)
    adv = reinforce.REINFORCE(reinforce_cfg(kl_coef=0.2)).advantages(batch)
    want = torch.tensor([[0.7 - 1.85, 0.8 - 1.85, 0.0], [3 - 1.85, 0.0, 0.0], [0.0] * 3])
    torch.testing.assert_close(adv.advantages, want)
    assert adv.metrics == pytest.approx({"reward": 2.0, "reward_std": math.sqrt(2), "objective/rlhf_reward": 1.85,
                                         "baseline": 1.85, "completions/clipped_ratio": 0.0})


def test_reinforce_moving_average_baseline_sees_only_earlier_batches_and_survives_a_resume():
    # decay 0.5: the first batch's baseline is 0 and sets the average to its mean (1 + 3) / 2 = 2 (the unscored
    # row's return 0 is not in it); the second's is 2, then 0.5 x 2 + 0.5 x 5 = 3.5
    unit = reinforce.REINFORCE(reinforce_cfg(baseline="moving_average", baseline_decay=0.5))
    first = scored([1.0, 3.0, 5.0], [1, 1, 1], [True, True, False], group=1)
    adv = unit.advantages(first)
    assert adv.advantages[:, 0].tolist() == [1.0, 3.0, 0.0] and adv.metrics["baseline"] == 0.0
    adv = unit.advantages(scored([4.0, 6.0], [1, 1], group=1))
    assert adv.advantages[:, 0].tolist() == [2.0, 4.0] and adv.metrics["baseline"] == 2.0
    state = unit.state_dict()
    assert state == {"moving_baseline": {"decay": 0.5, "value": 3.5, "initialised": True}}
    resumed = reinforce.REINFORCE(reinforce_cfg(baseline="moving_average", baseline_decay=0.5))
    resumed.load_state_dict(state)
    third = scored([3.5, 0.5], [1, 1], group=1)
    assert resumed.advantages(third).advantages[:, 0].tolist() == [0.0, -3.0]
    assert resumed.moving.value == pytest.approx(0.5 * 3.5 + 0.5 * 2.0)


def test_reinforce_leave_one_out_baseline_is_the_mean_return_of_the_scored_siblings():
    # groups of 3: (1, 2, 6): siblings' means 4, 3.5, 1.5; (3, 5, unscored): 5, 3, and the unscored row's advantage 0
    batch = scored([1.0, 2.0, 6.0, 3.0, 5.0, 9.0], [1] * 6, [True] * 5 + [False], group=3)
    adv = reinforce.REINFORCE(reinforce_cfg(baseline="leave_one_out", num_generations=3)).advantages(batch)
    assert adv.advantages[:, 0].tolist() == [-3.0, -1.5, 4.5, -2.0, 2.0, 0.0]
    assert adv.metrics["baseline"] == pytest.approx((4 + 3.5 + 1.5 + 5 + 3) / 5)


def test_reinforce_reward_std_of_one_scored_response_is_zero():
    adv = reinforce.REINFORCE(reinforce_cfg()).advantages(scored([2.0, 0.0], [1, 1], [True, False], group=1))
    assert adv.metrics["reward_std"] == 0.0 and adv.metrics["reward"] == 2.0


def test_reinforce_entropy_bonus_and_a_micro_batchs_logged_loss():
    # micro-batch = row 1 of a 2-row step of 3 tokens: -A x ratio = -4 on its token, over the step's 3 tokens;
    # the bonus -0.1 x its entropy 0.6 / the step's 3 tokens; logged x 2 rows / 1
    batch = scored([0.0, 0.0], [2, 1], group=1)
    adv = Advantages(per_token([2.0, 4.0], batch.mask), None, {})
    unit = reinforce.REINFORCE(reinforce_cfg(entropy_coef=0.1))
    assert unit.entropy_in_loss is True
    logprobs = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[0.6, 5.0, 5.0]], requires_grad=True)
    loss, stats = unit.loss(logprobs, None, batch, adv, torch.tensor([1]), share_of(batch), entropy=entropy)
    assert loss.item() == pytest.approx(-4 / 3 - 0.1 * 0.6 / 3)
    assert stats["loss"].item() == pytest.approx(2 * (-4 / 3 - 0.1 * 0.6 / 3))
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.1 / 3, 0.0, 0.0])
    assert unit.step_metrics({"loss": 1.0, "ratio_mean": 2.0, "grad_norm": 3.0, "kl": 4.0}) == {
        "loss": 1.0, "policy/ratio_mean": 2.0, "grad_norm": 3.0}


# --- the state carried between updates --------------------------------------------------------------------------


@pytest.mark.parametrize("unit", [lambda **f: grpo.GRPO(grpo_cfg(**f)), lambda **f: rloo.RLOO(rloo_cfg(**f)),
                                  lambda **f: reinforce.REINFORCE(reinforce_cfg(**f))])
def test_the_adaptive_entropy_coefficient_goes_through_the_state(unit):
    # coef 0.1, target 0.5, delta 0.05: the rollout's entropy 0.2 <= 0.5 raises it to 0.15, applied from now on
    fields = dict(use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=0.5, entropy_coef_delta=0.05)
    trained = unit(**fields)
    assert trained.state_dict().get("entropy_controller", {}).get("entropy") is None
    adv = trained.advantages(scored([1.0, 2.0], [1, 1], entropy=[[0.2, 0.0, 0.0]] * 2))
    assert adv.metrics["entropy_coef"] == pytest.approx(0.15)
    state = trained.state_dict()
    assert state["entropy_controller"]["value"] == pytest.approx(0.15)
    assert state["entropy_controller"]["entropy"] == pytest.approx(0.2)
    resumed = unit(**fields)
    resumed.load_state_dict(state)
    assert resumed.entropy.coef == pytest.approx(0.15)
    assert resumed.state_dict() == state


# --- the clipped loss: KL term, sampler weights, entropy, micro-batches ----------------------------------------


def test_the_k3_kl_term_reads_nothing_past_the_mask():
    # ref log-probs of 1000 past the mask overflow k3 (exp(1000)), the policy's are NaN there: a KL term on padding
    # would pass inf x 0 = NaN back to the log-probs. On the real tokens: ratio 1, A = 0, d = ref - logp = 0.5
    ref = [[0.5, 1000.0, 1000.0], [0.5, 0.5, 1000.0]]
    batch = scored([0.0, 0.0], [1, 2], ref=ref)
    adv = Advantages(torch.zeros(2, 3), None, {})
    logprobs = torch.tensor([[0.0, math.nan, math.nan], [0.0, 0.0, math.nan]], requires_grad=True)
    loss, stats = grpo.GRPO(grpo_cfg(beta=0.1, loss_type="bnpo")).loss(logprobs, None, batch, adv, torch.arange(2),
                                                                      share_of(batch))
    loss.backward()
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5) and stats["kl"].item() == pytest.approx(k3, rel=1e-5)
    # d/d logp of 0.1 x (exp(ref - logp) - (ref - logp) - 1) / 3 tokens = 0.1 x (1 - e^0.5) / 3 on each real token
    g = 0.1 * (1 - math.exp(0.5)) / 3
    torch.testing.assert_close(logprobs.grad, torch.tensor([[g, 0.0, 0.0], [g, g, 0.0]]))
    assert stats["ratio_max"].item() == 1.0 and stats["ratio_min"].item() == 1.0


def test_sampler_weights_scale_the_policy_gradient_term_not_the_kl_term():
    # bnpo over 3 tokens, ratio 1: per token -A w + 0.1 k3; A = 1, -2; weights 0.5, 2 | 1.5 (9 past the mask)
    ref = [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    batch = scored([0.0, 0.0], [2, 1], ref=ref, sampler_weights=[[0.5, 2.0, 9.0], [1.5, 9.0, 9.0]])
    adv = Advantages(per_token([1.0, -2.0], batch.mask), None, {})
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = grpo.GRPO(grpo_cfg(beta=0.1, loss_type="bnpo")).loss(logprobs, None, batch, adv, torch.arange(2),
                                                                  share_of(batch))
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss.item() == pytest.approx((-0.5 - 2.0 + 3.0 + 0.1 * k3) / 3, rel=1e-5)
    loss.backward()
    want = torch.tensor([[-0.5 + 0.1 * (1 - math.exp(0.5)), -2.0, 0.0], [3.0, 0.0, 0.0]]) / 3
    torch.testing.assert_close(logprobs.grad, want)


def test_the_top_entropy_mask_drops_the_policy_gradient_term_and_keeps_the_kl_term():
    ref = [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]
    batch = scored([0.0, 0.0], [2, 1], ref=ref)
    kept = torch.tensor([[False, True, False], [True, False, False]])
    adv = Advantages(per_token([1.0, -2.0], batch.mask), None, {}, policy_mask=kept)
    loss, _ = grpo.GRPO(grpo_cfg(beta=0.1, loss_type="bnpo")).loss(torch.zeros(2, 3), None, batch, adv,
                                                                  torch.arange(2), share_of(batch))
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss.item() == pytest.approx((-1.0 + 2.0 + 0.1 * 2 * k3) / 3, rel=1e-5)


@pytest.mark.parametrize("unit", [lambda **f: grpo.GRPO(grpo_cfg(loss_type="bnpo", **f)),
                                  lambda **f: rloo.RLOO(rloo_cfg(**f))])
def test_the_clipped_loss_of_one_micro_batch_with_the_entropy_bonus(unit):
    # micro-batch = row 1 (one token, A = -2, ratio 1) of a 2-row step of 3 tokens: the policy term 2 / 3 (bnpo) or
    # 2 / 2 rows (RLOO: each response's sequence term over the step's responses), the bonus -0.1 x 0.6 / 3 tokens;
    # logged x 2 rows / 1
    batch = scored([0.0, 0.0], [2, 1])
    adv = Advantages(per_token([1.0, -2.0], batch.mask), None, {})
    made = unit(entropy_coef=0.1)
    assert made.entropy_in_loss is True and unit().entropy_in_loss is False  # the loop hands entropies when True
    entropy = torch.tensor([[0.6, 7.0, 7.0]], requires_grad=True)
    loss, stats = made.loss(torch.zeros(1, 3), None, batch, adv, torch.tensor([1]), share_of(batch), entropy=entropy)
    policy = 2 / 3 if made.name == "grpo" else 2 / 2
    assert loss.item() == pytest.approx(policy - 0.1 * 0.6 / 3)
    assert stats["loss"].item() == pytest.approx(2 * (policy - 0.1 * 0.6 / 3))
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.1 / 3, 0.0, 0.0])
    # without the bonus, an entropy handed in changes nothing
    loss, _ = unit().loss(torch.zeros(1, 3), None, batch, adv, torch.tensor([1]), share_of(batch), entropy=entropy)
    assert loss.item() == pytest.approx(policy)


def test_the_clipped_loss_called_without_entropy_settings():
    # the defaults (no EntropyControl, no entropies): the policy term alone, A = 1 at ratio 1 over 3 tokens
    batch = scored([0.0, 0.0], [2, 1])
    adv = Advantages(per_token([1.0, 1.0], batch.mask), None, {})
    loss, _ = clipped_policy_loss(torch.zeros(2, 3), batch, adv, torch.arange(2), share_of(batch),
                                  ClipSettings(0.2, 0.2, "token", "bnpo", 0.0))
    assert loss.item() == pytest.approx(-1.0)


def test_the_step_metrics_take_trls_names():
    stats = {name: float(i) for i, name in enumerate(STEP_NAMES)}
    named = grpo.GRPO(grpo_cfg()).step_metrics({**stats, "other": 9.0})
    assert named == {"loss": 0.0, "kl": 1.0, "clip_ratio/low_mean": 2.0, "clip_ratio/high_mean": 3.0,
                     "clip_ratio/region_mean": 4.0, "policy/ratio_mean": 5.0, "policy/ratio_min": 6.0,
                     "policy/ratio_max": 7.0, "grad_norm": 8.0}
