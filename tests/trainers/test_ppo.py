"""PPO invariants on tiny models: exact ratio/KL at the start, masking, parameters, accumulation, learning."""

import dataclasses
import json

import pytest
from online_steps import run_passes, scored
from tinyhf import save_suite_model
import torch

from rlhflab import data, models, tasks
from rlhflab.config import PPOConfig
from rlhflab.core import kl_k1
from rlhflab.rollout import GenerationSettings, response_logprobs
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers import ppo
from rlhflab.trainers.online.algorithm import Advantages, StepShare
from rlhflab.trainers.online.loop import micro_losses
from rlhflab.trainers.online.setup import build_roles

MODES = {
    "full": dict(),
    "full-reload": dict(reference_mode="reload"),
    "full-separate-value": dict(value_mode="separate"),
    "lora": dict(lora_r=4),
    "lora-value-adapter": dict(lora_r=4, value_mode="lora_adapter"),
    "lora-merged-generation": dict(lora_r=4, lora_merge_generation=True),
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def tiny_cfg(policy_dir, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, batch_size=8, num_mini_batches=2, num_ppo_epochs=2, response_length=6,
                total_episodes=16, eval_every=0, eval_prompts=4, sample_prompts=2, max_new_tokens=6,
                num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False,
                threads=1, learning_rate=1e-3, temperature=0.9,
                value_warmup_rollouts=0)  # these tests train the policy from the first rollout
    return PPOConfig(**{**base, **overrides})


def rollout_for(cfg, roles, tokenizer, n=8):
    items = tasks.build_splits(0, 22, 11, 11)["train"][:n]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature)
    return collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                           settings=settings, generator=torch.Generator().manual_seed(0)), items


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_first_minibatch_has_ratio_exactly_one_and_kl_exactly_zero(policy_dir, mode, precision):
    """Rollout, reference and training forwards under one autocast (bf16 on a CPU too): still exact."""
    cfg = tiny_cfg(policy_dir, mixed_precision=precision, **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    rollout, _ = rollout_for(cfg, roles, tokenizer)
    mask = rollout.response_mask
    assert torch.equal(kl_k1(rollout.logprobs, rollout.ref_logprobs, mask), torch.zeros_like(rollout.logprobs))
    roles.train(True)
    scores, _ = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids, mask)
    logprobs = models.token_logprobs(scores, rollout.response_ids, cfg.temperature)
    ratio = torch.exp(logprobs - rollout.logprobs)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert scores.autocast == (torch.bfloat16 if precision == "bf16" else None)  # the head runs under the autocast too


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kept_rollout_forward_is_the_training_forward(policy_dir, mode):
    """keep_graph: the rollout's own forward (kept for the first PPO step) gives exactly the numbers
    a fresh training forward and a keep_graph=False rollout give."""
    cfg = tiny_cfg(policy_dir, **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    plain, _ = rollout_for(cfg, roles, tokenizer)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    kept = collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                           settings=GenerationSettings(cfg.response_length, True, cfg.temperature),
                           generator=torch.Generator().manual_seed(0), keep_graph=True)
    assert plain.policy_forward is None and kept.policy_forward is not None
    for name in ("response_ids", "logprobs", "ref_logprobs", "values", "entropy"):
        assert torch.equal(getattr(kept, name), getattr(plain, name)), name
    logprobs, values = kept.policy_forward
    assert logprobs.requires_grad and values.requires_grad
    roles.train(True)
    fresh_scores, fresh_values = roles.logits_and_values(kept.query_ids, kept.query_mask, kept.response_ids,
                                                         kept.response_mask)
    fresh = models.token_logprobs(fresh_scores, kept.response_ids, cfg.temperature)
    assert torch.equal(logprobs, fresh) and torch.equal(values, fresh_values)


def test_reusing_the_rollout_forward_trains_the_same_policy(policy_dir, tmp_path):
    """One minibatch, one epoch: with and without the reuse, the same updates (up to summation order)."""
    runs = {}
    for reuse in (True, False):
        cfg = tiny_cfg(policy_dir, num_mini_batches=1, num_ppo_epochs=1, reuse_rollout_forward=reuse,
                       output_dir=str(tmp_path / f"reuse-{reuse}"), save_every=0)
        result = ppo.train(cfg)
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[reuse] = (models.load_causal_lm(str(result.model_dir)), [r for r in rows if "val/ratio" in r])
        walls = result.summary["wall_time_s"]  # the loop is timed apart from loading, evaluations and saving
        assert set(walls) == {"setup", "loop", "evaluation", "save", "total"}
        assert all(v >= 0 for v in walls.values()) and walls["loop"] > 0
        assert walls["setup"] + walls["loop"] + walls["evaluation"] + walls["save"] <= walls["total"] + 3e-3  # 5 roundings to 1 ms
        updates = [r for r in rows if "time/generation" in r]
        phases = sum(r["time/generation"] + r["time/scoring"] + r["time/training"] for r in updates)
        assert phases <= walls["loop"] + 1e-3
    (a, rows_a), (b, rows_b) = runs[True], runs[False]
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
    assert [r["val/ratio"] for r in rows_a] == [1.0] * len(rows_a)  # the reused forward: ratio exactly 1
    assert [r["response/length_mean"] for r in rows_a] == [r["response/length_mean"] for r in rows_b]


def test_lora_reference_equals_a_separately_loaded_base_after_training(policy_dir):
    cfg = tiny_cfg(policy_dir, lora_r=4)
    roles, tokenizer = build_roles(cfg)
    rollout, items = rollout_for(cfg, roles, tokenizer)
    optimizer = torch.optim.AdamW(roles.trainable_parameters(), lr=1e-2)
    for _ in range(3):  # move the adapter away from its zero init
        scores, values = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids,
                                                 rollout.response_mask)
        (scores.head(scores.hidden).logsumexp(-1).mean() + values.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    args = (rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
    reference = roles.reference_logprobs(*args, temperature=0.9)
    base = models.load_causal_lm(policy_dir)
    expected = response_logprobs(base, *args, temperature=0.9)
    mask = rollout.response_mask
    assert torch.allclose(reference[mask], expected[mask], atol=1e-6)
    with torch.no_grad():
        policy_now = models.token_logprobs(roles.policy_forward(*args)[0], rollout.response_ids, 0.9)
    assert not torch.allclose(policy_now[mask], expected[mask], atol=1e-4)  # the adapter did change the policy


def test_post_eos_tokens_carry_no_reward_kl_or_loss(policy_dir):
    cfg = tiny_cfg(policy_dir)
    roles, tokenizer = build_roles(cfg)
    rollout, _ = rollout_for(cfg, roles, tokenizer)
    mask = rollout.response_mask.clone()
    mask[:, 3:] = False  # pretend every response ended at its 3rd token
    scores = torch.arange(8, dtype=torch.float32)
    kl = kl_k1(rollout.logprobs + 0.5, rollout.ref_logprobs, mask)
    rewards, non_score = ppo.token_rewards(scores, kl, mask, kl_coef=0.1)
    assert (kl[~mask] == 0).all() and (rewards[~mask] == 0).all()
    lengths = mask.sum(1)
    assert torch.allclose(rewards[torch.arange(8), lengths - 1], scores - 0.1 * 0.5 * (lengths > 0))
    advantages, returns = torch.randn(8, rollout.response_ids.shape[1]), torch.randn(8, rollout.response_ids.shape[1])
    clean = dataclasses.replace(rollout, response_mask=mask)
    garbage = dataclasses.replace(
        clean, logprobs=torch.where(mask, rollout.logprobs, torch.tensor(float("nan"))),
        values=torch.where(mask, rollout.values, torch.tensor(1e9)))
    idx = torch.arange(8)
    share = StepShare(tokens=mask.sum().item(), rows=8, rollout_tokens=mask.sum().item(), response_length=mask.shape[1],
                      steps=1, index=idx)
    algorithm = ppo.PPO(cfg)
    loss_a, _ = micro_losses(algorithm, roles, scored(clean), Advantages(advantages, returns, {}), idx, share,
                             cfg.temperature)
    noisy_adv = torch.where(mask, advantages, torch.tensor(float("inf")))
    loss_b, _ = micro_losses(algorithm, roles, scored(garbage), Advantages(noisy_adv, returns, {}), idx, share,
                             cfg.temperature)
    assert torch.isfinite(loss_a) and torch.equal(loss_a, loss_b)


@pytest.mark.parametrize("mode", ["full", "lora", "lora-value-adapter"])
def test_every_trainable_parameter_changes_and_frozen_ones_do_not(policy_dir, mode):
    cfg = tiny_cfg(policy_dir, **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    trainable = {id(p) for p in roles.trainable_parameters()}
    named = [(f"{i}.{n}", p) for i, m in enumerate(roles.modules()) for n, p in m.named_parameters()]
    before = {name: p.detach().clone() for name, p in named}
    rollout, items = rollout_for(cfg, roles, tokenizer)
    optimizer = torch.optim.AdamW(roles.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    advantages = torch.randn(rollout.response_ids.shape).masked_fill(~rollout.response_mask, 0)
    returns = torch.randn(rollout.response_ids.shape).masked_fill(~rollout.response_mask, 0)
    run_passes(ppo.PPO(cfg), roles, optimizer, scheduler, rollout, advantages, returns, cfg,
                   torch.Generator().manual_seed(0))
    unchanged = [n for n, p in named if id(p) in trainable and torch.equal(p, before[n])]
    moved_frozen = [n for n, p in named if id(p) not in trainable and not torch.equal(p, before[n])]
    assert not unchanged, unchanged
    assert not moved_frozen, moved_frozen
    if mode.startswith("lora"):
        assert len(trainable) < len(named)  # the base stays frozen


def test_gradient_accumulation_matches_one_big_minibatch(policy_dir):
    results = []
    for accumulation in (1, 8):
        cfg = tiny_cfg(policy_dir, num_mini_batches=1, num_ppo_epochs=1, gradient_accumulation_steps=accumulation,
                       max_grad_norm=0.0)
        torch.manual_seed(0)  # same value-head init in both runs
        roles, tokenizer = build_roles(cfg)
        rollout, _ = rollout_for(cfg, roles, tokenizer)
        optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        gen = torch.Generator().manual_seed(1)
        advantages = torch.randn(rollout.response_ids.shape, generator=gen).masked_fill(~rollout.response_mask, 0)
        returns = torch.randn(rollout.response_ids.shape, generator=gen).masked_fill(~rollout.response_mask, 0)
        run_passes(ppo.PPO(cfg), roles, optimizer, scheduler, rollout, advantages, returns, cfg,
                   torch.Generator().manual_seed(0))
        results.append([p.detach().clone() for p in roles.trainable_parameters()])
    for one, eight in zip(*results):
        assert torch.allclose(one, eight, atol=1e-6, rtol=1e-4)


def digit_share(prompts, responses, items):
    """An easy reward: the share of characters that are digits."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def test_short_run_on_an_easy_reward_clearly_raises_it(policy_dir, tmp_path):
    cfg = tiny_cfg(policy_dir, total_episodes=16 * 25, batch_size=16, num_mini_batches=1, num_ppo_epochs=2,
                   learning_rate=2e-2, kl_coef=0.0, missing_eos_penalty=0.0, response_length=6,
                   output_dir=str(tmp_path / "run"))
    result = ppo.train(cfg, reward_fn=digit_share)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["objective/scores"] for r in rows if "objective/scores" in r]
    assert len(scores) == 25
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert end > start + 0.5, (start, end)  # from ~0.05 (random text) to mostly digits
    assert (result.model_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("mode", ["full", "lora-value-adapter"])
def test_training_forward_does_not_depend_on_left_padding_or_batch_company(policy_dir, mode):
    cfg = tiny_cfg(policy_dir, **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    rollout, _ = rollout_for(cfg, roles, tokenizer)
    args = (rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
    with torch.no_grad():
        logits, values = roles.logits_and_values(*args)
        batch_lp = models.token_logprobs(logits, rollout.response_ids, 0.9)
        for row in range(rollout.batch_size):
            keep = rollout.query_mask[row]
            alone = (rollout.query_ids[row, keep][None], keep[keep][None],
                     rollout.response_ids[row][None], rollout.response_mask[row][None])
            row_logits, row_values = roles.logits_and_values(*alone)
            mask = rollout.response_mask[row]
            lp = models.token_logprobs(row_logits, rollout.response_ids[row][None], 0.9)[0]
            assert torch.allclose(lp[mask], batch_lp[row][mask], atol=1e-5)
            assert torch.allclose(row_values[0][mask], values[row][mask], atol=1e-5)


def test_a_reward_with_the_wrong_number_of_scores_is_a_clear_error(policy_dir, tmp_path):
    from rlhflab.errors import UserInputError

    cfg = tiny_cfg(policy_dir, output_dir=str(tmp_path / "run"))
    with pytest.raises(UserInputError, match="1 scores for 8 responses|\\(1,\\) scores for 8 responses"):
        ppo.train(cfg, reward_fn=lambda prompts, responses, items: [1.0])


def test_reward_model_normalisation_gives_the_starting_policy_mean_zero_std_one(policy_dir, tmp_path):
    from rlhflab.rollout import generate_answers
    from rlhflab.trainers.online.setup import build_reward

    tokenizer = models.load_tokenizer(policy_dir)
    rm = models.build_random_reward_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64)
    models.save_model_folder(tmp_path / "rm", rm, tokenizer)
    cfg = tiny_cfg(policy_dir, reward="model", reward_model=str(tmp_path / "rm"), normalize_reward=True)
    roles, tokenizer = build_roles(cfg)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:16]
    reward_fn, norm = build_reward(cfg, tokenizer, roles.policy, items)
    assert norm["calibration_answers"] == 16 and norm["scale"] > 0
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature)
    answers = generate_answers(roles.policy, tokenizer, [i.prompt for i in items], settings,
                               generator=torch.Generator().manual_seed(cfg.seed + 1))  # the calibration answers
    scores = reward_fn([i.prompt for i in items], [a.text for a in answers], items).scores
    assert abs(scores.mean().item()) < 1e-4 and abs(scores.std().item() - 1.0) < 1e-3


def scripted_evaluations(monkeypatch, rates: dict[int, float]) -> dict[int, dict]:
    """Replace the validation pass rate with `rates[step]`; keep a copy of the policy at each evaluation."""
    from rlhflab.trainers.online.evaluate import Evaluator

    policies: dict[int, dict] = {}

    def evaluate(self, policy, step, episode):
        policies[step] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        metrics = {"val/pass_rate": rates[step], "episode": episode}
        self.run.log(metrics, step=step)
        return metrics

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    return policies


def saved_policy(result) -> dict:
    from safetensors.torch import load_file

    return load_file(str(result.model_dir / "model.safetensors"))


def test_a_monitor_stops_the_run_early_and_the_best_policy_is_saved(policy_dir, tmp_path, monkeypatch):
    from rlhflab.eval import RunMonitor, StoppingRule

    policies = scripted_evaluations(monkeypatch, {0: 0.2, 1: 0.5, 2: 0.4, 3: 0.45, 4: 0.9})
    cfg = tiny_cfg(policy_dir, total_episodes=8 * 8, eval_every=1, output_dir=str(tmp_path / "run"))
    monitor = RunMonitor(stopping=StoppingRule(patience=2, min_delta=0.01))
    result = ppo.train(cfg, reward_fn=digit_share, monitor=monitor)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    # evaluations after update 2 and 3 did not beat update 1's 0.5: stop at update 3 of 8
    assert summary["stopped"]["step"] == 3 and summary["stopped"]["episode"] == 24
    assert "did not rise by 0.01 over its best 0.5 (step 1)" in summary["stopped"]["reason"]
    assert summary["updates"] == 3 and summary["episodes"] == 24 < cfg.total_episodes
    assert summary["best"] == {"step": 1, "val/pass_rate": 0.5, "restored": True}
    assert isinstance(summary["alarms"], list)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 3
    update_rows = [r for r in rows if "objective/kl" in r]
    assert all(0 <= r["response/distinct_2"] <= 1 and 0 <= r["response/capped_share"] <= 1 for r in update_rows)
    saved = saved_policy(result)
    assert all(torch.equal(saved[k], policies[1][k]) for k in saved)  # the best state, not the last
    assert any(not torch.equal(saved[k], policies[3][k]) for k in saved)  # and training had moved on


def test_a_run_that_ends_below_its_best_saves_the_best_policy(policy_dir, tmp_path, monkeypatch):
    from rlhflab.eval import RunMonitor

    policies = scripted_evaluations(monkeypatch, {0: 0.2, 1: 0.5, 2: 0.4})
    cfg = tiny_cfg(policy_dir, total_episodes=16, eval_every=1, output_dir=str(tmp_path / "run"))
    result = ppo.train(cfg, reward_fn=digit_share, monitor=RunMonitor())
    assert result.summary["stopped"] is None and result.summary["updates"] == 2
    assert result.summary["best"] == {"step": 1, "val/pass_rate": 0.5, "restored": True}
    saved = saved_policy(result)
    assert all(torch.equal(saved[k], policies[1][k]) for k in saved)
    assert any(not torch.equal(saved[k], policies[2][k]) for k in saved)


def test_configure_allocator_applies_only_when_asked():
    import platform

    from rlhflab.trainers.setup import configure_allocator

    assert configure_allocator(0) is False
    assert configure_allocator(1) is (platform.libc_ver()[0] == "glibc")
