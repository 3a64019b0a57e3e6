"""What the GRPO / RLOO / REINFORCE tests share: a tiny config, a grouped rollout, a hand-made scored batch,
the masked-garbage and gradient-accumulation checks, an easy reward (tests only)."""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import torch

from rlhflab import data, tasks
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare
from rlhflab.trainers.online.loop import micro_losses, scored_batch, update_passes
from rlhflab.trainers.online.setup import build_roles

SUITE = dict(num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False, threads=1,
             eval_every=0, eval_prompts=4, sample_prompts=2, console_samples=0, save_every=0)


def tiny(config_class, policy_dir, **overrides):
    base = dict(model=policy_dir, batch_size=8, response_length=6, max_new_tokens=6, total_episodes=8,
                learning_rate=1e-3, temperature=0.9, **SUITE)
    return config_class(**{**base, **overrides})


def digit_share(prompts, responses, rows):
    """An easy reward: the share of characters that are digits (random text: ~0.03)."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def spread_score(prompts, responses, rows):
    """A reward whose answers never all score alike (a checksum of the text): for the tests that need a non-zero
    gradient at the first update whatever the sampled text (digit_share is 0 for every answer of some draws)."""
    return [zlib.crc32(r.encode()) % 7 / 6 for r in responses]


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def update_rows(run_dir: Path) -> list[dict]:
    """The per-update rows (not the evaluations)."""
    return [r for r in metric_rows(run_dir) if "objective/scores" in r]


def grouped_rollout(cfg, roles, tokenizer, prompts: int, group: int):
    """`prompts` train prompts each asked `group` times (contiguous), sampled from the policy."""
    items = tasks.build_splits(0, 22, 11, 11)["train"][:prompts]
    ids = data.encode_prompts(tokenizer, [i.prompt for i in items for _ in range(group)])
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature)
    return collect_rollout(roles, ids, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                           settings=settings, generator=torch.Generator().manual_seed(0))


def hand_batch(scores, valid, lengths, kl_rows, group: int, width: int = 3) -> ScoredRollout:
    """A scored batch without a model: (B,) scores / validity, each row's length, each row's per-token KL."""
    lengths = torch.tensor(lengths)
    response_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    valid = torch.tensor(valid)
    mask = response_mask & valid.unsqueeze(1)
    kl = torch.where(mask, torch.tensor(kl_rows), torch.zeros(()))
    entropy = torch.where(response_mask, torch.full(response_mask.shape, 2.0), torch.zeros(()))
    rollout = SimpleNamespace(response_mask=response_mask, entropy=entropy,
                              ended_with_eos=torch.ones(len(lengths), dtype=torch.bool))
    return ScoredRollout(rollout, torch.tensor(scores), valid, mask, kl, group)


# two groups of 4: a reward failed on rows 2, 5, 6, 7 (group 2 keeps one scored sample)
GROUPS_WITH_FAILURES = dict(
    scores=[1.0, 2.0, 0.0, 6.0, 3.0, 0.0, 0.0, 0.0], valid=[True, True, False, True, True, False, False, False],
    lengths=[3, 2, 3, 1, 2, 3, 1, 3],
    kl_rows=[[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [5.0, 5.0, 5.0], [0.0, 0.0, 0.0],
             [4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
    group=4)


def whole_step(batch: ScoredRollout, cfg) -> StepShare:
    tokens = batch.mask.sum().item()
    return StepShare(tokens=tokens, rows=batch.rollout.batch_size, rollout_tokens=tokens,
                     response_length=cfg.response_length, steps=1, index=torch.arange(batch.rollout.batch_size))


def check_masked_garbage_changes_nothing(algorithm_class, cfg, group: int) -> None:
    """Post-EOS / padding positions hold NaN in the old and reference log-probs and inf in the advantages:
    the loss is bit-identical to the clean batch's, so are the parameter gradients, and the gradient of
    the loss with respect to the log-probs is exactly 0 there."""
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=group)
    mask = rollout.response_mask.clone()
    mask[:, 3:] = False  # pretend every response ended at its 3rd token
    gen = torch.Generator().manual_seed(1)
    old = rollout.logprobs + 0.3 * torch.randn(rollout.logprobs.shape, generator=gen)  # ratios != 1: clips live
    ref = rollout.ref_logprobs - 0.2 * torch.rand(rollout.logprobs.shape, generator=gen)  # KL != 0
    clean = dataclasses.replace(rollout, response_mask=mask, logprobs=old, ref_logprobs=ref)
    nan = torch.tensor(float("nan"))
    garbage = dataclasses.replace(clean, logprobs=torch.where(mask, old, nan), ref_logprobs=torch.where(mask, ref, nan))
    valid = torch.ones(rollout.batch_size, dtype=torch.bool)
    scores = torch.randn(rollout.batch_size, generator=gen)
    batches = [scored_batch(r, scores, valid, group) for r in (clean, garbage)]
    adv = algorithm_class(cfg).advantages(batches[0])
    noisy = Advantages(torch.where(mask, adv.advantages, torch.tensor(float("inf"))), None, adv.metrics)
    # the NaN reached no advantage
    assert torch.equal(algorithm_class(cfg).advantages(batches[1]).advantages, adv.advantages)
    idx = torch.arange(rollout.batch_size)
    share = whole_step(batches[0], cfg)
    results = []
    for batch, advantages in zip(batches, (adv, noisy)):
        loss, _ = micro_losses(algorithm_class(cfg), roles, batch, advantages, idx, share, cfg.temperature)
        loss.backward()
        grads = [p.grad.clone() for p in roles.trainable_parameters()]
        roles.policy.zero_grad(set_to_none=True)
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.isfinite(loss_a) and loss_a != 0 and torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    # and the same loss as responses cut after their 3rd token: the masked columns count for nothing at all
    cut = dataclasses.replace(clean, **{name: getattr(clean, name)[:, :3] for name in (
        "response_ids", "response_mask", "logprobs", "ref_logprobs", "values", "entropy")})
    cut_batch = scored_batch(cut, scores, valid, group)
    loss_cut, _ = micro_losses(algorithm_class(cfg), roles, cut_batch, algorithm_class(cfg).advantages(cut_batch), idx,
                               share, cfg.temperature)
    torch.testing.assert_close(loss_cut.detach(), loss_a, rtol=1e-5, atol=1e-7)
    logprobs = (old + 0.1 * torch.randn(old.shape, generator=gen)).requires_grad_(True)
    loss, _ = algorithm_class(cfg).loss(logprobs, None, batches[1], noisy, idx, share)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~mask] == 0).all() and (logprobs.grad[mask] != 0).any()


def weights_after_a_pass(algorithm_class, cfg, rollout, scores, group: int) -> list[torch.Tensor]:
    """Fresh roles, one update's passes over `rollout` with SGD (no clipping): the trainable weights after."""
    roles, _ = build_roles(cfg, critic=False)
    optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    algorithm = algorithm_class(cfg)
    batch = scored_batch(rollout, scores, torch.ones(rollout.batch_size, dtype=torch.bool), group)
    adv = algorithm.advantages(batch)
    stats = update_passes(algorithm, roles, optimizer, scheduler, batch, adv, cfg, torch.Generator().manual_seed(0))
    assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    return [p.detach().clone() for p in roles.trainable_parameters()]


def check_accumulation_equivalence(algorithm_class, config_class, policy_dir, group: int, **fields) -> None:
    """gradient_accumulation_steps 1 and 4 (micro-batches of one response) give the same weights after a pass."""
    cfg = tiny(config_class, policy_dir, num_mini_batches=2, max_grad_norm=0.0, **fields)
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=8 // group, group=group)
    scores = torch.randn(rollout.batch_size, generator=torch.Generator().manual_seed(2))
    after = [weights_after_a_pass(algorithm_class, dataclasses.replace(cfg, gradient_accumulation_steps=g), rollout,
                                  scores, group) for g in (1, 4)]
    start = [p.detach() for p in roles.trainable_parameters()]
    assert any(not torch.equal(a, s) for a, s in zip(after[0], start))  # the pass did train
    for one, four in zip(*after):
        assert torch.allclose(one, four, atol=1e-6, rtol=1e-4)
