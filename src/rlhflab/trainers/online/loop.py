"""The one online cycle every online algorithm runs (PPO, GRPO, RLOO, REINFORCE).

Each update (docs/ppo.md "Step by step" numbers them for PPO):
  1. sample `batch_size / k` prompts, each asked `k = algorithm.samples_per_prompt` times
  2. generate responses; old log-probs, reference log-probs (and values, with a critic), once
  3. score the finished responses; subtract `missing_eos_penalty` where EOS never came, and DAPO's overlong
     penalty near the length cap (`overlong_buffer_len`)
  4. the algorithm's advantages (GAE with a critic; group, leave-one-out or running baselines)
  5. `algorithm.epochs` passes over shuffled minibatches of the algorithm's loss: gradient
     clipping, AdamW, LR schedule
  6. the algorithm's own state (PPO's KL coefficient), metrics, evaluation every `eval_every`
  7. if a monitor was given: feed it each logged row, log its alarms, stop when it says so
     (docs/reading-a-run.md "Alarms and stopping"); stop too when `max_seconds` is spent
  8. checkpoint every `save_every` updates, at the end, and on SIGINT / SIGTERM
     (docs/reading-a-run.md "Checkpoints and resume"); `--resume` continues bit for bit

Several processes (torchrun / accelerate launch; docs/scaling-out.md "Several processes"): `batch_size` is the
global batch, each rank generates and scores its share of the prompts, every rank then holds the whole
scored rollout, so steps 4-7 are the single-process ones; trainers/online/ranks.py says how.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
from tqdm.auto import tqdm

from rlhflab import data, models, parallel, rewards, sources
from rlhflab.checkpoint import Checkpointer, open_run
from rlhflab.core import length_shaped_scores, masked_mean, sampler_correction_weights
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.models.precision import precision_from_config
from rlhflab.rollout import GenerationSettings, decode_responses, response_tokens
from rlhflab.rollout.backends import generation_autocast
from rlhflab.rollout.diversity import diversity_metrics
from rlhflab.rollout.rollout import Rollout, collect_rollout
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.headroom import record_start_headroom
from rlhflab.trainers.online.algorithm import Algorithm, ScoredRollout
from rlhflab.trainers.online.async_rollouts import PromptDraws, async_rollouts, check_async, in_flight_tensors
from rlhflab.trainers.online.dynamic import Round, check_dynamic, refill
from rlhflab.trainers.online.evaluate import Evaluator
from rlhflab.trainers.online.monitor import Monitor, RunWatch
from rlhflab.trainers.online.prompt_filter import check_prompt_filter, filtered_rows, probe_train_prompts
from rlhflab.trainers.online.passes import (average_stats, micro_losses, rows_named, shuffled_rows,  # noqa: F401
                                            update_passes)
from rlhflab.trainers.online.ranks import (OnlineRanks, check_world, gather_rollout, rollout_generator,
                                           rollout_place, wrap_roles)
from rlhflab.trainers.online.save import save_policy_models
from rlhflab.trainers.online.setup import (build_reward, build_roles, build_verifier, check_online_config,
                                           reward_kind, sampler_correction_mode)
from rlhflab.trainers.online.state import Progress, pack_online, unpack_online
from rlhflab.trainers.setup import configure_allocator, configure_threads, make_optimizer, make_scheduler
from rlhflab.trainers.setup import seed_everything, stream_seed

log = logging.getLogger("rlhflab")


def score_rollout(rollout: Rollout, reward_fn, tokenizer, rows: list[PromptRow], penalty: float,
                  global_step: int = 0, overlong: tuple[int, int, float] = (0, 0, 0.0)):
    """(B,) scores with the missing-EOS penalty and DAPO's overlong penalty (`overlong`: the length cap, the
    buffer, the factor; core/shaping.py), and (B,) validity of each row. The reward is told each response's token
    ids (its EOS included, as TRL's `completion_ids`) and the optimiser steps done so far."""
    texts = decode_responses(tokenizer, rollout.response_ids, rollout.response_mask, tokenizer.eos_token_id)
    context = rewards.ScoreContext(completion_ids=response_tokens(rollout.response_ids, rollout.response_mask),
                                   global_step=global_step)
    scored = rewards.as_scored(rewards.score(reward_fn, [r.prompt for r in rows], texts, rows, context))
    if scored.scores.shape != (rollout.batch_size,):
        raise UserInputError(f"the reward returned {tuple(scored.scores.shape)} scores for {rollout.batch_size} responses",
                             "reward_fn", "return one score per response, in the order given")
    device = rollout.response_ids.device
    scores = length_shaped_scores(scored.scores.float().to(device), rollout.response_mask.sum(dim=1),
                                  rollout.ended_with_eos, penalty, *overlong)
    valid = scored.valid.to(device) & torch.isfinite(scores)
    return torch.where(valid, scores, torch.zeros_like(scores)), valid


def rollout_of_update(ranks: OnlineRanks, update: int, batch_ids: list[int], prompt_ids: list[list[int]],
                      train_rows: list[PromptRow], reward_fn, tokenizer, settings: GenerationSettings, cfg,
                      group: int, keep_graph: bool, sampled=None, steps_per_update: int = 1, sampling_round: int = 0):
    """Steps 2-3 for the global batch `batch_ids` (one train-prompt index per answer): this rank generates and
    scores its share of the prompts, then every rank's rows are gathered. Returns the global rollout,
    its (B,) scores and validity, and this rank's seconds of scoring. `sampled`: (responses, seconds waited)
    the asynchronous generator delivered for the global batch, of which this rank keeps its share;
    `sampling_round`: a --dynamic_sampling refill round (its own sampling noise)."""
    world = ranks.world
    share = parallel.share_of(len(batch_ids) // group, world)  # whole prompts: a group stays on one rank
    mine = [batch_ids[p * group + k] for p in share.positions[: share.real] for k in range(group)]
    place = rollout_place([prompt_ids[i] for i in batch_ids], share, group) if world.distributed else None
    if sampled is not None and world.distributed:
        sampled = (sampled[0].rows(place.first, len(mine)), sampled[1])
    rollout = collect_rollout(ranks.roles, [prompt_ids[i] for i in mine], pad_id=tokenizer.pad_token_id,
                              eos_id=tokenizer.eos_token_id, settings=settings,
                              generator=rollout_generator(cfg.seed, update, ranks.device, sampling_round),
                              keep_graph=keep_graph,
                              place=place, response_width=world.max if world.distributed else None, sampled=sampled)
    t1 = time.time()
    scores, valid = score_rollout(rollout, reward_fn, tokenizer, [train_rows[i] for i in mine],
                                  cfg.missing_eos_penalty, global_step=(update - 1) * steps_per_update,
                                  overlong=(cfg.response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor))
    if world.distributed:
        scores, valid = parallel.gather_rows(scores, world), parallel.gather_rows(valid.to(torch.uint8), world).bool()
    return gather_rollout(rollout, world), scores, valid, time.time() - t1


def scored_batch(rollout: Rollout, scores, valid, group_size: int) -> ScoredRollout:
    mask = rollout.response_mask & valid.unsqueeze(1)
    kl = torch.where(mask, rollout.logprobs - rollout.ref_logprobs, torch.zeros_like(rollout.logprobs))
    return ScoredRollout(rollout, scores, valid, mask, kl, group_size)


def with_sampler_weights(batch: ScoredRollout, cfg, policy_gradient: bool = True, fresh: bool = False) -> ScoredRollout:
    """`batch` with the --sampler_correction weights of its tokens (trainer's old log-probs against the
    sampler's), or as it is when the correction is off or the algorithm has no policy-gradient term to weight
    (`policy_gradient` False: online DPO). A sampler that reported no log-probs is warned about once. `fresh`:
    sampled by the asynchronous generator with the trainer's own weights (staleness 0), which `auto` corrects
    no more than this process's own sampler (the synchronous loop's update, bit for bit)."""
    rollout = batch.rollout
    mode = "none" if fresh and cfg.sampler_correction == "auto" else sampler_correction_mode(cfg)
    if mode == "none" or not policy_gradient:
        return batch
    if rollout.sampler_logprobs is None:
        warn_uncorrected(mode, cfg.generation_backend)
        return batch
    weights = sampler_correction_weights(rollout.logprobs, rollout.sampler_logprobs, batch.mask, mode,
                                         cfg.sampler_correction_min, cfg.sampler_correction_max)
    return dataclasses.replace(batch, sampler_weights=weights)


@functools.lru_cache(maxsize=None)
def warn_uncorrected(mode: str, backend: str) -> None:
    """Once per (mode, backend): the sampler reported no log-probs, so --sampler_correction has nothing to weigh."""
    log.warning("--sampler_correction %s: the %s sampler reported no log-probs; the update is not corrected",
                mode, backend)


def rollout_metrics(batch: ScoredRollout, prompt_keys: list[int], weight_bounds: tuple[float, float]) -> dict:
    """Per-update metrics every algorithm logs (docs/reading-a-run.md "Metrics"); `prompt_keys[b]` names row b's prompt.

    objective/kl is the mean summed k1 KL of the valid responses, whatever the algorithm does with KL.
    `weight_bounds`: the --sampler_correction bounds (low, high)."""
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
        **sampler_metrics(rollout),
        **sampler_weight_metrics(batch, *weight_bounds),
    }


def sampler_weight_metrics(batch: ScoredRollout, low: float, high: float) -> dict:
    """The --sampler_correction weights of the update's tokens: mean, extremes, the share at a bound [low, high]
    (truncate modes: clamped there) and the share set to 0 (mask modes)."""
    if batch.sampler_weights is None:
        return {}
    weights, mask = batch.sampler_weights, batch.mask
    big = torch.full_like(weights, float("inf"))
    return {"sampler/is_weight_mean": masked_mean(weights, mask).item(),
            "sampler/is_weight_min": torch.where(mask, weights, big).min().item(),
            "sampler/is_weight_max": torch.where(mask, weights, -big).max().item(),
            "sampler/is_truncated_share": masked_mean(((weights == low) | (weights == high)).float(), mask).item(),
            "sampler/is_dropped_share": masked_mean((weights == 0).float(), mask).item()}


def sampler_metrics(rollout) -> dict:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's (the rollout's `logprobs`,
    what the loss reads): the mean and largest |difference| per token, and the k1 estimate of KL(sampler ||
    trainer) per response, sum over its tokens of log p_sampler - log p_trainer (the tokens are the sampler's
    draws). ~0 for the lean and HF samplers in float32; kernels and precision move it, and so does top-k / top-p
    (the sampler draws from the cut distribution, the trainer scores the whole one). {} where the backend does
    not report its log-probs."""
    if rollout.sampler_logprobs is None:
        return {}
    mask = rollout.response_mask
    gap = torch.where(mask, rollout.sampler_logprobs - rollout.logprobs, torch.zeros_like(rollout.logprobs))
    return {"sampler/logprob_diff_mean": masked_mean(gap.abs(), mask).item(),
            "sampler/logprob_diff_max": gap.abs().max().item(),
            "sampler/kl": gap.sum(dim=1).mean().item()}


def trainer_threads(cfg, world: parallel.World) -> int:
    """--threads, or (0) the cores shared by this machine's ranks. An asynchronous generator's --generator_threads
    are not taken off: it samples for a fraction of each update (GRPO ~30 %, PPO ~10 % on the demo's shape), and
    on 2 cores a 2-thread trainer beside a 1-thread generator ran 1.14x (GRPO) and 1.05x (PPO) the best
    synchronous loop where a 1-thread trainer ran 1.05x and 0.79x (benchmarks/async_speed.py)."""
    return world.threads(cfg.threads)


def train_online(cfg, algorithm: Algorithm, run: RunDir | None = None, reward_fn=None,
                 monitor: Monitor | None = None, given: Given = NOTHING) -> RunResult:
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
    world = parallel.init_world(cfg.device)
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)
    check_world(cfg, algorithm.samples_per_prompt, algorithm.whole_groups, world)
    strategy = parallel.resolve_strategy(cfg.parallel_strategy, world)
    check_async(cfg, strategy, algorithm.policy_gradient)
    check_dynamic(cfg, algorithm.name, algorithm.samples_per_prompt, algorithm.group_relative)
    # before any model is loaded: what the device cannot do is refused here (models/precision.py)
    precision = precision_from_config(cfg, world.device, strategy)
    configure_threads(trainer_threads(cfg, world))
    models.configure_logits_chunks(cfg.logits_chunk_mib)
    configure_allocator(cfg.mmap_threshold_mib)
    seed_everything(cfg.seed, cfg.deterministic)
    # the prompts and the verifier are checked before any model is loaded (a bad row is refused in seconds)
    prompts = sources.prompt_splits(cfg, models.load_tokenizer(cfg.tokenizer or cfg.model,
                                                                trust_remote_code=cfg.trust_remote_code))
    train_rows = prompts.train
    verifier = build_verifier(cfg, prompts, given)
    check_prompt_filter(cfg, verifier is not None)
    roles, tokenizer = build_roles(cfg, critic=algorithm.critic, precision=precision)
    normalisation: dict = {}
    if reward_fn is None:
        reward_fn, normalisation = build_reward(cfg, tokenizer, roles.policy, train_rows[: cfg.calibration_prompts],
                                                precision, given)
    prompt_ids = data.encode_prompts(tokenizer, [r.prompt for r in train_rows])
    world.check_same(prompt_ids, "the tokenised train prompts")
    ranks = wrap_roles(roles, cfg, world)  # before the optimiser: FSDP2 replaces the parameters
    run, resumed = open_run(cfg, algorithm.name, ranks.layout, given.callbacks) if run is None else (run, None)
    prompt_filter = None  # --filter_prompts: the prompts the starting policy never or always solves left out
    if cfg.filter_prompts != "none":
        with ranks.whole_policy(on_every_rank=False) as policy, generation_autocast(policy, precision.autocast):
            prompt_filter = world.from_main(lambda: filtered_rows(cfg, run, resumed is not None, lambda: (
                probe_train_prompts(policy, tokenizer, train_rows, verifier, cfg))))
        train_rows, prompt_ids = ([rows[i] for i in prompt_filter["kept_indices"]] for rows in (train_rows, prompt_ids))

    group = algorithm.samples_per_prompt
    num_updates = cfg.total_episodes // cfg.batch_size
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg, fused=not ranks.sharded)  # steps every minibatch
    optimizer = ranks.trained.prepare(optimizer, cfg.max_grad_norm)  # DeepSpeed: its engine, around this AdamW
    scheduler = make_scheduler(optimizer, cfg, num_updates * algorithm.epochs * cfg.num_mini_batches)
    generator = torch.Generator().manual_seed(cfg.seed)  # prompt order and minibatches (the same on every rank)
    log.info("%s: %d updates x %d responses (%d per prompt), mixed precision %s (%s)", algorithm.name.upper(),
             num_updates, cfg.batch_size, group, precision.mode, ranks.layout.describe())
    # Rollouts sample from the full softmax: with top-k / top-p the sampling policy would
    # not be the one whose log-probs the loss uses. top_k / top_p apply to evaluation only.
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature, top_k=0, top_p=1.0)
    # one minibatch of one micro-batch: the rollout's policy forward is also the first training forward
    keep_graph = cfg.reuse_rollout_forward and cfg.num_mini_batches == 1 and cfg.gradient_accumulation_steps == 1 \
        and not world.distributed and not algorithm.entropy_in_loss  # several processes: a rank trains on other
    # ranks' rows too; an entropy bonus needs the entropy's graph, which the rollout's forward does not keep
    steps_per_update = algorithm.epochs * cfg.num_mini_batches  # optimiser steps: TRL's trainer_state.global_step
    evaluator = Evaluator(prompts.validation, tokenizer, cfg, run, verifier, reward_fn, steps_per_update)
    signal = evaluator.signal  # val/pass_rate (verifier) or val/reward: what keep_best and the monitor read
    if getattr(monitor, "signal", signal) != signal:
        raise ValueError(f"the monitor watches {monitor.signal} but this run's held-out signal is {signal}")
    watch = RunWatch(monitor, run, roles, cfg.keep_best, signal)
    # where the watch may copy or restore the best policy, ZeRO-3's partitions are gathered whole (every rank)
    best_policy_whole = lambda: ranks.trained.whole_parameters(enabled=watch.best is not None)  # noqa: E731
    # prompt order apart from the minibatch shuffles (the same prompts however early they are drawn: async runs
    # draw ahead); token sampling: a generator of its own per update (ranks.rollout_generator)
    prompt_order = torch.Generator().manual_seed(stream_seed("rlhflab-prompt-order", cfg.seed))
    generators = {"order": generator, "prompts": prompt_order}

    def evaluate(update: int, episode: int) -> dict:
        """The held-out evaluation, by rank 0 on the whole policy, sampling as rollouts do; its numbers on every rank."""
        with ranks.whole_policy(on_every_rank=False) as policy, generation_autocast(policy, precision.autocast):
            return world.from_main(lambda: evaluator.evaluate(policy, step=update, episode=episode))

    if resumed is None:  # what the starting policy gives RL to reinforce, per family: RUN/headroom.json (in setup)
        with ranks.whole_policy(on_every_rank=False) as policy, generation_autocast(policy, precision.autocast):
            world.from_main(lambda: record_start_headroom(policy, tokenizer, prompts.validation, verifier, cfg, run))
    # wall time split for summary.json: loading and building, the updates themselves (steps 1-6 up
    # to logging: what a throughput figure divides by), evaluations, checkpoints + the final save
    walls = {"setup": time.time() - started, "loop": 0.0, "evaluation": 0.0, "save": 0.0}
    if resumed is None:
        first = evaluate(0, 0)
        walls["evaluation"] = time.time() - started - walls["setup"]
        with best_policy_whole():
            watch.observe(0, first)
        progress = Progress(first=first, last_eval=first)
    else:
        progress = unpack_online(resumed, roles, optimizer, scheduler, algorithm, generators, watch,
                                 trained=ranks.trained if ranks.sharded else None)
        resumed.commit()  # only now cut the histories back, record the resume
        walls.update({k: progress.walls.get(k, 0.0) for k in ("loop", "evaluation", "save")})  # max_seconds too
    first, last_eval, last, order = progress.first, progress.last_eval, progress.last, progress.order
    done, episode, finished, skipped = progress.update, progress.episode, progress.finished, progress.skipped
    budget_stop, generated = progress.budget_stop, progress.generated or episode
    draws = PromptDraws(order, prompt_order, cfg.batch_size // group, group, len(train_rows))
    if progress.in_flight and not cfg.async_generation:  # an async checkpoint resumed synchronously: the prompts
        draws.order = [ids[i] for _, ids, _ in progress.in_flight for i in range(0, len(ids), group)] + draws.order

    def pack():  # reads the loop's variables
        in_flight, rollouts = ahead.in_flight() if ahead is not None else ([], {})
        return pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(
            done, episode, draws.order, first, last_eval, last, finished, skipped, dict(walls), budget_stop,
            in_flight, generated), watch, sharded=ranks.sharded, rollouts=rollouts)

    start = num_updates if finished else done
    resumed_at = resumed.step if resumed is not None else None  # that checkpoint is on disk already
    with checkpointer(run, cfg, resumed_at, ranks, optimizer) as saver, async_rollouts(  # SIGINT / SIGTERM handlers
            cfg, roles, tokenizer, settings, draws, prompt_ids, start, num_updates, progress.in_flight,
            in_flight_tensors(resumed.state) if resumed is not None else {}, world) as ahead:
        if ahead is not None:  # the generator process's start (imports, the policy's copy): set-up, not an update
            walls["setup"] += ahead.startup_s
        bar = tqdm(range(start + 1, num_updates + 1), desc=algorithm.name, unit="update",
                   disable=not (cfg.progress and world.is_main))
        for update in bar:
            t0 = time.time()
            # 1. prompts, each asked `group` times (the global batch: the same on every rank); asynchronous: the
            # prompts drawn when the rollout was asked for, and what the generator sampled for them
            sampled, staleness, async_metrics, sampling_seconds = None, 0, {}, None
            if ahead is None:
                batch_ids = draws.next()
            else:
                batch_ids, delivered, waited = ahead.take(update)
                sampled, staleness = (delivered.generated, waited), update - 1 - delivered.version
                sampling_seconds = delivered.seconds  # the generator's own, not the wait for it
                async_metrics = {"async/staleness": staleness, "async/wait_s": waited,
                                 "async/generator_s": delivered.seconds}
            # 2. rollout: generate, then old / reference log-probs (and values) in one pass each
            # 3. scores, with the missing-EOS penalty; rows the reward failed on are masked out
            rollout, scores, valid, scoring = rollout_of_update(ranks, update, batch_ids, prompt_ids, train_rows,
                                                                reward_fn, tokenizer, settings, cfg, group, keep_graph,
                                                                sampled, steps_per_update)
            dynamic_metrics = {}
            if cfg.dynamic_sampling:  # all-equal groups dropped, the batch refilled from the next prompts
                def sample_round(sampling_round: int, update: int = update) -> Round:
                    ids = draws.next()
                    return Round(ids, *rollout_of_update(ranks, update, ids, prompt_ids, train_rows, reward_fn,
                                                         tokenizer, settings, cfg, group, False, None, steps_per_update,
                                                         sampling_round))

                chosen, dynamic_metrics = refill(Round(batch_ids, rollout, scores, valid, scoring), sample_round,
                                                 cfg.batch_size // group, group, cfg.max_refill_rounds,
                                                 tokenizer.pad_token_id)
                batch_ids, rollout, scores, valid, scoring = (chosen.batch_ids, chosen.rollout, chosen.scores,
                                                              chosen.valid, chosen.scoring_s)
            generated += dynamic_metrics.get("dynamic/generated", cfg.batch_size)
            t1 = time.time() - scoring
            sampling_seconds = rollout.seconds["generation"] if sampling_seconds is None else sampling_seconds
            if not valid.any():
                raise FloatingPointError(f"update {update}: the reward source failed on every row of the batch")
            batch = with_sampler_weights(scored_batch(rollout, scores, valid, group), cfg, algorithm.policy_gradient,
                                         fresh=ahead is not None and staleness == 0)
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
                algorithm, roles, optimizer, scheduler, batch, adv, cfg, generator, update, batch_ids,
                ranks.trained if world.distributed else None)
            skipped += stats.pop("skipped")
            if ahead is not None:  # the new weights to the generator, and the next rollout they allow asked for
                ahead.after_update(roles, update)
            t3 = time.time()
            # 6. the algorithm's state, metrics, periodic evaluation
            algorithm.after_update(batch)
            episode += cfg.batch_size
            generated_tokens = int(rollout.response_mask.sum().item())
            last = {
                **rollout_metrics(batch, batch_ids, (cfg.sampler_correction_min, cfg.sampler_correction_max)), **adv.metrics, **algorithm.step_metrics(stats),
                "lr": scheduler.get_last_lr()[0], "episode": episode, "eps": cfg.batch_size / (t3 - t0),
                "tokens_per_s": generated_tokens / max(sampling_seconds, 1e-9),
                "time/generation": rollout.seconds["generation"],
                "time/scoring": rollout.seconds["forward"] + (t2 - t1), "time/training": t3 - t2,
                **({"nonfinite/skipped_updates": skipped} if cfg.nonfinite == "skip" else {}),
                **precision.metrics(),  # fp16: amp/scale, amp/skipped_steps
                **async_metrics, **dynamic_metrics,
                **({"episodes_generated": generated} if cfg.dynamic_sampling else {}),
            }
            run.log(last, step=update)
            watch.observe(update, last)
            done = update
            t4 = time.time()
            walls["loop"] += t4 - t0
            if (cfg.eval_every and update % cfg.eval_every == 0) or update == num_updates:
                last_eval = evaluate(update, episode)
                with best_policy_whole():
                    watch.observe(update, last_eval)
                bar.set_postfix({signal.removeprefix("val/"): f"{last_eval[signal]:.2f}",
                                 "kl": f"{last['objective/kl']:.2f}", "score": f"{last['objective/scores']:.2f}"})
            t5 = time.time()
            walls["evaluation"] += t5 - t4
            # 7. the monitor's stopping rule (validation patience, or an alarm listed in stop_on_alarms),
            # or the time budget (then the policy is evaluated once more, unless that just happened)
            if world.any(watch.should_stop(update, episode)):  # the same numbers on every rank: a safeguard
                break
            if world.any(bool(cfg.max_seconds) and cycle_seconds(walls) >= cfg.max_seconds):  # clocks differ
                budget_stop = {"step": update, "episode": episode, "max_seconds": cfg.max_seconds}
                log.info("%s: max_seconds %.0f spent at update %d (episode %d)", algorithm.name, cfg.max_seconds,
                         update, episode)
                if last_eval.get("episode") != episode:
                    last_eval = evaluate(update, episode)
                    with best_policy_whole():
                        watch.observe(update, last_eval)
                walls["evaluation"] += time.time() - t5
                break
            # 8. checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
            saver.step_done(update, pack)
            walls["save"] += time.time() - t5

        t6 = time.time()
        finished = True
        saver.finish(done, pack)  # before the best policy may be restored: a resume continues from `done`

    with best_policy_whole():
        monitored = watch.finish(done, last_eval[signal])  # restores the best policy when it should
    with ranks.whole_roles() as whole:
        model_dir = world.from_main(lambda: save_policy_models(whole, tokenizer, run.path))
    walls["save"] += time.time() - t6
    held_out = saved_policy_numbers(first, last_eval, last, monitored, signal)
    summary = run.update_summary(
        stage=algorithm.name, reward=reward_kind(cfg, given),
        reward_functions=[s for s in cfg.reward_fn.split(",") if s.strip()]
        + [rewards.function_name(fn) for fn, _ in given.reward_functions],
        reward_normalisation=normalisation, prompts=prompts.source, samples_per_prompt=group,
        held_out=held_out_description(signal, verifier), updates=done, episodes=episode,
        episodes_generated=generated, **held_out,
        wall_time_s={**{k: round(v, 3) for k, v in walls.items()}, "total": round(time.time() - started, 3)},
        model_dir=str(model_dir), **monitored, budget_stop=budget_stop,
        nonfinite={"mode": cfg.nonfinite, "skipped_updates": skipped},
        prompt_filter={k: v for k, v in prompt_filter.items() if k != "kept_indices"} if prompt_filter else None,
        parallel={**ranks.layout.describe(), **world.describe()},
        precision=precision.describe(),
        reward_errors=rewards.error_summary(reward_fn, verifier, world=world),  # every rank: summed over them
    )
    run.close()
    return RunResult(run.path, summary, model_dir)


def checkpointer(run: RunDir, cfg, resumed_at: int | None, ranks: OnlineRanks, optimizer) -> Checkpointer:
    """The loop's Checkpointer for this layout: FSDP2 shards (DeepSpeed: its ZeRO slices) and their moments
    written by every rank."""
    def write_shards(folder) -> None:
        ranks.trained.save_sharded(optimizer, folder)

    return Checkpointer(run.path, cfg.save_every, cfg.keep_last_n, resumed_at, layout=ranks.layout,
                        write_shards=write_shards if ranks.sharded else None)


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
