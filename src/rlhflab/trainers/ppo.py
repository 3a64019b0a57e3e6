"""PPO-RLHF: policy, reference, reward and value, one explicit loop.

    rlhflab ppo --model runs/demo-.../sft/model --reward checker

Each update (numbered as in README "PPO, step by step"):
  1. sample `batch_size` prompts
  2. generate responses; old log-probs, reference log-probs and values, once
  3. score the finished responses; subtract `missing_eos_penalty` where EOS never came
  4. per-token rewards r_t = -beta * KL_t, plus the score on the last real token
  5. GAE advantages and returns; whiten advantages
  6. `num_ppo_epochs` passes over shuffled minibatches: clipped policy loss
     + vf_coef * clipped value loss, gradient clipping, AdamW, LR schedule
  7. update the KL coefficient (adaptive controller), log metrics, evaluate every N
  8. if a monitor was given: feed it each logged row, log its alarms, stop when it says so
     (README "Alarms and stopping")
  9. checkpoint every `save_every` updates, at the end, and on SIGINT / SIGTERM
     (README "Checkpoints and resume"); `--resume` continues bit for bit
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch
from tqdm.auto import tqdm

from rlhflab import core, data, rewards, sources
from rlhflab.checkpoint import Checkpointer, open_run
from rlhflab.config import PPOConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.core import KL_ESTIMATORS, clipped_value_loss, gae, masked_mean, ppo_policy_loss, whiten
from rlhflab.core.logprobs import selective_log_softmax
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings, decode_responses
from rlhflab.rollout.diversity import diversity_metrics
from rlhflab.rollout.rollout import Rollout, collect_rollout
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.ppo_eval import PPOEvaluator
from rlhflab.trainers.ppo_monitor import Monitor, RunWatch
from rlhflab.trainers.ppo_save import save_ppo_models
from rlhflab.trainers.ppo_setup import build_reward, build_roles, build_verifier, check_ppo_config, reward_kind
from rlhflab.trainers.nonfinite import clip_and_step
from rlhflab.trainers.ppo_state import PPOProgress, pack_ppo, unpack_ppo
from rlhflab.trainers.setup import configure_allocator, configure_threads, make_optimizer, make_scheduler
from rlhflab.trainers.setup import seed_everything

log = logging.getLogger("rlhflab")


def kl_controller(cfg: PPOConfig):
    if cfg.adaptive_kl:
        return core.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return core.FixedKLController(cfg.kl_coef)


def sampling_seed(seed: int) -> int:
    """Seed of the token-sampling generator: its own stream, not the prompt-order one's (same `seed`
    in both gave identical streams on CPU, so the order of prompts and the sampled tokens were tied)."""
    return seed ^ 0x5EED5EED


def score_rollout(rollout: Rollout, reward_fn, tokenizer, rows: list[PromptRow], penalty: float):
    """(B,) scores with the missing-EOS penalty, and (B,) validity of each row."""
    texts = decode_responses(tokenizer, rollout.response_ids, rollout.response_mask, tokenizer.eos_token_id)
    scored = rewards.as_scored(reward_fn([r.prompt for r in rows], texts, rows))
    if scored.scores.shape != (rollout.batch_size,):
        raise UserInputError(f"the reward returned {tuple(scored.scores.shape)} scores for {rollout.batch_size} responses",
                             "reward_fn", "return one score per response, in the order given")
    device = rollout.response_ids.device
    scores = scored.scores.float().to(device) - penalty * (~rollout.ended_with_eos).float()
    valid = scored.valid.to(device) & torch.isfinite(scores)
    return torch.where(valid, scores, torch.zeros_like(scores)), valid


def token_rewards(scores, kl, response_mask, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r_t = -beta * KL_t on every real token, plus the score on the last real one. (B, T)."""
    non_score = -kl_coef * kl
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)  # (B,)
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0]), last] += scores
    return torch.where(response_mask, rewards, torch.zeros_like(rewards)), non_score


def minibatch_losses(roles, rollout: Rollout, idx, advantages, returns, cfg: PPOConfig, weight: float,
                     forward: tuple | None = None):
    """Loss of one (micro-)batch, scaled by its share of the minibatch's real tokens.

    `forward`: the rollout's own policy forward over all rows (`Rollout.policy_forward`), used
    instead of running it again when the weights have not changed since."""
    q, qm, r, rm = (t[idx] for t in (rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask))
    if forward is not None:
        logits, values = forward[0][idx], forward[1][idx]
    else:
        logits, values = roles.logits_and_values(q, qm, r, rm)
    logprobs = selective_log_softmax(logits, r, cfg.temperature)
    pg_loss, pg_stats = ppo_policy_loss(logprobs, rollout.logprobs[idx], advantages[idx], rm, cfg.cliprange)
    vf_loss, vf_stats = clipped_value_loss(values.float(), rollout.values[idx], returns[idx], rm, cfg.cliprange_value)
    loss = (pg_loss + cfg.vf_coef * vf_loss) * weight
    ratio = torch.exp(logprobs - rollout.logprobs[idx]).detach()
    stats = {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
             **{f"policy/{k}": v for k, v in pg_stats.items()}, "val/clipfrac": vf_stats["clipfrac"],
             "ratio_var": masked_var_of(ratio, rm)}
    return loss, stats


def masked_var_of(x, mask):
    return core.masked_var(x, mask) if mask.sum() > 1 else torch.zeros((), device=x.device)


def ppo_epochs(roles, optimizer, scheduler, rollout: Rollout, advantages, returns, cfg: PPOConfig, generator,
               update: int = 0, prompt_keys: list[int] | None = None):
    """Step 6: num_ppo_epochs x num_mini_batches optimiser steps; returns averaged stats, and under
    "skipped" how many of those steps a non-finite loss or gradient dropped (cfg.nonfinite == "skip";
    "stop" raises naming the rollout rows and `prompt_keys[row]`, their train-prompt indices)."""
    roles.train(True)
    params = roles.trainable_parameters()
    batch = rollout.batch_size
    mb_size = batch // cfg.num_mini_batches
    micro = max(1, math.ceil(mb_size / cfg.gradient_accumulation_steps))
    history: list[dict] = []
    skipped = 0
    # the rollout's forward is the first step's forward only if that step sees every row at the rollout's weights
    reuse = rollout.policy_forward if micro >= batch else None
    for _ in range(cfg.num_ppo_epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, mb_size):
            mb_idx = order[start : start + mb_size]
            mb_tokens = rollout.response_mask[mb_idx].sum().clamp(min=1)
            mb_history, loss_value, rows = [], 0.0, mb_idx
            for m_start in range(0, mb_size, micro):
                idx = mb_idx[m_start : m_start + micro]
                weight = (rollout.response_mask[idx].sum() / mb_tokens).item()
                loss, stats = minibatch_losses(roles, rollout, idx, advantages, returns, cfg, weight, reuse)
                reuse = None  # its weights are stale after this step
                if not torch.isfinite(loss):  # no backward through it: this minibatch's step is dropped below
                    loss_value, rows = loss.item(), idx
                    break
                loss.backward()
                mb_history.append(stats)
            try:
                grad_norm = clip_and_step(optimizer, scheduler, params, cfg.max_grad_norm, loss_value, cfg.nonfinite,
                                          "PPO")
            except FloatingPointError as err:
                raise FloatingPointError(f"PPO update {update}: {err} ({_rows(rows.tolist(), prompt_keys)}); "
                                         "no checkpoint written after it") from err
            if grad_norm is None:  # dropped: its stats stay out of the averages
                skipped += 1
                continue
            mb_history[-1]["grad_norm"] = grad_norm.detach()
            history.extend(mb_history)
    return {**average_stats(history), "skipped": skipped}


def _rows(rows: list[int], prompt_keys: list[int] | None) -> str:
    """Rollout rows, and the train-prompt indices they answered, for an error message."""
    named = f"rollout rows {rows}"
    return f"{named}, train prompts {[prompt_keys[r] for r in rows]}" if prompt_keys is not None else named


def average_stats(history: list[dict]) -> dict:
    keys = {k for h in history for k in h}
    out = {}
    for key in keys:
        values = torch.stack([h[key].float() for h in history if key in h])
        if key == "policy/ratio_max":
            out[key] = values.max().item()
        elif key == "policy/ratio_min":
            out[key] = values.min().item()
        else:
            out[key] = values.mean().item()
    return out


def rollout_metrics(rollout, scores, kl, non_score, returns, kl_coef, valid, prompt_keys: list[int]) -> dict:
    """Per-update metrics of the rollout (README "Metrics"); `prompt_keys[b]` names row b's prompt."""
    mask = rollout.response_mask
    scored_mask = mask & valid.unsqueeze(1)  # rows the reward failed on are out of the update
    lengths = mask.sum(dim=1).float()
    kl_seq = (kl * mask).sum(dim=1)[valid]
    non_score_seq = (non_score * mask).sum(dim=1)
    return {
        "objective/scores": scores[valid].mean().item() if valid.any() else float("nan"),
        "objective/kl": kl_seq.mean().item(),
        "objective/non_score_reward": non_score_seq[valid].mean().item(),
        "objective/rlhf_reward": (scores + non_score_seq)[valid].mean().item() if valid.any() else float("nan"),
        "objective/entropy": masked_mean(rollout.entropy, mask).item(),
        "val/explained_variance": core.explained_variance(rollout.values, returns, scored_mask).item(),
        "val/num_eos_tokens": int(rollout.ended_with_eos.sum().item()),
        "response/length_mean": lengths.mean().item(),
        "reward/invalid_rows": int((~valid).sum().item()),
        "kl_coef": kl_coef,
        **diversity_metrics(rollout.response_ids, mask, rollout.ended_with_eos, prompt_keys),
    }


def train(cfg: PPOConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None) -> RunResult:
    """Run PPO as configured; returns the run folder and the HF policy folder it wrote.

    Prompts come from `cfg.train_file` / `validation_file`, or the built-in suite (`sources.prompt_splits`).
    `reward_fn(prompts, responses, rows)` overrides the configured reward: any callable returning
    a `rewards.Scored` or a list of floats (NaN / None marks a row the reward failed on).
    Validation reads the verifier (`cfg.verifier`; the suite's checker on the suite) or, without one,
    the reward's mean on the validation answers.
    `monitor` (e.g. `rlhflab.eval.RunMonitor.from_config(cfg)`) sees every logged row, may
    raise alarms and stop the run; with it the best-validation policy is kept and saved
    if the run ends below it (`cfg.keep_best`). Without it no alarm, stop or restore happens.
    """
    started = time.time()
    check_ppo_config(cfg)
    configure_threads(cfg.threads)
    configure_allocator(cfg.mmap_threshold_mib)
    seed_everything(cfg.seed, cfg.deterministic)
    roles, tokenizer = build_roles(cfg)
    prompts = sources.prompt_splits(cfg, tokenizer)
    train_rows = prompts.train
    verifier = build_verifier(cfg, prompts)
    normalisation: dict = {}
    if reward_fn is None:
        reward_fn, normalisation = build_reward(cfg, tokenizer, roles.policy, train_rows[: cfg.calibration_prompts])
    prompt_ids = data.encode_prompts(tokenizer, [r.prompt for r in train_rows])
    run, resumed = open_run(cfg, "ppo") if run is None else (run, None)

    num_updates = cfg.total_episodes // cfg.batch_size
    optimizer = make_optimizer(roles.trainable_parameters(), cfg, fused=True)  # PPO steps every minibatch
    scheduler = make_scheduler(optimizer, cfg, num_updates * cfg.num_ppo_epochs * cfg.num_mini_batches)
    kl_ctl = kl_controller(cfg)
    generator = torch.Generator().manual_seed(cfg.seed)  # prompt order and minibatches
    device = next(roles.policy.parameters()).device
    sampler = torch.Generator(device=device).manual_seed(sampling_seed(cfg.seed))  # token sampling, on the model's device
    # Rollouts sample from the full softmax: with top-k / top-p the sampling policy would
    # not be the one whose log-probs PPO uses. top_k / top_p apply to evaluation only.
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature, top_k=0, top_p=1.0)
    # one minibatch of one micro-batch: the rollout's policy forward is also the first training forward
    keep_graph = cfg.reuse_rollout_forward and cfg.num_mini_batches == 1 and cfg.gradient_accumulation_steps == 1
    evaluator = PPOEvaluator(prompts.validation, tokenizer, cfg, run, verifier, reward_fn)
    signal = evaluator.signal  # val/pass_rate (verifier) or val/reward: what keep_best and the monitor read
    if getattr(monitor, "signal", signal) != signal:
        raise ValueError(f"the monitor watches {monitor.signal} but this run's held-out signal is {signal}")
    watch = RunWatch(monitor, run, roles, cfg.keep_best, signal)
    generators = {"order": generator, "sampler": sampler}
    # wall time split for summary.json: loading and building, the updates themselves (steps 1-7 up
    # to logging: what a throughput figure divides by), evaluations, checkpoints + the final save
    walls = {"setup": time.time() - started, "loop": 0.0, "evaluation": 0.0, "save": 0.0}
    if resumed is None:
        first = evaluator.evaluate(roles.policy, step=0, episode=0)
        walls["evaluation"] = time.time() - started - walls["setup"]
        watch.observe(0, first)
        progress = PPOProgress(first=first, last_eval=first)
    else:
        progress = unpack_ppo(resumed, roles, optimizer, scheduler, kl_ctl, generators, watch)
        resumed.commit()  # only now cut the histories back, record the resume
    first, last_eval, last, order = progress.first, progress.last_eval, progress.last, progress.order
    done, episode, finished, skipped = progress.update, progress.episode, progress.finished, progress.skipped
    pack = lambda: pack_ppo(roles, optimizer, scheduler, kl_ctl, generators, PPOProgress(  # noqa: E731
        done, episode, order, first, last_eval, last, finished, skipped), watch)  # reads the loop's variables
    start = num_updates if finished else done
    resumed_at = resumed.step if resumed is not None else None  # that checkpoint is on disk already
    with Checkpointer(run.path, cfg.save_every, cfg.keep_last_n, resumed_at) as saver:  # SIGINT / SIGTERM handlers
        bar = tqdm(range(start + 1, num_updates + 1), desc="ppo", unit="update", disable=not cfg.progress)
        for update in bar:
            t0 = time.time()
            # 1. sample prompts: shuffled passes over the train split
            while len(order) < cfg.batch_size:
                order.extend(torch.randperm(len(train_rows), generator=generator).tolist())
            batch_ids, order = order[: cfg.batch_size], order[cfg.batch_size :]
            rows = [train_rows[i] for i in batch_ids]
            # 2. rollout: generate, then old / reference log-probs and values in one pass each
            rollout = collect_rollout(roles, [prompt_ids[i] for i in batch_ids], pad_id=tokenizer.pad_token_id,
                                      eos_id=tokenizer.eos_token_id, settings=settings, generator=sampler,
                                      keep_graph=keep_graph)
            t1 = time.time()
            # 3. scores, with the missing-EOS penalty; rows the reward failed on are masked out
            scores, valid = score_rollout(rollout, reward_fn, tokenizer, rows, cfg.missing_eos_penalty)
            if not valid.any():
                raise FloatingPointError(f"update {update}: the reward source failed on every row of the batch")
            mask = rollout.response_mask & valid.unsqueeze(1)
            # 4. per-token rewards: KL penalty on every token, score on the last real one
            kl = KL_ESTIMATORS[cfg.kl_estimator](rollout.logprobs, rollout.ref_logprobs, mask)
            rewards, non_score = token_rewards(scores, kl, mask, kl_ctl.value)
            if cfg.whiten_rewards:
                rewards = whiten(rewards, mask, shift_mean=False)
            # 5. advantages (GAE) and returns, advantages whitened over the rollout
            advantages, returns = gae(rewards, rollout.values, mask, cfg.gamma, cfg.lam)
            bad_rows = (~torch.isfinite(advantages + returns)).any(dim=1)  # before whitening spreads it to all rows
            if cfg.whiten_advantages:
                advantages = whiten(advantages, mask)
            t2 = time.time()
            # 6. PPO epochs over minibatches (non-finite advantages: stop, or drop the whole update's steps)
            if bad_rows.any() and cfg.nonfinite == "stop":
                raise FloatingPointError(f"PPO update {update}: non-finite advantages "
                                         f"({_rows(bad_rows.nonzero().flatten().tolist(), batch_ids)}); "
                                         "no checkpoint written after it")
            # a changed mask changes the attention of the training forward: the rollout's forward is not reused
            masked_rollout = rollout if bool(valid.all()) else dataclasses.replace(rollout, response_mask=mask,
                                                                                  policy_forward=None)
            stats = {"skipped": cfg.num_ppo_epochs * cfg.num_mini_batches} if bad_rows.any() else ppo_epochs(
                roles, optimizer, scheduler, masked_rollout, advantages, returns, cfg, generator, update, batch_ids)
            skipped += stats.pop("skipped")
            t3 = time.time()
            # 7. KL coefficient, metrics, periodic evaluation
            kl_coef_used = kl_ctl.value
            kl_ctl.update((kl * mask).sum(dim=1)[valid].mean().item(), cfg.batch_size)  # a NaN KL leaves β as is
            episode += cfg.batch_size
            generated_tokens = int(rollout.response_mask.sum().item())
            last = {
                **rollout_metrics(rollout, scores, kl, non_score, returns, kl_coef_used, valid, batch_ids),
                **_ppo_names(stats), "lr": scheduler.get_last_lr()[0], "episode": episode,
                "eps": cfg.batch_size / (t3 - t0),
                "tokens_per_s": generated_tokens / max(rollout.seconds["generation"], 1e-9),
                "time/generation": rollout.seconds["generation"],
                "time/scoring": rollout.seconds["forward"] + (t2 - t1), "time/training": t3 - t2,
                **({"nonfinite/skipped_updates": skipped} if cfg.nonfinite == "skip" else {}),
            }
            run.log(last, step=update)
            watch.observe(update, last)
            done = update
            t4 = time.time()
            walls["loop"] += t4 - t0
            if (cfg.eval_every and update % cfg.eval_every == 0) or update == num_updates:
                last_eval = evaluator.evaluate(roles.policy, step=update, episode=episode)
                watch.observe(update, last_eval)
                bar.set_postfix({signal.removeprefix("val/"): f"{last_eval[signal]:.2f}",
                                 "kl": f"{last['objective/kl']:.2f}", "score": f"{last['objective/scores']:.2f}"})
            t5 = time.time()
            walls["evaluation"] += t5 - t4
            # 8. the monitor's stopping rule (validation patience, or an alarm listed in stop_on_alarms)
            if watch.should_stop(update, episode):
                break
            # 9. checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
            saver.step_done(update, pack)
            walls["save"] += time.time() - t5

        t6 = time.time()
        finished = True
        saver.finish(done, pack)  # before the best policy may be restored: a resume continues from `done`

    monitored = watch.finish(done, last_eval[signal])  # restores the best policy when it should
    model_dir = save_ppo_models(roles, tokenizer, run.path)
    walls["save"] += time.time() - t6
    held_out = saved_policy_numbers(first, last_eval, last, monitored, signal)
    summary = run.update_summary(
        stage="ppo", reward=reward_kind(cfg), reward_functions=[s for s in cfg.reward_fn.split(",") if s.strip()],
        reward_normalisation=normalisation, prompts=prompts.source,
        held_out=held_out_description(signal, verifier), updates=done, episodes=episode, **held_out,
        wall_time_s={**{k: round(v, 3) for k, v in walls.items()}, "total": round(time.time() - started, 3)},
        model_dir=str(model_dir), **monitored,
        nonfinite={"mode": cfg.nonfinite, "skipped_updates": skipped},
    )
    run.close()
    return RunResult(run.path, summary, model_dir)


FINAL_KEYS = ("objective/kl", "objective/scores", "objective/rlhf_reward", "eps", "response/length_mean", "kl_coef")


def saved_policy_numbers(first: dict, last_eval: dict, last: dict, monitored: dict, signal: str) -> dict:
    """summary.json's held-out start / end and "final" training numbers, of the policy actually saved.

    When keep_best restored an earlier update, "end" is that update's evaluation and "final" its
    training row (KL, scores, length): not the numbers of the discarded last update. Restoring
    update 0 (the starting policy) has no training row: its KL to the reference is 0 by definition.
    """
    end, final_row = last_eval[signal], last
    best = monitored.get("best")
    if best and best.get("restored"):
        end = best[signal]
        final_row = best["update_row"] or {"objective/kl": 0.0}
    if best:
        best.pop("update_row", None)
    name = "validation_pass_rate" if signal == "val/pass_rate" else "validation_reward"
    return {name: {"start": first[signal], "end": end},
            "final": {k: final_row.get(k) for k in FINAL_KEYS},
            "final_is": "restored best update" if best and best.get("restored") else "last update"}


def held_out_description(signal: str, verifier) -> dict:
    """What the held-out numbers mean, in words the report repeats."""
    if verifier is not None:
        return {"metric": signal, "verifier": getattr(verifier, "name", type(verifier).__name__),
                "note": "pass rate of the validation answers by the verifier, an independent check"}
    return {"metric": signal, "verifier": None,
            "note": "no verifier: the held-out signal is the reward's mean on the validation answers, i.e. the "
                    "reward's own opinion, not an independent check; read it with the KL to the reference"}


def _ppo_names(stats: dict) -> dict:
    """Averages over minibatches, under TRL's metric names."""
    names = {"loss/policy": "loss/policy_avg", "loss/value": "loss/value_avg", "policy/clipfrac": "policy/clipfrac_avg",
             "policy/approxkl": "policy/approxkl_avg", "val/clipfrac": "val/clipfrac_avg", "policy/ratio_mean": "val/ratio",
             "ratio_var": "val/ratio_var", "policy/ratio_max": "policy/ratio_max", "policy/ratio_min": "policy/ratio_min",
             "grad_norm": "grad_norm"}
    return {names[k]: v for k, v in stats.items() if k in names}
