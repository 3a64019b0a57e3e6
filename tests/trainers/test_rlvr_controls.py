"""Issue 37's controls on the loss, in the algorithms and the loop: truncated answers left out of the loss (and kept
in their group's baseline), the top-entropy token mask, the entropy bonus (fixed and adaptive, its state resumed
exactly), DAPO's overlong penalty with the missing-EOS penalty; each flag trains a tiny run."""

import dataclasses
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from critic_free import (GROUPS_WITH_FAILURES, check_accumulation_equivalence, grouped_rollout, hand_batch,
                         spread_score, tiny, update_rows, whole_step)
from runcheck import assert_same_weights, metrics
from safetensors.torch import load_file
from tinyhf import save_eos_prone_model, save_suite_model

from rlhflab import tasks
from rlhflab.checkpoint import complete_checkpoints
from rlhflab.checkpoint.folder import load_checkpoint
from rlhflab.config import GRPOConfig, OnlineDPOConfig, PPOConfig, REINFORCEConfig, RLOOConfig
from rlhflab.core import top_entropy_mask
from rlhflab.errors import UserInputError
from rlhflab.trainers import grpo, online_dpo, ppo, reinforce, rloo
from rlhflab.trainers.online.algorithm import Advantages, StepShare
from rlhflab.trainers.online.controls import truncation_masked
from rlhflab.trainers.online.loop import micro_losses, scored_batch, update_passes
from rlhflab.trainers.online.setup import build_roles

GROUP_METHODS = {  # the critic-free methods with a group baseline: (config class, algorithm class, own fields)
    "grpo": (GRPOConfig, grpo.GRPO, {"num_generations": 4, "beta": 0.1}),
    "rloo": (RLOOConfig, rloo.RLOO, {"num_generations": 4, "beta": 0.1}),
    "reinforce": (REINFORCEConfig, reinforce.REINFORCE, {"num_generations": 4, "baseline": "leave_one_out"}),
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def eos_prone_dir(policy_dir, tmp_path_factory):
    return save_eos_prone_model(policy_dir, tmp_path_factory.mktemp("eos_prone"))


def config(method: str, policy_dir, **overrides):
    cls, _, own = GROUP_METHODS[method]
    return tiny(cls, policy_dir, **{**own, **overrides})


def with_ends(batch, ended: list[bool]):
    """A hand batch whose rows ended with EOS or not (hand_batch's all end)."""
    rollout = SimpleNamespace(**{**vars(batch.rollout), "ended_with_eos": torch.tensor(ended)})
    return dataclasses.replace(batch, rollout=rollout)


# --- truncated answers out of the loss -----------------------------------------------------------------------


@pytest.mark.parametrize("method", GROUP_METHODS)
def test_truncated_answers_stay_in_their_groups_baseline_and_are_counted(policy_dir, method):
    """Masking does not touch the advantages: a cut answer's score is in its group's mean, so its siblings'
    advantages are the ones without masking; the metrics count it."""
    batch = with_ends(hand_batch(**GROUPS_WITH_FAILURES), [True, False, True, True, False, True, True, False])
    _, algorithm_class, _ = GROUP_METHODS[method]
    plain = algorithm_class(config(method, policy_dir)).advantages(batch)
    masked = algorithm_class(config(method, policy_dir, mask_truncated_completions=True)).advantages(batch)
    assert torch.equal(plain.advantages, masked.advantages)
    assert plain.advantages[1].abs().sum() > 0  # row 1 (cut) has an advantage of its own, which the loss drops
    assert masked.metrics["completions/masked_truncated"] == 2  # rows 1 and 4; row 7 is not valid (not scored)
    assert "completions/masked_truncated" not in plain.metrics
    if method != "reinforce":
        assert masked.metrics["completions/clipped_ratio"] == 3 / 8  # TRL's: every response, valid or not
    # the loss's mask loses rows 1 and 4 only
    narrowed = truncation_masked(batch, True)
    assert torch.equal(narrowed.mask, batch.mask & torch.tensor([1, 0, 1, 1, 0, 1, 1, 1]).bool().unsqueeze(1))
    assert torch.equal(narrowed.valid, batch.valid) and torch.equal(narrowed.kl, batch.kl)
    assert truncation_masked(batch, False) is batch


@pytest.mark.parametrize("method", GROUP_METHODS)
def test_a_truncated_completion_contributes_exactly_zero_gradient(policy_dir, method):
    """With --mask_truncated_completions a cut answer is out of the loss: NaN in its old and reference log-probs
    and inf in its advantages leave the loss and every parameter's gradient bit for bit as they were, and the
    gradient in its log-probs is exactly 0 (the others' is not)."""
    cfg = config(method, policy_dir, mask_truncated_completions=True)
    _, algorithm_class, _ = GROUP_METHODS[method]
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=4)
    cut = torch.tensor([False, True, False, False, False, False, True, False])
    rollout = dataclasses.replace(rollout, ended_with_eos=~cut, policy_forward=None)
    gen = torch.Generator().manual_seed(1)
    old = rollout.logprobs + 0.3 * torch.randn(rollout.logprobs.shape, generator=gen)  # ratios != 1
    ref = rollout.ref_logprobs - 0.2 * torch.rand(rollout.logprobs.shape, generator=gen)  # KL != 0
    clean = dataclasses.replace(rollout, logprobs=old, ref_logprobs=ref)
    rows = cut.unsqueeze(1)
    nan, inf = torch.tensor(float("nan")), torch.tensor(float("inf"))
    garbage = dataclasses.replace(clean, logprobs=torch.where(rows, nan, old), ref_logprobs=torch.where(rows, nan, ref))
    valid = torch.ones(8, dtype=torch.bool)
    scores = torch.randn(8, generator=gen)
    batch = scored_batch(clean, scores, valid, 4)
    adv = algorithm_class(cfg).advantages(batch)
    noisy = dataclasses.replace(adv, advantages=torch.where(rows, inf, adv.advantages))
    idx = torch.arange(8)
    results = []
    for one, advantages in ((clean, adv), (garbage, noisy)):
        narrowed = truncation_masked(scored_batch(one, scores, valid, 4), True)
        share = whole_step(narrowed, cfg)
        loss, _ = micro_losses(algorithm_class(cfg), roles, narrowed, advantages, idx, share, cfg.temperature)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in roles.trainable_parameters()]))
        roles.policy.zero_grad(set_to_none=True)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.isfinite(loss_a) and loss_a != 0 and torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    narrowed = truncation_masked(scored_batch(garbage, scores, valid, 4), True)
    logprobs = (old + 0.1 * torch.randn(old.shape, generator=gen)).requires_grad_(True)
    loss, _ = algorithm_class(cfg).loss(logprobs, None, narrowed, noisy, idx, whole_step(narrowed, cfg))
    loss.backward()
    assert (logprobs.grad[cut] == 0).all() and torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~cut][rollout.response_mask[~cut]] != 0).any()


def test_the_update_passes_apply_the_mask(policy_dir):
    """update_passes with --mask_truncated_completions trains the weights that the narrowed batch trains without the
    flag, and not the ones of the whole batch (the advantages, formed before, are the same in all three)."""
    cfg = config("grpo", policy_dir, num_mini_batches=2, max_grad_norm=0.0)
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=4)
    ends = torch.tensor([True, False, True, True, True, True, False, True])
    rollout = dataclasses.replace(rollout, ended_with_eos=ends)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(2))
    batch = scored_batch(rollout, scores, torch.ones(8, dtype=torch.bool), 4)
    adv = grpo.GRPO(cfg).advantages(batch)

    def weights_after(one, masking: bool):
        fresh, _ = build_roles(cfg, critic=False)
        optimizer = torch.optim.SGD(fresh.trainable_parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        run_cfg = dataclasses.replace(cfg, mask_truncated_completions=masking)
        update_passes(grpo.GRPO(run_cfg), fresh, optimizer, scheduler, one, adv, run_cfg,
                      torch.Generator().manual_seed(0))
        return [p.detach().clone() for p in fresh.trainable_parameters()]

    masked = weights_after(batch, True)
    assert all(torch.equal(a, b) for a, b in zip(masked, weights_after(truncation_masked(batch, True), False)))
    assert any(not torch.equal(a, b) for a, b in zip(masked, weights_after(batch, False)))


# --- the top-entropy mask and the entropy bonus --------------------------------------------------------------


ENTROPY = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 0.0], [0.8, 0.4, 0.6], [2.0, 0.0, 0.0]])


def entropy_batch():
    """4 responses of 3, 2, 3, 1 tokens in 2 groups of 2, unequal scores, given entropies and old / reference
    log-probs (ratio 1, KL 0)."""
    batch = hand_batch([1.0, 0.0, 0.0, 2.0], [True] * 4, [3, 2, 3, 1], [[0.0] * 3] * 4, group=2)
    zeros = torch.zeros(4, 3)
    rollout = SimpleNamespace(**{**vars(batch.rollout), "entropy": torch.where(batch.mask, ENTROPY, zeros),
                                 "logprobs": zeros, "ref_logprobs": zeros, "values": zeros})
    return dataclasses.replace(batch, rollout=rollout)


PG_METHODS = {"grpo": (GRPOConfig, grpo.GRPO, {"num_generations": 2, "beta": 0.0}),
              "rloo": (RLOOConfig, rloo.RLOO, {"num_generations": 2, "beta": 0.0}),
              "reinforce": (REINFORCEConfig, reinforce.REINFORCE, {"num_generations": 2, "kl_coef": 0.0,
                                                                   "baseline": "leave_one_out"}),
              "ppo": (PPOConfig, ppo.PPO, {"value_warmup_rollouts": 0, "kl_coef": 0.0, "whiten_advantages": False})}


def pg_algorithm(method: str, policy_dir, **fields):
    cls, algorithm_class, own = PG_METHODS[method]
    return algorithm_class(tiny(cls, policy_dir, **{**own, **fields}))


def loss_of(algorithm, logprobs, batch, adv, share, entropy=None):
    values = torch.zeros(4, 3) if algorithm.critic else None
    extra = {"entropy": entropy} if entropy is not None else {}
    return algorithm.loss(logprobs, values, batch, adv, torch.arange(4), share, **extra)[0]


@pytest.mark.parametrize("method", PG_METHODS)
def test_top_entropy_quantile_trains_exactly_the_high_entropy_tokens(policy_dir, method):
    """rho 0.5 over the 9 real tokens (0.0 ... 2.0): the median 0.6 and above are kept; the policy-gradient term's
    gradient is 0 on every other token, and the mask is the rollout's top-entropy mask."""
    batch = entropy_batch()
    algorithm = pg_algorithm(method, policy_dir, top_entropy_quantile=0.5)
    adv = algorithm.advantages(batch)
    want = torch.tensor([[False, True, False], [False, True, False], [True, False, True], [True, False, False]])
    assert torch.equal(adv.policy_mask, want) and torch.equal(want, top_entropy_mask(ENTROPY, batch.mask, 0.5))
    assert adv.metrics["entropy/top_threshold"] == pytest.approx(0.6)
    if method == "ppo":  # GAE's advantages are per token: make them all non-zero to see the mask alone at work
        adv = dataclasses.replace(adv, advantages=torch.where(batch.mask, 1.0, 0.0), returns=torch.zeros(4, 3))
    logprobs = torch.zeros(4, 3, requires_grad=True)
    share = StepShare(tokens=9, rows=4, rollout_tokens=9, response_length=3, steps=1, index=torch.arange(4))
    loss_of(algorithm, logprobs, batch, adv, share).backward()
    if method == "rloo":  # one ratio per response (the sequence's): its term counts once per kept token, and its
        # gradient reaches every token of the response: -A_r x kept_r / real_r / responses, at ratio 1
        per_row = -adv.advantages[:, 0] * want.sum(1) / batch.mask.sum(1) / 4
        torch.testing.assert_close(logprobs.grad, torch.where(batch.mask, per_row.unsqueeze(1), 0.0))
        return
    assert (logprobs.grad[~want] == 0).all() and (logprobs.grad[want] != 0).all()


@pytest.mark.parametrize("method", PG_METHODS)
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_entropy_bonus_is_minus_coef_times_the_steps_mean_entropy(policy_dir, method, quantile):
    """The bonus adds -coef x sum(H over the kept tokens of the micro-batch) / (kept tokens of the step): its
    gradient in each kept token's entropy is -coef / that count, 0 elsewhere, and the rest of the loss is as it was."""
    batch = entropy_batch()
    coef = 0.2
    plain = pg_algorithm(method, policy_dir, top_entropy_quantile=quantile)
    bonus = pg_algorithm(method, policy_dir, top_entropy_quantile=quantile, entropy_coef=coef)
    assert bonus.entropy_in_loss and not plain.entropy_in_loss
    adv = bonus.advantages(batch)
    assert adv.metrics["entropy_coef"] == coef
    kept = batch.mask if quantile == 1.0 else adv.policy_mask
    # a micro-batch of rows 0-2 of a step that holds all 4: the step's kept tokens are the count
    share = StepShare(tokens=9, rows=4, rollout_tokens=9, response_length=3, steps=1, index=torch.arange(4))
    entropy = (ENTROPY + 1.0).requires_grad_(True)
    logprobs = torch.zeros(4, 3)
    with_bonus = loss_of(bonus, logprobs, batch, adv, share, entropy)
    without = loss_of(plain, logprobs, batch, dataclasses.replace(adv, metrics={}), share)
    steps_kept = kept.sum().item()
    want = -coef * (ENTROPY + 1.0)[kept].sum() / steps_kept
    assert (with_bonus - without).item() == pytest.approx(want.item(), rel=1e-6)
    with_bonus.backward()
    torch.testing.assert_close(entropy.grad, torch.where(kept, -coef / steps_kept, 0.0))


@pytest.mark.parametrize("method", ["grpo", "reinforce"])
def test_entropy_controls_give_the_same_weights_at_any_gradient_accumulation(policy_dir, method):
    """The bonus is a token mean over the step and the top-entropy mask is chosen over the whole update: 1 and 4
    micro-batches a step train the same weights."""
    cls, _, own = GROUP_METHODS[method]
    check_accumulation_equivalence(GROUP_METHODS[method][1], cls, policy_dir, group=4, **own, entropy_coef=0.05,
                                   top_entropy_quantile=0.5)


def test_adaptive_coefficient_moves_towards_the_target_and_is_in_the_algorithm_state(policy_dir):
    """The rollout's mean token entropy is 2.0 (hand_batch's): under a target of 3 the coefficient steps up and
    applies; over a target of 1 it steps down (clamped at 0) and the bonus is off. The state round-trips."""
    batch = hand_batch(**GROUPS_WITH_FAILURES)
    fields = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005)
    low = grpo.GRPO(config("grpo", policy_dir, entropy_target=3.0, **fields))
    coefs = [low.advantages(batch).metrics["entropy_coef"] for _ in range(3)]
    assert coefs == pytest.approx([0.015, 0.02, 0.025])
    high = grpo.GRPO(config("grpo", policy_dir, entropy_target=1.0, **fields))
    assert [high.advantages(batch).metrics["entropy_coef"] for _ in range(3)] == [0.0, 0.0, 0.0]  # not applied
    assert high.entropy.adaptive.value == 0.0  # 0.01 - 3 x 0.005, clamped
    again = grpo.GRPO(config("grpo", policy_dir, entropy_target=3.0, **fields))
    again.load_state_dict(low.state_dict())
    resumed, straight = again.advantages(batch).metrics["entropy_coef"], low.advantages(batch).metrics["entropy_coef"]
    assert resumed == straight == pytest.approx(0.03)
    # a fixed coefficient (or none) has no state: checkpoints without the controls are unchanged
    assert grpo.GRPO(config("grpo", policy_dir, entropy_coef=0.1)).state_dict() == {}
    assert "entropy_controller" in reinforce.REINFORCE(tiny(REINFORCEConfig, policy_dir, **fields)).state_dict()


def test_adaptive_entropy_is_checkpointed_and_a_resume_carries_it_on(policy_dir, tmp_path):
    """4 updates, a checkpoint after each; resumed from step-2 the run ends with the uninterrupted one's metrics
    (the coefficient goes on from 0.02, not from its start) and weights."""
    def cfg(out, **extra):
        return config("grpo", policy_dir, total_episodes=32, save_every=1, keep_last_n=0, output_dir=str(out),
                      use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=0.01, entropy_target=100.0,
                      headroom_samples=0, **extra)

    reference = tmp_path / "reference"
    grpo.train(cfg(reference), reward_fn=spread_score)
    coefs = [r["entropy_coef"] for r in update_rows(reference)]
    assert coefs == pytest.approx([0.01, 0.02, 0.03, 0.04])  # entropy ~5.5 nats < 100: up every update
    step2 = complete_checkpoints(reference / "checkpoints")[1]
    _, _, state = load_checkpoint(step2)
    assert state["algorithm"]["entropy_controller"]["value"] == pytest.approx(0.02)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    grpo.train(cfg(resumed, resume=str(resumed / "checkpoints" / step2.name)), reward_fn=spread_score)
    assert metrics(resumed) == metrics(reference)
    assert_same_weights(reference, resumed)


# --- each flag trains a tiny run --------------------------------------------------------------------------------


def changed_weights(start_dir, run) -> bool:
    start = load_file(str(Path(start_dir) / "model.safetensors"))
    end = load_file(str(Path(run.model_dir) / "model.safetensors"))
    return all(not torch.equal(start[k], end[k]) for k in start)


RUNS = {  # a flag, its method, the metric that shows it at work
    "grpo+mask_truncated": (GRPOConfig, grpo, {"num_generations": 4, "mask_truncated_completions": True},
                            "completions/masked_truncated"),
    "grpo+entropy+top": (GRPOConfig, grpo, {"num_generations": 4, "entropy_coef": 0.01, "top_entropy_quantile": 0.2},
                         "entropy/top_threshold"),
    "rloo+adaptive": (RLOOConfig, rloo, {"num_generations": 4, "use_adaptive_entropy": True, "entropy_target": 100.0},
                      "entropy_coef"),
    "reinforce+entropy+mask": (REINFORCEConfig, reinforce, {"entropy_coef": 0.01, "mask_truncated_completions": True,
                                                            "top_entropy_quantile": 0.5}, "entropy_coef"),
    "ppo+entropy+mask": (PPOConfig, ppo, {"entropy_coef": 0.01, "value_warmup_rollouts": 0,
                                          "mask_truncated_completions": True}, "completions/masked_truncated"),
}


@pytest.mark.parametrize("name", RUNS)
def test_each_control_trains_a_tiny_run(eos_prone_dir, tmp_path, name):
    cls, module, fields, shown = RUNS[name]
    cfg = tiny(cls, eos_prone_dir, output_dir=str(tmp_path / "run"), batch_size=16, total_episodes=16,
               headroom_samples=0, **fields)
    result = module.train(cfg, reward_fn=spread_score)
    [row] = update_rows(result.run_dir)
    loss = row.get("loss", row.get("loss/policy_avg"))
    assert math.isfinite(loss) and row["grad_norm"] > 0 and shown in row
    assert changed_weights(eos_prone_dir, result)  # every tensor of the policy moved
    if "mask_truncated_completions" in fields:  # some answers cut, some not (the EOS-prone policy)
        assert 0 < row["completions/masked_truncated"] < 16
        assert row["completions/masked_truncated"] == round(row["response/capped_share"] * 16)


def test_overlong_and_missing_eos_penalties_shape_a_runs_scores(eos_prone_dir, tmp_path):
    """Every reward 1, missing_eos_penalty 0.5, an overlong buffer as long as the cap (6) and factor 0.6: each score
    is 1 - 0.5 [no EOS] - 0.6 x length / 6, so their mean is 1 - 0.5 x capped_share - 0.1 x length_mean."""
    cfg = tiny(GRPOConfig, eos_prone_dir, output_dir=str(tmp_path / "run"), batch_size=16, total_episodes=16,
               num_generations=4, headroom_samples=0, missing_eos_penalty=0.5, overlong_buffer_len=6,
               overlong_penalty_factor=0.6)
    [row] = update_rows(grpo.train(cfg, reward_fn=lambda prompts, responses, rows: [1.0] * len(responses)).run_dir)
    assert 0 < row["response/capped_share"] < 1
    want = 1 - 0.5 * row["response/capped_share"] - 0.1 * row["response/length_mean"]
    assert row["objective/scores"] == pytest.approx(want, rel=1e-5)


# --- refusals -----------------------------------------------------------------------------------------------


def test_refusals(policy_dir):
    with pytest.raises(UserInputError, match="top_entropy_quantile"):
        grpo.GRPO(config("grpo", policy_dir, top_entropy_quantile=1.5))
    with pytest.raises(UserInputError, match="use_adaptive_entropy"):
        rloo.RLOO(config("rloo", policy_dir, use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1))
    with pytest.raises(UserInputError, match="mask_truncated_completions"):
        online_dpo.OnlineDPO(tiny(OnlineDPOConfig, policy_dir, mask_truncated_completions=True))


def test_overlong_settings_are_checked_before_anything_loads(policy_dir):
    from rlhflab.trainers.online.setup import check_online_config

    for fields in ({"overlong_buffer_len": 7}, {"overlong_buffer_len": -1}, {"overlong_penalty_factor": -0.5}):
        with pytest.raises(UserInputError, match="overlong_buffer_len"):
            check_online_config(config("grpo", policy_dir, **fields), 1, 4)  # response_length 6
    check_online_config(config("grpo", policy_dir, overlong_buffer_len=6), 1, 4)
