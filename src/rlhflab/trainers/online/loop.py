"""The one online cycle every online algorithm runs (PPO, GRPO, RLOO, REINFORCE).

Each update (README "PPO, step by step" numbers them for PPO):
  1. sample `batch_size / k` prompts, each asked `k = algorithm.samples_per_prompt` times
  2. generate responses; old log-probs, reference log-probs (and values, with a critic), once
  3. score the finished responses; subtract `missing_eos_penalty` where EOS never came
  4. the algorithm's advantages (GAE with a critic; group, leave-one-out or running baselines)
  5. `algorithm.epochs` passes over shuffled minibatches of the algorithm's loss: gradient
     clipping, AdamW, LR schedule
  6. the algorithm's own state (PPO's KL coefficient), metrics, evaluation every `eval_every`
  7. if a monitor was given: feed it each logged row, log its alarms, stop when it says so
     (README "Alarms and stopping"); stop too when `max_seconds` is spent
  8. checkpoint every `save_every` updates, at the end, and on SIGINT / SIGTERM
     (README "Checkpoints and resume"); `--resume` continues bit for bit
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch
from tqdm.auto import tqdm

from rlhflab import data, rewards, sources
from rlhflab.checkpoint import Checkpointer, open_run
from rlhflab.core import masked_mean
from rlhflab.core.logprobs import selective_log_softmax
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings, decode_responses
from rlhflab.rollout.diversity import diversity_metrics
from rlhflab.rollout.rollout import Rollout, collect_rollout
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.headroom import record_start_headroom
from rlhflab.trainers.nonfinite import clip_and_step
from rlhflab.trainers.online.algorithm import Algorithm, ScoredRollout, StepShare
from rlhflab.trainers.online.evaluate import Evaluator
from rlhflab.trainers.online.monitor import Monitor, RunWatch
from rlhflab.trainers.online.save import save_policy_models
from rlhflab.trainers.online.setup import build_reward, build_roles, build_verifier, check_online_config, reward_kind
from rlhflab.trainers.online.state import Progress, pack_online, unpack_online
from rlhflab.trainers.setup import configure_allocator, configure_threads, make_optimizer, make_scheduler
from rlhflab.trainers.setup import seed_everything

log = logging.getLogger("rlhflab")


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


def scored_batch(rollout: Rollout, scores, valid, group_size: int) -> ScoredRollout:
    mask = rollout.response_mask & valid.unsqueeze(1)
    kl = torch.where(mask, rollout.logprobs - rollout.ref_logprobs, torch.zeros_like(rollout.logprobs))
    return ScoredRollout(rollout, scores, valid, mask, kl, group_size)


def micro_losses(algorithm: Algorithm, roles, batch: ScoredRollout, adv, idx, share: StepShare, temperature: float,
                 forward: tuple | None = None):
    """Loss of one micro-batch `idx`, scaled by its share of the step.

    `forward`: the rollout's own policy forward over all rows (`Rollout.policy_forward`), used
    instead of running it again when the weights have not changed since."""
    rollout = batch.rollout
    q, qm, r, rm = (t[idx] for t in (rollout.query_ids, rollout.query_mask, rollout.response_ids, batch.mask))
    if forward is not None:
        logits, values = forward[0][idx], (forward[1][idx] if forward[1] is not None else None)
    else:
        logits, values = roles.logits_and_values(q, qm, r, rm)
    logprobs = selective_log_softmax(logits, r, temperature)
    return algorithm.loss(logprobs, values.float() if values is not None else None, batch, adv, idx, share)


def update_passes(algorithm: Algorithm, roles, optimizer, scheduler, batch: ScoredRollout, adv, cfg, generator,
                  update: int = 0, prompt_keys: list[int] | None = None) -> dict:
    """Step 5: algorithm.epochs x num_mini_batches optimiser steps; returns averaged stats, and under
    "skipped" how many of those steps a non-finite loss or gradient dropped (cfg.nonfinite == "skip";
    "stop" raises naming the rollout rows and `prompt_keys[row]`, their train-prompt indices)."""
    roles.train(True)
    params = roles.trainable_parameters()
    rollout = batch.rollout
    size = rollout.batch_size
    mb_size = size // cfg.num_mini_batches
    micro = max(1, math.ceil(mb_size / cfg.gradient_accumulation_steps))
    history: list[dict] = []
    skipped = 0
    rollout_tokens = batch.mask.sum().clamp(min=1).item()
    # the rollout's forward is the first step's forward only if that step sees every row at the rollout's weights
    reuse = rollout.policy_forward if micro >= size else None
    for _ in range(algorithm.epochs):
        order = shuffled_rows(size, batch.group_size if algorithm.whole_groups else 1, generator)
        for start in range(0, size, mb_size):
            mb_idx = order[start : start + mb_size]
            share = StepShare(tokens=batch.mask[mb_idx].sum().clamp(min=1).item(), rows=len(mb_idx),
                              rollout_tokens=rollout_tokens, response_length=cfg.response_length,
                              steps=cfg.num_mini_batches, index=mb_idx)
            mb_history, loss_value, rows = [], 0.0, mb_idx
            for m_start in range(0, mb_size, micro):
                idx = mb_idx[m_start : m_start + micro]
                loss, stats = micro_losses(algorithm, roles, batch, adv, idx, share, cfg.temperature, reuse)
                reuse = None  # its weights are stale after this step
                if not torch.isfinite(loss):  # no backward through it: this minibatch's step is dropped below
                    loss_value, rows = loss.item(), idx
                    break
                loss.backward()
                mb_history.append(stats)
            try:
                grad_norm = clip_and_step(optimizer, scheduler, params, cfg.max_grad_norm, loss_value, cfg.nonfinite,
                                          algorithm.name.upper())
            except FloatingPointError as err:
                raise FloatingPointError(f"{algorithm.name.upper()} update {update}: {err} "
                                         f"({rows_named(rows.tolist(), prompt_keys)}); "
                                         "no checkpoint written after it") from err
            if grad_norm is None:  # dropped: its stats stay out of the averages
                skipped += 1
                continue
            mb_history[-1]["grad_norm"] = grad_norm.detach()
            history.extend(mb_history)
    return {**average_stats(history), "skipped": skipped}


def shuffled_rows(size: int, group: int, generator) -> torch.Tensor:
    """A random order of the rollout's rows; with group > 1 a random order of whole groups, each contiguous."""
    if group == 1:
        return torch.randperm(size, generator=generator)
    groups = torch.randperm(size // group, generator=generator)
    return (groups.unsqueeze(1) * group + torch.arange(group)).reshape(-1)


def rows_named(rows: list[int], prompt_keys: list[int] | None) -> str:
    """Rollout rows, and the train prompts they answered, for an error message."""
    named = f"rollout rows {rows}"
    return f"{named}, train prompts {[prompt_keys[r] for r in rows]}" if prompt_keys is not None else named


def average_stats(history: list[dict]) -> dict:
    """Mean of each stat over the steps; extremes (`*_max`, `*_min`) keep their extreme."""
    keys = {k for h in history for k in h}
    out = {}
    for key in keys:
        values = torch.stack([h[key].float() for h in history if key in h])
        if key.endswith("_max"):
            out[key] = values.max().item()
        elif key.endswith("_min"):
            out[key] = values.min().item()
        else:
            out[key] = values.mean().item()
    return out


def rollout_metrics(batch: ScoredRollout, prompt_keys: list[int]) -> dict:
    """Per-update metrics every algorithm logs (README "Metrics"); `prompt_keys[b]` names row b's prompt.

    objective/kl is the mean summed k1 KL of the valid responses, whatever the algorithm does with KL."""
    rollout, valid, scores = batch.rollout, batch.valid, batch.scores
    mask = rollout.response_mask
    lengths = mask.sum(dim=1).float()
    return {
        "objective/scores": scores[valid].mean().item() if valid.any() else float("nan"),
        "objective/kl": batch.sequence_kl[valid].mean().item(),
        "objective/entropy": masked_mean(rollout.entropy, mask).item(),
        "val/num_eos_tokens": int(rollout.ended_with_eos.sum().item()),
        "response/length_mean": lengths.mean().item(),
        "reward/invalid_rows": int((~valid).sum().item()),
        **diversity_metrics(rollout.response_ids, mask, rollout.ended_with_eos, prompt_keys, batch.group_size),
    }


def draw_prompts(order: list[int], count: int, group: int, generator, num_rows: int) -> tuple[list[int], list[int]]:
    """Step 1: the next `count` prompts of shuffled passes over the train split, each repeated `group` times
    (contiguous); returns the batch's prompt indices and the order left."""
    while len(order) < count:
        order.extend(torch.randperm(num_rows, generator=generator).tolist())
    picked, order = order[:count], order[count:]
    return [i for i in picked for _ in range(group)], order


def train_online(cfg, algorithm: Algorithm, run: RunDir | None = None, reward_fn=None,
                 monitor: Monitor | None = None) -> RunResult:
    """Run `algorithm` as configured; returns the run folder and the HF policy folder it wrote.

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
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)
    configure_threads(cfg.threads)
    configure_allocator(cfg.mmap_threshold_mib)
    seed_everything(cfg.seed, cfg.deterministic)
    roles, tokenizer = build_roles(cfg, critic=algorithm.critic)
    prompts = sources.prompt_splits(cfg, tokenizer)
    train_rows = prompts.train
    verifier = build_verifier(cfg, prompts)
    normalisation: dict = {}
    if reward_fn is None:
        reward_fn, normalisation = build_reward(cfg, tokenizer, roles.policy, train_rows[: cfg.calibration_prompts])
    prompt_ids = data.encode_prompts(tokenizer, [r.prompt for r in train_rows])
    run, resumed = open_run(cfg, algorithm.name) if run is None else (run, None)

    group = algorithm.samples_per_prompt
    num_updates = cfg.total_episodes // cfg.batch_size
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg, fused=True)  # steps every minibatch
    scheduler = make_scheduler(optimizer, cfg, num_updates * algorithm.epochs * cfg.num_mini_batches)
    generator = torch.Generator().manual_seed(cfg.seed)  # prompt order and minibatches
    device = next(roles.policy.parameters()).device
    sampler = torch.Generator(device=device).manual_seed(sampling_seed(cfg.seed))  # token sampling, on the model's device
    # Rollouts sample from the full softmax: with top-k / top-p the sampling policy would
    # not be the one whose log-probs the loss uses. top_k / top_p apply to evaluation only.
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature, top_k=0, top_p=1.0)
    # one minibatch of one micro-batch: the rollout's policy forward is also the first training forward
    keep_graph = cfg.reuse_rollout_forward and cfg.num_mini_batches == 1 and cfg.gradient_accumulation_steps == 1
    evaluator = Evaluator(prompts.validation, tokenizer, cfg, run, verifier, reward_fn)
    signal = evaluator.signal  # val/pass_rate (verifier) or val/reward: what keep_best and the monitor read
    if getattr(monitor, "signal", signal) != signal:
        raise ValueError(f"the monitor watches {monitor.signal} but this run's held-out signal is {signal}")
    watch = RunWatch(monitor, run, roles, cfg.keep_best, signal)
    generators = {"order": generator, "sampler": sampler}
    if resumed is None:  # what the starting policy gives RL to reinforce, per family: RUN/headroom.json (in setup)
        record_start_headroom(roles.policy, tokenizer, prompts.validation, verifier, cfg, run)
    # wall time split for summary.json: loading and building, the updates themselves (steps 1-6 up
    # to logging: what a throughput figure divides by), evaluations, checkpoints + the final save
    walls = {"setup": time.time() - started, "loop": 0.0, "evaluation": 0.0, "save": 0.0}
    if resumed is None:
        first = evaluator.evaluate(roles.policy, step=0, episode=0)
        walls["evaluation"] = time.time() - started - walls["setup"]
        watch.observe(0, first)
        progress = Progress(first=first, last_eval=first)
    else:
        progress = unpack_online(resumed, roles, optimizer, scheduler, algorithm, generators, watch)
        resumed.commit()  # only now cut the histories back, record the resume
        walls.update({k: progress.walls.get(k, 0.0) for k in ("loop", "evaluation", "save")})  # max_seconds too
    first, last_eval, last, order = progress.first, progress.last_eval, progress.last, progress.order
    done, episode, finished, skipped = progress.update, progress.episode, progress.finished, progress.skipped
    budget_stop = progress.budget_stop
    pack = lambda: pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(  # noqa: E731
        done, episode, order, first, last_eval, last, finished, skipped, dict(walls), budget_stop),
        watch)  # reads the loop's variables
    start = num_updates if finished else done
    resumed_at = resumed.step if resumed is not None else None  # that checkpoint is on disk already
    with Checkpointer(run.path, cfg.save_every, cfg.keep_last_n, resumed_at) as saver:  # SIGINT / SIGTERM handlers
        bar = tqdm(range(start + 1, num_updates + 1), desc=algorithm.name, unit="update", disable=not cfg.progress)
        for update in bar:
            t0 = time.time()
            # 1. prompts, each asked `group` times
            batch_ids, order = draw_prompts(order, cfg.batch_size // group, group, generator, len(train_rows))
            rows = [train_rows[i] for i in batch_ids]
            # 2. rollout: generate, then old / reference log-probs (and values) in one pass each
            rollout = collect_rollout(roles, [prompt_ids[i] for i in batch_ids], pad_id=tokenizer.pad_token_id,
                                      eos_id=tokenizer.eos_token_id, settings=settings, generator=sampler,
                                      keep_graph=keep_graph)
            t1 = time.time()
            # 3. scores, with the missing-EOS penalty; rows the reward failed on are masked out
            scores, valid = score_rollout(rollout, reward_fn, tokenizer, rows, cfg.missing_eos_penalty)
            if not valid.any():
                raise FloatingPointError(f"update {update}: the reward source failed on every row of the batch")
            batch = scored_batch(rollout, scores, valid, group)
            # 4. the algorithm's advantages
            adv = algorithm.advantages(batch)
            bad_rows = (~torch.isfinite(adv.advantages)).any(dim=1)
            if adv.returns is not None:
                bad_rows |= (~torch.isfinite(adv.returns)).any(dim=1)
            t2 = time.time()
            # 5. passes over minibatches (non-finite advantages: stop, or drop the whole update's steps)
            if bad_rows.any() and cfg.nonfinite == "stop":
                raise FloatingPointError(f"{algorithm.name.upper()} update {update}: non-finite advantages "
                                         f"({rows_named(bad_rows.nonzero().flatten().tolist(), batch_ids)}); "
                                         "no checkpoint written after it")
            # a changed mask changes the attention of the training forward: the rollout's forward is not reused
            if not bool(valid.all()):
                batch = dataclasses.replace(batch, rollout=dataclasses.replace(rollout, policy_forward=None))
            stats = {"skipped": algorithm.epochs * cfg.num_mini_batches} if bad_rows.any() else update_passes(
                algorithm, roles, optimizer, scheduler, batch, adv, cfg, generator, update, batch_ids)
            skipped += stats.pop("skipped")
            t3 = time.time()
            # 6. the algorithm's state, metrics, periodic evaluation
            algorithm.after_update(batch)
            episode += cfg.batch_size
            generated_tokens = int(rollout.response_mask.sum().item())
            last = {
                **rollout_metrics(batch, batch_ids), **adv.metrics, **algorithm.step_metrics(stats),
                "lr": scheduler.get_last_lr()[0], "episode": episode, "eps": cfg.batch_size / (t3 - t0),
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
            # 7. the monitor's stopping rule (validation patience, or an alarm listed in stop_on_alarms),
            # or the time budget (then the policy is evaluated once more, unless that just happened)
            if watch.should_stop(update, episode):
                break
            if cfg.max_seconds and cycle_seconds(walls) >= cfg.max_seconds:
                budget_stop = {"step": update, "episode": episode, "max_seconds": cfg.max_seconds}
                log.info("%s: max_seconds %.0f spent at update %d (episode %d)", algorithm.name, cfg.max_seconds,
                         update, episode)
                if last_eval.get("episode") != episode:
                    last_eval = evaluator.evaluate(roles.policy, step=update, episode=episode)
                    watch.observe(update, last_eval)
                walls["evaluation"] += time.time() - t5
                break
            # 8. checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
            saver.step_done(update, pack)
            walls["save"] += time.time() - t5

        t6 = time.time()
        finished = True
        saver.finish(done, pack)  # before the best policy may be restored: a resume continues from `done`

    monitored = watch.finish(done, last_eval[signal])  # restores the best policy when it should
    model_dir = save_policy_models(roles, tokenizer, run.path)
    walls["save"] += time.time() - t6
    held_out = saved_policy_numbers(first, last_eval, last, monitored, signal)
    summary = run.update_summary(
        stage=algorithm.name, reward=reward_kind(cfg),
        reward_functions=[s for s in cfg.reward_fn.split(",") if s.strip()],
        reward_normalisation=normalisation, prompts=prompts.source, samples_per_prompt=group,
        held_out=held_out_description(signal, verifier), updates=done, episodes=episode, **held_out,
        wall_time_s={**{k: round(v, 3) for k, v in walls.items()}, "total": round(time.time() - started, 3)},
        model_dir=str(model_dir), **monitored, budget_stop=budget_stop,
        nonfinite={"mode": cfg.nonfinite, "skipped_updates": skipped},
    )
    run.close()
    return RunResult(run.path, summary, model_dir)


def cycle_seconds(walls: dict) -> float:
    """Time of the cycle so far (updates, evaluations, checkpoints): what `max_seconds` bounds."""
    return walls["loop"] + walls["evaluation"] + walls["save"]


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
