"""PPO's algorithm unit (trainers/ppo.py) on hand-made batches, no model: the advantages against a naive
per-token loop (the KL penalty in the reward, the score on the last real token, GAE with gamma != lam), the
loss's weights and parts, the critic's warm-up, the KL controller's update and the unit's refusals (issue 36:
the numbers a swapped argument, a dropped flag or a wrong normaliser would change)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab import core
from rlhflab.config import PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import ppo
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare

WIDTH = 3
LENGTHS = [2, 3, 1]
LOGPROBS = [[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.5], [-3.0, 0.0, 0.0]]
REF = [[-1.5, -1.0, 9.0], [-0.5, -2.5, -2.0], [-2.0, 9.0, 9.0]]  # 9.0: garbage past the mask
VALUES = [[0.2, -0.4, 7.0], [0.1, 0.3, -0.2], [0.6, 7.0, 7.0]]
SCORES = [1.0, -2.0, 0.5]


def ppo_cfg(**fields) -> PPOConfig:
    base = {"kl_coef": 0.1, "gamma": 0.9, "lam": 0.8, "whiten_advantages": False, "value_warmup_rollouts": 0,
            "batch_size": 3}
    return PPOConfig(model="unused", **{**base, **fields})


def scored(valid=(True, True, True), values=VALUES, scores=SCORES) -> ScoredRollout:
    lengths = torch.tensor(LENGTHS)
    response_mask = torch.arange(WIDTH).unsqueeze(0) < lengths.unsqueeze(1)
    valid = torch.tensor(valid)
    mask = response_mask & valid.unsqueeze(1)
    logprobs, ref = torch.tensor(LOGPROBS), torch.tensor(REF)
    rollout = SimpleNamespace(response_mask=response_mask, logprobs=logprobs, ref_logprobs=ref,
                              values=torch.tensor(values), batch_size=len(LENGTHS),
                              entropy=torch.zeros(len(LENGTHS), WIDTH),
                              ended_with_eos=torch.ones(len(LENGTHS), dtype=torch.bool))
    kl = torch.where(mask, logprobs - ref, torch.zeros(()))
    return ScoredRollout(rollout, torch.tensor(scores) * valid, valid, mask, kl, 1)


def naive_advantages(beta, gamma, lam, estimator="k1"):
    """Per row: r_t = -beta KL_t (+ the score on the last real token); delta_t = r_t + gamma V_{t+1} - V_t with
    V = 0 after the last real token; A_t = delta_t + gamma lam A_{t+1}; returns = A + V. Plain Python."""
    advantages, returns, penalties = [], [], []
    for row, length in enumerate(LENGTHS):
        logp, ref, values = LOGPROBS[row][:length], REF[row][:length], VALUES[row][:length]
        log_ratio = [a - b for a, b in zip(logp, ref)]
        kl = {"k1": log_ratio, "k2": [0.5 * x * x for x in log_ratio],
              "k3": [math.exp(-x) - 1 + x for x in log_ratio]}[estimator]
        rewards = [-beta * k for k in kl]
        rewards[-1] += SCORES[row]
        adv, following = [0.0] * length, 0.0
        for t in reversed(range(length)):
            next_value = values[t + 1] if t + 1 < length else 0.0
            following = rewards[t] + gamma * next_value - values[t] + gamma * lam * following
            adv[t] = following
        pad = [0.0] * (WIDTH - length)
        advantages.append(adv + pad)
        returns.append([a + v for a, v in zip(adv, values)] + pad)
        penalties.append(sum(-beta * k for k in kl))
    return torch.tensor(advantages), torch.tensor(returns), penalties


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_advantages_are_gae_of_the_kl_penalised_rewards_with_gamma_and_lam_by_hand(estimator):
    unit = ppo.PPO(ppo_cfg(kl_estimator=estimator))
    adv = unit.advantages(scored())
    expected, returns, penalties = naive_advantages(0.1, 0.9, 0.8, estimator)
    assert torch.allclose(adv.advantages, expected, atol=1e-6)
    assert torch.allclose(adv.returns, returns, atol=1e-6)
    assert adv.metrics["objective/non_score_reward"] == pytest.approx(sum(penalties) / 3, abs=1e-6)
    assert adv.metrics["objective/rlhf_reward"] == pytest.approx((sum(SCORES) + sum(penalties)) / 3, abs=1e-6)
    assert adv.metrics["kl_coef"] == 0.1
    mask = scored().mask
    assert adv.metrics["val/explained_variance"] == pytest.approx(
        core.explained_variance(torch.tensor(VALUES), returns, mask).item(), abs=1e-6)
    assert "completions/masked_truncated" not in adv.metrics


@pytest.mark.parametrize("garbage", [float("nan"), float("-inf")])
def test_non_finite_log_probs_past_the_mask_reach_no_advantage_and_no_kl_coefficient(garbage):
    batch = scored()
    batch.rollout.ref_logprobs[~batch.mask] = garbage
    unit = ppo.PPO(ppo_cfg(adaptive_kl=True, kl_target=0.1, kl_horizon=30, kl_estimator="k3"))
    adv = unit.advantages(batch)
    expected, _, _ = naive_advantages(0.1, 0.9, 0.8, "k3")
    assert torch.allclose(adv.advantages, expected, atol=1e-6)
    unit.after_update(batch)
    assert math.isfinite(unit.kl_ctl.value) and unit.kl_ctl.value != 0.1


def test_a_row_the_reward_failed_on_is_out_of_the_advantages_and_the_reward_means():
    adv = ppo.PPO(ppo_cfg()).advantages(scored(valid=(True, False, True)))
    expected, _, penalties = naive_advantages(0.1, 0.9, 0.8)
    assert torch.equal(adv.advantages[1], torch.zeros(WIDTH))
    assert torch.allclose(adv.advantages[[0, 2]], expected[[0, 2]], atol=1e-6)
    assert adv.metrics["objective/non_score_reward"] == pytest.approx((penalties[0] + penalties[2]) / 2, abs=1e-6)
    assert adv.metrics["objective/rlhf_reward"] == pytest.approx(
        (SCORES[0] + SCORES[2] + penalties[0] + penalties[2]) / 2, abs=1e-6)


def test_whitened_advantages_have_mean_0_and_variance_1_over_the_real_tokens_and_not_past_them():
    adv = ppo.PPO(ppo_cfg(whiten_advantages=True)).advantages(scored())
    mask = scored().mask
    raw, _, _ = naive_advantages(0.1, 0.9, 0.8)
    assert torch.allclose(adv.advantages, core.whiten(raw, mask), atol=1e-5)
    assert core.masked_mean(adv.advantages, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert core.masked_var(adv.advantages, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert torch.equal(adv.advantages[~mask], torch.zeros(int((~mask).sum())))


def test_a_non_finite_value_leaves_the_advantages_unwhitened_so_it_spreads_to_no_other_row():
    values = [row[:] for row in VALUES]
    values[2][0] = float("inf")
    adv = ppo.PPO(ppo_cfg(whiten_advantages=True)).advantages(scored(values=values))
    raw, _, _ = naive_advantages(0.1, 0.9, 0.8)
    assert torch.allclose(adv.advantages[:2], raw[:2], atol=1e-6)  # as computed, not whitened


def test_whitened_rewards_keep_their_mean_and_reach_gae():
    adv = ppo.PPO(ppo_cfg(whiten_rewards=True)).advantages(scored())
    batch = scored()
    kl = torch.where(batch.mask, batch.rollout.logprobs - batch.rollout.ref_logprobs, torch.zeros(()))
    rewards, _ = core.token_rewards(batch.scores, kl, batch.mask, 0.1)
    expected, returns = core.gae(core.whiten(rewards, batch.mask, shift_mean=False), batch.rollout.values, batch.mask,
                                 0.9, 0.8)
    assert torch.allclose(adv.advantages, expected, atol=1e-6) and torch.allclose(adv.returns, returns, atol=1e-6)
    plain, _, _ = naive_advantages(0.1, 0.9, 0.8)
    assert not torch.allclose(adv.advantages, plain, atol=1e-3)


def test_the_masked_truncation_count_is_logged_only_with_mask_truncated_completions():
    batch = scored()
    batch.rollout.ended_with_eos = torch.tensor([True, False, True])
    adv = ppo.PPO(ppo_cfg(mask_truncated_completions=True)).advantages(batch)
    assert adv.metrics["completions/masked_truncated"] == 1  # rows left out of the loss


def logprob_args(batch, shift):
    return (batch.rollout.logprobs + torch.tensor(shift)).requires_grad_(True)


def share_of(batch, tokens):
    return StepShare(tokens=tokens, rows=3, rollout_tokens=tokens, response_length=WIDTH, steps=1,
                     index=torch.arange(3))


@pytest.mark.parametrize("part", ["all", "policy", "value"])
def test_the_loss_is_the_clipped_surrogate_plus_vf_coef_times_the_clipped_value_loss_over_the_step_tokens(part):
    cfg = ppo_cfg(vf_coef=0.3, cliprange=0.1, cliprange_value=0.05)
    unit, batch = ppo.PPO(cfg), scored()
    adv = unit.advantages(batch)
    idx = torch.arange(3)
    logprobs = batch.rollout.logprobs + 0.3 * torch.tensor([[1.0, -1.0, 0.0], [0.5, 0.0, -0.5], [-1.0, 0.0, 0.0]])
    values = batch.rollout.values + torch.tensor([[0.2, -0.1, 0.0], [-0.3, 0.02, 0.1], [0.5, 0.0, 0.0]])
    tokens = float(batch.mask.sum())
    loss, stats = unit.loss(logprobs, values, batch, adv, idx, share_of(batch, 2 * tokens), part)
    pg, _ = core.ppo_policy_loss(logprobs, batch.rollout.logprobs, adv.advantages, batch.mask, 0.1)
    vf, vf_stats = core.clipped_value_loss(values, batch.rollout.values, adv.returns, batch.mask, 0.05)
    expected = {"all": pg + 0.3 * vf, "policy": pg, "value": 0.3 * vf}[part] * 0.5  # half the step's tokens
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert ("loss/policy" in stats) == (part != "value") and ("loss/value" in stats) == (part != "policy")
    if part != "policy":
        assert stats["val/clipfrac"].item() == pytest.approx(vf_stats["clipfrac"].item()) and vf_stats["clipfrac"] > 0
    if part != "value":
        ratio = torch.exp(logprobs - batch.rollout.logprobs)
        assert stats["ratio_var"].item() == pytest.approx(core.masked_var(ratio, batch.mask).item(), abs=1e-6)
        assert stats["policy/clipfrac"] > 0


def test_a_micro_batch_of_some_rows_in_another_order_reads_those_rows_everywhere():
    cfg = ppo_cfg(vf_coef=0.3, cliprange=0.1, cliprange_value=0.05)
    unit, batch = ppo.PPO(cfg), scored()
    adv = unit.advantages(batch)
    idx = torch.tensor([2, 0])
    logprobs = batch.rollout.logprobs[idx] + torch.tensor([[0.3, 0.0, 0.0], [-0.3, 0.2, 0.0]])
    values = batch.rollout.values[idx] + torch.tensor([[0.4, 0.0, 0.0], [-0.2, 0.1, 0.0]])
    loss, _ = unit.loss(logprobs, values, batch, adv, idx, share_of(batch, 10.0))
    mask = batch.mask[idx]
    pg, _ = core.ppo_policy_loss(logprobs, batch.rollout.logprobs[idx], adv.advantages[idx], mask, 0.1)
    vf, _ = core.clipped_value_loss(values, batch.rollout.values[idx], adv.returns[idx], mask, 0.05)
    assert loss.item() == pytest.approx(((pg + 0.3 * vf) * float(mask.sum()) / 10.0).item(), abs=1e-6)


def test_the_entropy_bonus_is_minus_coef_times_the_step_s_mean_entropy_and_off_in_the_warm_up():
    entropy = torch.tensor([[1.0, 2.0, 50.0], [0.5, 0.5, 1.0], [3.0, 50.0, 50.0]])  # 50: past the mask
    idx = torch.tensor([0, 2])
    for warmup in (0, 1):
        plain, bonus = ppo.PPO(ppo_cfg(value_warmup_rollouts=warmup)), ppo.PPO(
            ppo_cfg(entropy_coef=0.1, value_warmup_rollouts=warmup))
        batch = scored()
        losses = []
        for unit in (plain, bonus):
            adv = unit.advantages(batch)
            logprobs = batch.rollout.logprobs[idx] + 0.1
            losses.append(unit.loss(logprobs, batch.rollout.values[idx], batch, adv, idx, share_of(batch, 6.0),
                                    entropy=entropy[idx])[0].item())
        # rows 0 and 2: entropies 1 + 2 + 3 over the step's 6 real tokens (rows 0, 1, 2: 2 + 3 + 1)
        expected = 0.0 if warmup else -0.1 * 6.0 / 6.0
        assert losses[1] - losses[0] == pytest.approx(expected, abs=1e-6)


def test_a_critic_warm_up_rollout_trains_the_value_alone_then_the_policy_joins():
    cfg = ppo_cfg(value_warmup_rollouts=1, vf_coef=0.5)
    unit, batch = ppo.PPO(cfg), scored()
    adv = unit.advantages(batch)
    idx, share = torch.arange(3), share_of(batch, float(batch.mask.sum()))
    values = batch.rollout.values + 0.1
    logprobs = batch.rollout.logprobs.clone().requires_grad_(True)
    loss, stats = unit.loss(logprobs, values, batch, adv, idx, share)
    vf, _ = core.clipped_value_loss(values, batch.rollout.values, adv.returns, batch.mask, cfg.cliprange_value)
    assert loss.item() == pytest.approx(0.5 * vf.item(), abs=1e-6) and "loss/policy" in stats
    loss.backward()
    assert logprobs.grad is None or torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    assert unit.step_parts() == ("all",)
    unit.after_update(batch)
    assert unit.updates == 1
    logprobs = batch.rollout.logprobs.clone().requires_grad_(True)
    loss, _ = unit.loss(logprobs, values, batch, adv, idx, share)
    loss.backward()
    assert logprobs.grad.abs().sum() > 0


def test_after_policy_steps_the_value_alone_in_the_warm_up_then_policy_then_value():
    unit = ppo.PPO(ppo_cfg(value_mode="separate", value_step="after_policy", value_warmup_rollouts=2))
    parts = []
    for _ in range(3):
        parts.append(unit.step_parts())
        unit.advantages(scored())
        unit.after_update(scored())
    assert parts == [("value",), ("value",), ("policy", "value")]


def test_the_kl_controller_follows_the_valid_rows_summed_kl_over_the_batch_size():
    cfg = ppo_cfg(adaptive_kl=True, kl_target=0.1, kl_horizon=30, batch_size=3)
    unit, batch = ppo.PPO(cfg), scored(valid=(True, False, True))
    unit.advantages(batch)
    unit.after_update(batch)
    kl = [sum(a - b for a, b in zip(LOGPROBS[r][:LENGTHS[r]], REF[r][:LENGTHS[r]])) for r in (0, 2)]
    reference = core.AdaptiveKLController(0.1, 0.1, 30)
    reference.update(sum(kl) / 2, 3)
    assert unit.kl_ctl.value == pytest.approx(reference.value) and unit.kl_ctl.value != 0.1
    fixed = ppo.PPO(ppo_cfg(kl_coef=0.2))
    fixed.advantages(batch)
    fixed.after_update(batch)
    assert fixed.kl_ctl.value == 0.2 and isinstance(fixed.kl_ctl, core.FixedKLController)


def test_state_round_trip_keeps_the_kl_coefficient_and_the_rollouts_trained():
    cfg = ppo_cfg(adaptive_kl=True, kl_target=0.1, kl_horizon=30, value_warmup_rollouts=3)
    unit = ppo.PPO(cfg)
    for _ in range(2):
        unit.advantages(scored())
        unit.after_update(scored())
    resumed = ppo.PPO(cfg)
    resumed.load_state_dict(unit.state_dict())
    assert resumed.kl_ctl.value == unit.kl_ctl.value != 0.1 and resumed.updates == 2
    adaptive = ppo_cfg(use_adaptive_entropy=True)
    measured = ppo.PPO(adaptive)
    measured.entropy.adaptive.update(0.05)
    again = ppo.PPO(adaptive)
    again.load_state_dict(measured.state_dict())
    assert again.entropy.adaptive.state_dict() == measured.entropy.adaptive.state_dict()
    assert again.entropy.adaptive.entropy == 0.05
    older = {k: v for k, v in unit.state_dict().items() if k != "updates"}  # before the warm-up existed
    resumed.load_state_dict(older)
    assert resumed.updates == 0


def test_the_value_head_takes_its_own_learning_rate_or_the_policy_s():
    head, trunk = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)
    extra = torch.nn.Parameter(torch.zeros(1))
    roles = SimpleNamespace(value_head=head, value_model=None,
                            trainable_parameters=lambda: [*trunk.parameters(), extra, *head.parameters()])
    groups = ppo.PPO(ppo_cfg(learning_rate=1e-5, value_head_learning_rate=3e-3)).param_groups(roles)
    assert [id(p) for p in groups[0]["params"]] == [id(trunk.weight), id(trunk.bias), id(extra)]
    assert [id(p) for p in groups[1]["params"]] == [id(head.weight), id(head.bias)]
    assert groups[1]["lr"] == 3e-3 and "lr" not in groups[0]
    assert ppo.PPO(ppo_cfg(learning_rate=1e-5, value_head_learning_rate=0.0)).param_groups(roles)[1]["lr"] == 1e-5
    separate = SimpleNamespace(value_head=None, value_model=SimpleNamespace(value_head=head))
    assert ppo.value_head_parameters(separate) == list(head.parameters())
    head.bias.requires_grad_(False)
    assert ppo.value_head_parameters(separate) == [head.weight]
    assert ppo.value_head_parameters(SimpleNamespace(value_head=None, value_model=None)) == []


def test_ratio_variance_of_one_real_token_is_zero():
    one = torch.tensor([[True, False]])
    assert ppo.masked_var_of(torch.tensor([[1.7, 5.0]]), one).item() == 0.0
    assert ppo.masked_var_of(torch.tensor([[1.0, 3.0]]), torch.tensor([[True, True]])).item() == pytest.approx(2.0)  # unbiased


NO_LORA = ("value_mode=lora_adapter needs a LoRA policy", "--value_mode", "set --lora_r 8 (or more)")
NOT_SEPARATE = ("value_step=after_policy steps a separate value model after the policy; value_mode=shared trains the "
                "critic on the policy's own weights", "--value_step", "use --value_mode separate, or --value_step joint")
NEGATIVE_CRITIC = ("value_head_learning_rate and value_warmup_rollouts must be >= 0",
                   "--value_head_learning_rate / --value_warmup_rollouts", "0 = learning_rate / no warm-up")
NO_TARGET = ("adaptive_kl needs kl_target > 0 and kl_horizon > 0", "--kl_target / --kl_horizon", None)


@pytest.mark.parametrize("fields, what, where, fix", [
    ({"num_ppo_epochs": 0}, "num_ppo_epochs must be > 0, got 0", "--num_ppo_epochs", None),
    ({"adaptive_kl": True, "kl_target": 0.0}, *NO_TARGET),
    ({"adaptive_kl": True, "kl_horizon": 0}, *NO_TARGET),
    ({"value_head_learning_rate": -1e-3}, *NEGATIVE_CRITIC),
    ({"value_warmup_rollouts": -1}, *NEGATIVE_CRITIC),
    ({"value_mode": "lora_adapter", "lora_r": 0}, *NO_LORA),
    ({"value_step": "after_policy", "value_mode": "shared"}, *NOT_SEPARATE),
])
def test_what_ppo_refuses_names_the_flag_and_the_fix(fields, what, where, fix):
    with pytest.raises(UserInputError) as refused:
        ppo.PPO(ppo_cfg(**fields))
    assert (refused.value.what, refused.value.where, refused.value.fix) == (what, where, fix)


def test_what_ppo_accepts_at_the_edges():
    ppo.PPO(ppo_cfg(num_ppo_epochs=1, kl_target=0.0, kl_horizon=0))  # the targets are read only when adaptive
    ppo.PPO(ppo_cfg(adaptive_kl=True, kl_target=0.01, kl_horizon=1))
    ppo.PPO(ppo_cfg(value_head_learning_rate=0.0, value_warmup_rollouts=0, value_mode="lora_adapter", lora_r=1))
    ppo.PPO(ppo_cfg(value_mode="separate", value_step="after_policy"))
    unit = ppo.PPO(ppo_cfg(num_ppo_epochs=3))
    assert unit.epochs == 3 and unit.entropy_in_loss is False and unit.updates == 0
    assert ppo.PPO(ppo_cfg(entropy_coef=0.01)).entropy_in_loss is True


@pytest.mark.parametrize("warmup, episodes, batch_size, warns", [
    (2, 6, 3, True),  # 2 updates, both critic-only
    (2, 7, 3, True),  # 7 // 3 = 2 updates: the remainder is no update
    (1, 6, 3, False),
    (2, 3, 1, False),  # 3 updates of 1 prompt
])
def test_a_warm_up_as_long_as_the_run_is_warned_about(caplog, warmup, episodes, batch_size, warns):
    with caplog.at_level("WARNING", logger="rlhflab"):
        ppo.PPO(ppo_cfg(value_warmup_rollouts=warmup, total_episodes=episodes, batch_size=batch_size))
    messages = [r.getMessage() for r in caplog.records]
    expected = f"value_warmup_rollouts {warmup} >= the run's {episodes // batch_size} updates: the policy never trains"
    assert messages == ([expected] if warns else [])


def test_check_config_refuses_what_the_online_checks_and_the_unit_refuse():
    with pytest.raises(UserInputError, match="num_ppo_epochs must be > 0"):
        ppo.check_config(ppo_cfg(num_ppo_epochs=0))
    with pytest.raises(UserInputError, match="num_mini_batches"):
        ppo.check_config(ppo_cfg(batch_size=4, num_mini_batches=3))
    ppo.check_config(ppo_cfg(batch_size=4, num_mini_batches=2, gradient_accumulation_steps=1))


def test_after_policy_is_refused_under_several_processes(monkeypatch):
    monkeypatch.setattr(ppo.parallel, "launched_ranks", lambda: (0, 2))
    with pytest.raises(UserInputError) as refused:
        ppo.check_value_step(ppo_cfg(value_mode="separate", value_step="after_policy"))
    assert (refused.value.what, refused.value.where, refused.value.fix) == (
        "value_step=after_policy runs in one process; this run has 2", "--value_step",
        "use --value_step joint with several processes")
    monkeypatch.setattr(ppo.parallel, "launched_ranks", lambda: (0, 1))
    ppo.check_value_step(ppo_cfg(value_mode="separate", value_step="after_policy"))

