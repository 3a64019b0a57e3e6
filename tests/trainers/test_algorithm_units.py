"""The algorithm units' losses and advantages on hand-made batches, no model: the numbers that a swapped ratio
level, a clip bound, a normaliser or a dropped argument would change (issue 36; docs/mutation.md lists
the mutants each test kills)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.config import GRPOConfig, OnlineDPOConfig, PPOConfig, REINFORCEConfig, RLOOConfig
from rlhflab.trainers import grpo, online_dpo, ppo, reinforce, rloo
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare


def batch_of(lengths, per_response, old=None, ref=None, width: int = 3, group: int = 2):
    """A scored batch and its advantages: rows of `lengths` real tokens, (B,) advantage on each real token;
    old / ref log-probs (B, T), zero unless given; scores 0, every row valid, KL 0."""
    lengths = torch.tensor(lengths)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    rows = len(lengths)
    old = torch.zeros(rows, width) if old is None else torch.tensor(old)
    ref = old if ref is None else torch.tensor(ref)
    rollout = SimpleNamespace(response_mask=mask, logprobs=old, ref_logprobs=ref, batch_size=rows,
                              entropy=torch.zeros(rows, width), ended_with_eos=torch.ones(rows, dtype=torch.bool))
    batch = ScoredRollout(rollout, torch.zeros(rows), torch.ones(rows, dtype=torch.bool), mask,
                          torch.zeros(rows, width), group)
    advantages = torch.where(mask, torch.tensor(per_response).unsqueeze(1), torch.zeros(()))
    return batch, Advantages(advantages, None, {})


def share_of(batch, tokens=None, rollout_tokens=None, steps: int = 1, response_length: int = 3) -> StepShare:
    real = float(batch.mask.sum())
    return StepShare(tokens=real if tokens is None else tokens, rows=batch.rollout.batch_size,
                     rollout_tokens=real if rollout_tokens is None else rollout_tokens,
                     response_length=response_length, steps=steps, index=torch.arange(batch.rollout.batch_size))


def loss_and_grad(algorithm, batch, adv, logprobs, share=None):
    logprobs = torch.tensor(logprobs, dtype=torch.float32).requires_grad_(True)
    idx = torch.arange(batch.rollout.batch_size)
    loss, stats = algorithm.loss(logprobs, None, batch, adv, idx, share or share_of(batch))
    loss.backward()
    return loss.detach(), logprobs.grad, stats


def grpo_cfg(**fields) -> GRPOConfig:
    return GRPOConfig(model="unused", num_generations=2, **{"beta": 0.0, **fields})


def rloo_cfg(**fields) -> RLOOConfig:
    return RLOOConfig(model="unused", num_generations=2, **fields)


# --- RLOO: one ratio per response, the whole sequence's ------------------------------------------------------


def test_rloo_gradient_at_ratio_one_is_minus_a_over_rows_on_every_real_token_whatever_the_length():
    # loss = sum_i -rho_i A_i / rows with log rho_i = sum_t (logp - old): d/d logp_t = -A_i / rows on each token
    # (a token mean of the log-ratio, "sequence_mean", would give -A_i / (rows x length_i))
    old = [[-0.5, -1.0, -2.0]] * 4  # the ratio is exp(logp - old) = 1
    batch, adv = batch_of([3, 1, 2, 3], [2.0, -1.0, 0.5, 1.5], old=old)
    loss, grad, stats = loss_and_grad(rloo.RLOO(rloo_cfg()), batch, adv, old)
    want = torch.where(batch.mask, torch.tensor([-0.5, 0.25, -0.125, -0.375]).unsqueeze(1), torch.zeros(()))
    torch.testing.assert_close(grad, want)
    assert loss.item() == pytest.approx(-(2.0 - 1.0 + 0.5 + 1.5) / 4)
    assert "kl" not in stats and stats["ratio_mean"].item() == 1.0


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_ratio_075_with_negative_advantages_is_clipped_low_at_eps_020_not_eps_high_028(algorithm):
    # rho = 0.75 < 1 - 0.2 with A < 0: the clipped term 0.8 A is the minimum, so no gradient, every token counted
    # in clip_ratio/low_mean (with 1 - 0.28 = 0.72 as the low bound rho would be inside and the gradient -A / ...)
    log = math.log(0.75)
    if algorithm == "grpo":  # per token: every token's ratio is 0.75
        unit, logprobs = grpo.GRPO(grpo_cfg(epsilon=0.2, epsilon_high=0.28)), [[log, log, log], [log, log, 0.0]]
    else:  # the sequence's: its log-ratios sum to log 0.75
        unit, logprobs = rloo.RLOO(rloo_cfg(epsilon=0.2, epsilon_high=0.28)), [[log, 0.0, 0.0], [0.0, log, 0.0]]
    batch, adv = batch_of([3, 2], [-1.0, -2.0])
    loss, grad, stats = loss_and_grad(unit, batch, adv, logprobs)
    assert torch.equal(grad, torch.zeros(2, 3))
    # GRPO's default dapo: the tokens' sum over the 5 tokens; RLOO: each response's mean over the 2 responses
    want = (0.8 * 1.0 * 3 + 0.8 * 2.0 * 2) / 5 if algorithm == "grpo" else (0.8 * 1.0 + 0.8 * 2.0) / 2
    assert loss.item() == pytest.approx(want)
    assert stats["clip_ratio/low_mean"].item() == 1.0 and stats["clip_ratio/high_mean"].item() == 0.0
    assert stats["clip_ratio/region_mean"].item() == 1.0
    assert stats["ratio_min"].item() == pytest.approx(0.75) and stats["ratio_max"].item() == pytest.approx(0.75)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_ratio_125_with_positive_advantages_is_inside_eps_high_028(algorithm):
    # 1.2 < 1.25 < 1.28: clip-higher leaves it alone (the gradient flows, no high clip); at 1.3 it is clipped
    make = (lambda: grpo.GRPO(grpo_cfg(epsilon=0.2, epsilon_high=0.28))) if algorithm == "grpo" else (
        lambda: rloo.RLOO(rloo_cfg(epsilon=0.2, epsilon_high=0.28)))
    batch, adv = batch_of([1, 1], [1.0, 1.0])
    loss, grad, stats = loss_and_grad(make(), batch, adv, [[math.log(1.25), 0, 0], [math.log(1.3), 0, 0]])
    assert grad[0, 0].item() == pytest.approx(-1.25 / 2) and grad[1, 0].item() == 0.0
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2)
    assert stats["clip_ratio/high_mean"].item() == 0.5 and stats["clip_ratio/low_mean"].item() == 0.0


def test_clip_flags_count_no_token_with_a_zero_advantage():
    # A = 0: neither clip is the active term (TRL counts A < 0 low, A > 0 high); common in GRPO (a group all alike)
    batch, adv = batch_of([2, 2], [0.0, 0.0])
    _, _, stats = loss_and_grad(grpo.GRPO(grpo_cfg()), batch, adv, [[math.log(0.5), math.log(0.5), 0], [1.0, 1.0, 0]])
    assert stats["clip_ratio/low_mean"].item() == 0.0 and stats["clip_ratio/high_mean"].item() == 0.0


# --- GRPO: token or sequence (GSPO) ratios, loss types -----------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_importance_sampling_level_token_and_sequence_by_hand(level):
    # log-ratios 0.1, -0.1, 0 sum to 0: GSPO's sequence ratio is 1 on each token, the token ratios are e^0.1, e^-0.1, 1
    # loss_type grpo: d loss / d logp_t = -A rho / (length x rows); for GSPO rho = 1 and the chain rule gives 1/length
    batch, adv = batch_of([3, 3], [1.0, 1.0], old=[[-1.0, -1.0, -1.0]] * 2)
    unit = grpo.GRPO(grpo_cfg(importance_sampling_level=level, loss_type="grpo", epsilon=10.0))
    _, grad, stats = loss_and_grad(unit, batch, adv, [[-0.9, -1.1, -1.0], [-1.0, -1.0, -1.0]])
    rho = [math.exp(0.1), math.exp(-0.1), 1.0] if level == "token" else [1.0, 1.0, 1.0]
    torch.testing.assert_close(grad[0], torch.tensor([-r / 6 for r in rho]))
    assert stats["ratio_max"].item() == pytest.approx(max(rho))


@pytest.mark.parametrize("loss_type, divisor", [("dapo", 12 / 2), ("bnpo", 5), ("dr_grpo", 2 * 3)])
def test_a_step_share_with_5_tokens_of_a_12_token_rollout_in_2_steps(loss_type, divisor):
    # every real token's loss is -A = -1 at ratio 1: the sum -5 over the step's tokens divided by DAPO's rollout
    # tokens per step (12 / 2 = 6), BNPO's step tokens (5) or Dr. GRPO's rows x max length (2 x 3)
    batch, adv = batch_of([3, 2], [1.0, 1.0])
    share = share_of(batch, tokens=5, rollout_tokens=12, steps=2)
    loss, grad, stats = loss_and_grad(grpo.GRPO(grpo_cfg(loss_type=loss_type)), batch, adv, torch.zeros(2, 3).tolist(),
                                      share)
    assert loss.item() == pytest.approx(-5 / divisor)
    torch.testing.assert_close(grad, torch.where(batch.mask, torch.full((2, 3), -1 / divisor), torch.zeros(())))
    assert stats["loss"].item() == pytest.approx(-5 / divisor)  # logged x rows / micro-batch rows = 2 / 2


def test_grpo_kl_term_is_beta_times_k3_per_token_and_logged():
    # ratio 1, A = 0: the loss is beta x the token mean of k3 = exp(ref - logp) - (ref - logp) - 1
    batch, adv = batch_of([2, 1], [0.0, 0.0], ref=[[0.5, -0.5, 0.0], [1.0, 0.0, 0.0]])
    loss, _, stats = loss_and_grad(grpo.GRPO(grpo_cfg(beta=0.1, loss_type="bnpo")), batch, adv,
                                   torch.zeros(2, 3).tolist())
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5, 1.0)]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 3, rel=1e-5)
    assert stats["kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    # with the KL in the reward instead, no KL term in the loss
    loss, _, _ = loss_and_grad(grpo.GRPO(grpo_cfg(beta=0.1, kl_in_reward=True, loss_type="bnpo")), batch, adv,
                               torch.zeros(2, 3).tolist())
    assert loss.item() == 0.0


# --- REINFORCE: -A x ratio, a token mean over the step -------------------------------------------------------


def reinforce_batch(scores, lengths, width: int = 3):
    batch, _ = batch_of(lengths, [0.0] * len(lengths), width=width, group=1)
    return ScoredRollout(batch.rollout, torch.tensor(scores), batch.valid, batch.mask, batch.kl, 1)


@pytest.mark.parametrize("normalize", [False, True])
def test_reinforce_advantages_and_loss_by_hand_with_and_without_normalize_advantages(normalize):
    # scores 1, 3 on rows of 2 and 1 tokens, no KL: reward-to-go [1, 1] and [3]; batch-mean baseline 2 ->
    # A = [-1, -1], [1]. Whitened: mean -1/3, unbiased var 4/3 -> [-1, -1, 1] -> (x + 1/3) / sqrt(4/3)
    batch = reinforce_batch([1.0, 3.0], [2, 1])
    unit = reinforce.REINFORCE(REINFORCEConfig(model="unused", normalize_advantages=normalize))
    adv = unit.advantages(batch)
    real = [-1.0, -1.0, 1.0]
    if normalize:
        real = [(a + 1 / 3) / math.sqrt(4 / 3) for a in real]
    want = torch.tensor([[real[0], real[1], 0.0], [real[2], 0.0, 0.0]])
    torch.testing.assert_close(adv.advantages, want)
    assert adv.metrics["baseline"] == pytest.approx(2.0) and adv.metrics["objective/rlhf_reward"] == pytest.approx(2.0)
    assert adv.metrics["reward"] == pytest.approx(2.0) and adv.metrics["reward_std"] == pytest.approx(math.sqrt(2))
    # loss: sum over the step's real tokens of -A x ratio, divided by its 3 tokens; d/d logp_t = -A_t / 3
    loss, grad, stats = loss_and_grad(unit, batch, adv, torch.zeros(2, 3).tolist())
    assert loss.item() == pytest.approx(-sum(real) / 3, abs=1e-7)
    torch.testing.assert_close(grad, -want / 3)
    assert stats["ratio_mean"].item() == 1.0


def test_reinforce_loss_divides_by_the_steps_tokens_and_logs_per_micro_batch():
    batch, adv = batch_of([2, 1], [2.0, 4.0], old=[[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]], group=1)
    unit = reinforce.REINFORCE(REINFORCEConfig(model="unused"))
    share = share_of(batch, tokens=6)  # the step holds 6 tokens, this micro-batch 3 of them
    logprobs = torch.tensor([[math.log(2.0) - 1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]], requires_grad=True)
    loss, stats = unit.loss(logprobs, None, batch, adv, torch.arange(2), share)
    # -(2 x 2 + 2 x 1 + 4 x 1) / 6
    assert loss.item() == pytest.approx(-10 / 6)
    assert stats["loss"].item() == pytest.approx(-10 / 6)
    assert stats["ratio_mean"].item() == pytest.approx(4 / 3)


# --- every argument reaches the loop -------------------------------------------------------------------------


@pytest.mark.parametrize("module, config, unit", [
    (grpo, grpo_cfg, "GRPO"), (rloo, rloo_cfg, "RLOO"), (reinforce, lambda: REINFORCEConfig(model="unused"), "REINFORCE"),
    (ppo, lambda: PPOConfig(model="unused"), "PPO"),
    (online_dpo, lambda: OnlineDPOConfig(model="unused", batch_size=8, num_generations=4), "OnlineDPO")])
def test_train_hands_the_run_reward_monitor_and_given_to_the_loop(monkeypatch, module, config, unit):
    seen = {}
    monkeypatch.setattr(module, "train_online", lambda *args: seen.setdefault("args", args))
    run, reward_fn, monitor, given = object(), object(), object(), object()
    cfg = config()
    module.train(cfg, run, reward_fn, monitor, given)
    got = seen["args"]
    assert got[0] is cfg and type(got[1]).__name__ == unit and got[1].cfg is cfg
    assert got[2:] == (run, reward_fn, monitor, given)
