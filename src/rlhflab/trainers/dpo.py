"""DPO, IPO and SimPO: the policy trained directly on preference pairs, one explicit loop.

    rlhflab dpo --model runs/demo-.../sft/model                  # the suite's pairs
    rlhflab dpo --model M --train_file prefs.jsonl --loss_type ipo

Steps (numbered as in docs/dpo.md):
  1. policy (+ LoRA) and tokenizer; pairs tokenised with their prompt lengths (trainers/dpo_data.py)
  2. reference log-probs of every train and validation pair, computed once; the reference is then freed
     (the starting weights are the policy itself before its first step; SimPO needs none)
  3. each step: `batch_size` pairs from shuffled passes; summed (DPO) or per-token mean (IPO, SimPO)
     completion log-probs of chosen and rejected in one forward (trainers/dpo_logps.py); the loss of
     `loss_type` (rlhflab.core); clipping, AdamW, the LR schedule
  4. metrics under TRL's names every `log_every` steps; validation pairs' metrics and the verifier's
     pass rate of greedy answers every `eval_every` steps, at the start and at the end
  5. checkpoints every `save_every` steps, at the end and on SIGINT / SIGTERM; `--resume` continues bit for bit
  6. the policy as an ordinary HF folder (LoRA merged; the adapter beside it)

Several processes (docs/scaling-out.md "Several processes"): `batch_size` pairs is the global batch; each rank
trains on its block, losses are weighted by global counts, reference log-probs are computed once in
shares and gathered; rank 0 alone evaluates (on the whole model) and writes.
"""

from __future__ import annotations

import gc
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from rlhflab import models, parallel, rewards
from rlhflab.checkpoint import open_run
from rlhflab.config import DPOConfig
from rlhflab.core import dpo_loss, ipo_loss, simpo_loss
from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision, float32_for_training, precision_from_config
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.dpo_data import DPOData, PreferencePair, load_dpo_data
from rlhflab.trainers.dpo_logps import SequenceLogps, can_pack, chunked_logps, precompute_logps, row_length, select
from rlhflab.trainers.nonfinite import clip_and_step, guarded_step
from rlhflab.trainers.setup import (
    add_lora,
    configure_threads,
    make_optimizer,
    make_scheduler,
    resolve_device,
    save_policy_folder,
    seed_everything,
)
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.sft import batch_stream
from rlhflab.trainers.single_state import checkpointer, pack_single, unpack_single
from rlhflab.trainers.validation import validate_pass_rate

log = logging.getLogger("rlhflab")
SAMPLE_ANSWERS = 8  # validation answers written to samples.jsonl at each evaluation
# length_chunks 0: one forward pass per this many pairs of a micro-batch. Demo model, 1 thread: batch 32 in two
# length-sorted passes ran ~1.5x the pairs/s of one pass; batch 8 gained nothing from two.
PAIRS_PER_CHUNK = 16


# --- the losses: one visible table ------------------------------------------------------------------


@dataclass(frozen=True)
class LossType:
    loss: Callable  # (policy SequenceLogps, reference SequenceLogps | None, cfg) -> (loss, core stats)
    averaged: bool  # per-token mean log-probs (IPO, SimPO as TRL) or summed (DPO)
    reference: bool  # needs reference log-probs


LOSS_TYPES: dict[str, LossType] = {
    "sigmoid": LossType(lambda p, r, cfg: dpo_loss(p.chosen, p.rejected, r.chosen, r.rejected, cfg.beta,
                                                   cfg.label_smoothing), averaged=False, reference=True),
    "ipo": LossType(lambda p, r, cfg: ipo_loss(p.chosen, p.rejected, r.chosen, r.rejected, cfg.beta),
                    averaged=True, reference=True),
    "simpo": LossType(lambda p, r, cfg: simpo_loss(p.chosen, p.rejected, cfg.beta, cfg.simpo_gamma),
                      averaged=True, reference=False),
}
TRL_NAMES = {"chosen_rewards": "rewards/chosen", "rejected_rewards": "rewards/rejected",
             "reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins"}


def preference_loss(cfg: DPOConfig, policy: SequenceLogps, reference: SequenceLogps | None):
    """The loss of `cfg.loss_type` on summed log-probs (averaged here where the loss reads means); stats
    under TRL's names, with `logps/*` as the loss read them."""
    kind = LOSS_TYPES[cfg.loss_type]
    if reference is not None:  # precomputed on the CPU; the policy's log-probs may be on an accelerator
        reference = SequenceLogps(*(t.to(policy.chosen.device) for t in reference))
    if kind.averaged:
        policy = policy.averaged()
        reference = reference.averaged() if reference is not None else None
    loss, stats = kind.loss(policy, reference, cfg)
    named = {TRL_NAMES[k]: v.item() for k, v in stats.items()}
    named["logps/chosen"] = policy.chosen.detach().mean().item()
    named["logps/rejected"] = policy.rejected.detach().mean().item()
    return loss, {"loss": loss.item(), **named}


# --- setup ---------------------------------------------------------------------------------------


def check_dpo_config(cfg: DPOConfig, world: parallel.World = parallel.SINGLE) -> None:
    """Refuse settings that cannot work, before anything is loaded."""
    if not cfg.model:
        raise UserInputError("no policy given", "--model", "pass the SFT model folder, e.g. runs/demo-.../sft/model")
    rewards.CallLimits(cfg.reward_timeout, cfg.reward_errors)  # a negative --reward_timeout (the verifier's)
    positive = {"batch_size": cfg.batch_size, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                "beta": cfg.beta}
    for name, value in positive.items():
        if value <= 0:
            raise UserInputError(f"{name} must be > 0, got {value}", f"--{name}")
    if cfg.max_steps <= 0 and cfg.num_epochs <= 0 and cfg.max_pairs <= 0:
        raise UserInputError("no length given: max_steps, num_epochs and max_pairs are all 0", "--num_epochs",
                             "set --num_epochs 1 (or --max_steps / --max_pairs)")
    local = parallel.local_batch_size(cfg.batch_size, world)  # each process's block of the global batch
    if cfg.gradient_accumulation_steps > local:
        raise UserInputError(f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} > {local} pairs per "
                             f"process (batch_size {cfg.batch_size}): empty micro-batches", "--gradient_accumulation_steps")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise UserInputError(f"label_smoothing must be in [0, 0.5), got {cfg.label_smoothing}", "--label_smoothing")
    if cfg.label_smoothing and cfg.loss_type != "sigmoid":
        raise UserInputError(f"label_smoothing is conservative DPO's: loss_type {cfg.loss_type} has none",
                             "--label_smoothing", "use --loss_type sigmoid, or drop --label_smoothing")
    if cfg.reference and not LOSS_TYPES[cfg.loss_type].reference:
        log.warning("loss_type %s needs no reference: --reference %s is not used", cfg.loss_type, cfg.reference)


def build_policy(cfg: DPOConfig, device: torch.device | None = None):
    """The policy in float32 (whole weights train; models/precision.py) and its tokenizer, on `device` (default:
    cfg.device); LoRA comes later, after the starting weights gave the reference log-probs."""
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    policy = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                   device=device or resolve_device(cfg.device))
    if cfg.lora_r <= 0:
        policy = float32_for_training(policy, f"policy {cfg.model}")
    models.disable_dropout(policy)
    return policy, tokenizer


def reference_logps(cfg: DPOConfig, policy, dpo: DPOData, pad_id: int,
                    world: parallel.World = parallel.SINGLE) -> dict[str, SequenceLogps | None]:
    """Step 2: summed log-probs of every train and validation pair under the reference, computed once
    (several processes: each its block of the pairs, then gathered, so every rank holds all of them).
    The starting weights are the policy itself before its first step; another reference is loaded, read
    and freed. SimPO needs none."""
    if not LOSS_TYPES[cfg.loss_type].reference:
        return {"train": None, "validation": None}
    reference = policy
    if cfg.reference:
        reference = models.load_causal_lm(cfg.reference, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                          device=world.device).to(policy.dtype)
        models.disable_dropout(reference)
    packed = cfg.shared_prefix and can_pack(reference)
    out = {split: shared_precompute(reference, pairs, pad_id, packed, world) if pairs else None
           for split, pairs in (("train", dpo.train), ("validation", dpo.validation))}
    if reference is not policy:
        del reference
        gc.collect()
    return out


def shared_precompute(model, pairs: list[PreferencePair], pad_id: int, packed: bool,
                      world: parallel.World) -> SequenceLogps:
    """`precompute_logps` of all `pairs`, each rank computing its block, gathered in order on every rank."""
    share = parallel.share_of(len(pairs), world)
    mine = [pairs[i] for i in share.positions[: share.real]]
    logps = precompute_logps(model, mine, pad_id, packed) if mine else SequenceLogps(*(torch.zeros(0),) * 4)
    return SequenceLogps(*(parallel.gather_rows(t, world) for t in logps))


# --- one step, one evaluation ------------------------------------------------------------------------


def train_step(wrapped: parallel.Wrapped, optimizer, scheduler, batch: list[PreferencePair],
               reference: SequenceLogps | None, share: parallel.Share, cfg: DPOConfig, packed: bool,
               pad_id: int, precision: MixedPrecision | None = None) -> dict:
    """One optimiser step on this rank's block of the global `batch` (`share`: its real pairs first, then
    padding), in gradient_accumulation_steps micro-batches cut from them sorted by length (less padding):
    each micro-batch's mean loss over its real pairs is weighted by their share of the global batch, so the
    gradient summed over micro-batches and ranks is the whole batch's. `reference`: (B,) log-probs of
    `batch`, in its order; the loss and metrics are the whole batch's, from every rank's log-probs.
    Forwards under `precision`'s autocast (log-probs float32), backwards outside it (fp16: of the scaled loss)."""
    precision = precision or MixedPrecision()
    pairs, ref = parallel.take(batch, share), select(reference, share.positions) if reference is not None else None
    order = sorted(range(len(pairs)), key=lambda i: row_length(pairs[i], packed))
    size = math.ceil(len(pairs) / cfg.gradient_accumulation_steps)
    micro_batches = [order[s : s + size] for s in range(0, len(order), size)]
    chunks = cfg.length_chunks or max(1, size // PAIRS_PER_CHUNK)
    seen: list[SequenceLogps] = []
    for n, micro in enumerate(micro_batches):
        real = [j for j, i in enumerate(micro) if i < share.real]  # padding rows run forward, with no weight
        with wrapped.sync(n == len(micro_batches) - 1):  # gradients cross ranks once, after the last micro-batch
            with precision.autocast():
                logps = wrapped(chunked_logps, [pairs[i] for i in micro], pad_id, packed, chunks)
            if real:
                kept = logps if len(real) == len(micro) else SequenceLogps(*(t[real] for t in logps))
                loss, _ = preference_loss(cfg, kept, select(ref, [micro[j] for j in real]) if ref is not None else None)
                part = loss * (len(real) / share.total)
            else:
                # both outputs, as a real loss: ZeRO-3 fetches weights in backward per output that gets a gradient
                part = (logps.chosen.sum() + logps.rejected.sum()) * 0.0
            wrapped.backward(precision.scale(part))
        seen.append(SequenceLogps(*(t.detach() for t in logps)))
    # the whole batch's loss and metrics from every rank's log-probs (no second forward)
    with torch.no_grad():
        inverse = torch.argsort(torch.tensor(order))
        mine = SequenceLogps(*(torch.cat(t)[inverse.to(t[0].device)][: share.real] for t in zip(*seen)))
        every = SequenceLogps(*(parallel.gather_rows(t, wrapped.world) for t in mine))  # (B,) in batch order
        _, stats = preference_loss(cfg, every, reference)
    grad_norm = clip_and_step(optimizer, scheduler, wrapped.model.parameters(), cfg.max_grad_norm, stats["loss"],
                              cfg.nonfinite, "DPO", engine=wrapped, precision=precision)  # None: dropped
    return {**stats, "grad_norm": math.nan if grad_norm is None else grad_norm.item(),
            "skipped": grad_norm is None and not precision.overflowed, **precision.metrics()}


def evaluate_on_main(wrapped: parallel.Wrapped, tokenizer, dpo: DPOData, reference: SequenceLogps | None,
                     cfg: DPOConfig, step: int, run: RunDir, precision: MixedPrecision | None = None) -> dict:
    """`evaluate` by rank 0 on the whole model (as one process would), its metrics sent to every rank; under
    the autocast of the training forward and of the reference log-probs."""
    with wrapped.gathered() as whole, (precision or MixedPrecision()).autocast():
        return wrapped.world.from_main(
            lambda: evaluate(whole, tokenizer, dpo, reference, cfg, step, run, cfg.shared_prefix and can_pack(whole)))


def evaluate(policy, tokenizer, dpo: DPOData, reference: SequenceLogps | None, cfg: DPOConfig, step: int,
             run: RunDir, packed: bool) -> dict:
    """Validation pairs' loss and implicit-reward metrics (`val/...`), and `val/pass_rate` of greedy answers
    to the validation prompts when there is a verifier."""
    metrics: dict = {}
    policy.eval()
    if dpo.validation:
        logps = precompute_logps(policy, dpo.validation, tokenizer.pad_token_id, packed)
        _, stats = preference_loss(cfg, logps, reference)
        metrics.update({f"val/{k}": v for k, v in stats.items()})
    if dpo.verifier is not None and dpo.validation_rows:
        table = validate_pass_rate(policy, tokenizer, dpo.validation_rows, dpo.verifier, cfg, step, run,
                                   sample_count=SAMPLE_ANSWERS)
        metrics["val/pass_rate"] = table["overall"]
    policy.train()
    if metrics:
        run.log(metrics, step=step)
    return metrics


# --- the run -------------------------------------------------------------------------------------------


def planned_pairs(cfg: DPOConfig, num_train: int) -> tuple[int, int]:
    """(optimiser steps, pairs trained on): the smallest of max_steps, num_epochs and max_pairs. Each step
    takes batch_size pairs; the last one fewer when a pair budget ends inside it."""
    budget = math.inf
    if cfg.max_pairs > 0:
        budget = cfg.max_pairs
    if cfg.max_steps <= 0 and cfg.num_epochs > 0:
        budget = min(budget, cfg.num_epochs * num_train)
    steps = math.ceil(budget / cfg.batch_size) if budget < math.inf else cfg.max_steps
    if cfg.max_steps > 0:
        steps = min(steps, cfg.max_steps)
    return steps, int(min(budget, steps * cfg.batch_size))


def train(cfg: DPOConfig, run: RunDir | None = None, given: Given = NOTHING) -> RunResult:
    """Run DPO / IPO / SimPO as configured; returns the run folder and the HF policy folder it wrote."""
    started = time.time()
    world = parallel.init_world(cfg.device)
    check_dpo_config(cfg, world)
    # before any model is loaded: what the device cannot do is refused here (models/precision.py)
    precision = precision_from_config(cfg, world.device, parallel.resolve_strategy(cfg.parallel_strategy, world))
    configure_threads(world.threads(cfg.threads))
    models.configure_logits_chunks(cfg.logits_chunk_mib)
    seed_everything(cfg.seed, cfg.deterministic)
    # 1. pairs, validated and tokenised before any model is loaded and the run folder exists (every rank builds the
    # same), then the policy
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    dpo = load_dpo_data(cfg, tokenizer, world, given.verifier)
    world.check_same(dpo.train, "the tokenised training pairs")
    policy, tokenizer = build_policy(cfg, world.device)
    pad_id = tokenizer.pad_token_id
    # 2. reference log-probs, once (then no reference is resident), under the training forward's autocast: the
    # first step's implicit rewards are then exactly 0
    with precision.autocast():
        references = reference_logps(cfg, policy, dpo, pad_id, world)
    if cfg.lora_r > 0:
        policy = add_lora(policy, cfg, f"policy {cfg.model}")
    policy.train()
    if cfg.gradient_checkpointing:  # after the reference log-probs (no grad), before wrapping
        models.enable_gradient_checkpointing(policy, "DPO policy")
    wrapped = parallel.wrap_model(policy, world, cfg.parallel_strategy)
    packed = cfg.shared_prefix and can_pack(policy) and not parallel.holds_shards(policy)  # packed rows: whole weights
    run, resumed = open_run(cfg, "dpo", wrapped.layout, given.callbacks) if run is None else (run, None)
    total, pair_budget = planned_pairs(cfg, len(dpo.train))
    optimizer = wrapped.prepare(make_optimizer(wrapped.model.parameters(), cfg, fused=True), cfg.max_grad_norm)
    scheduler = make_scheduler(optimizer, cfg, total)
    batches = batch_stream([0] * len(dpo.train), cfg.batch_size, 0, random.Random(cfg.seed))  # lengths unused: no grouping
    log.info("DPO (%s): %d train / %d validation pairs, %d steps x %d pairs, mixed precision %s%s", cfg.loss_type,
             len(dpo.train), len(dpo.validation), total, cfg.batch_size, precision.mode,
             ", shared-prefix rows" if packed else "")
    walls = {"setup": time.time() - started, "loop": 0.0, "evaluation": 0.0, "save": 0.0}
    if resumed is None:
        first = evaluate_on_main(wrapped, tokenizer, dpo, references["validation"], cfg, 0, run, precision)
        walls["evaluation"] = time.time() - started - walls["setup"]
        progress = {"step": 0, "pairs_seen": 0, "first": first, "last_eval": first, "last": {}, "skipped": 0,
                    "loop_seconds": 0.0, "budget_stop": None}
    else:  # weights, optimiser, RNGs back; replay the data order of the steps done
        progress = unpack_single(resumed, wrapped, optimizer, scheduler)
        resumed.commit()  # only now cut the histories back, record the resume
        precision.load_state_dict(progress.get("amp", {}))
        for _ in range(progress["step"]):
            next(batches)
    pairs_before = progress["pairs_seen"]
    pack = lambda: pack_single(wrapped, optimizer, scheduler,  # noqa: E731
                               {**progress, "amp": precision.state_dict()})
    bar = tqdm(range(progress["step"] + 1, total + 1), desc=f"dpo ({cfg.loss_type})", unit="step",
               disable=not (cfg.progress and world.is_main))
    with checkpointer(run, cfg, resumed, wrapped, optimizer) as saver:  # SIGINT / SIGTERM handlers
        for step in bar:
            t0 = time.time()
            # 3. the next pairs (shuffled passes over the train pairs) and one optimiser step on them
            batch_ids = next(batches)[: pair_budget - progress["pairs_seen"]]
            stats, progress["skipped"] = guarded_step(
                lambda: train_step(wrapped, optimizer, scheduler, [dpo.train[i] for i in batch_ids],
                                   select(references["train"], batch_ids) if references["train"] else None,
                                   parallel.share_of(len(batch_ids), world), cfg, packed, pad_id, precision),
                f"DPO step {step}", f"train pairs {batch_ids}", progress["skipped"], cfg.nonfinite)
            progress["pairs_seen"] += len(batch_ids)
            progress["step"] = step
            t1 = time.time()
            walls["loop"] += t1 - t0
            # 4. metrics; validation every eval_every steps and at the end (or when the time budget ran out)
            over_time = world.any(cfg.max_seconds > 0 and progress["loop_seconds"] + t1 - t0 >= cfg.max_seconds)
            last_step = step == total or over_time
            if step % cfg.log_every == 0 or last_step:
                progress["last"] = {**stats, "lr": scheduler.get_last_lr()[0], "pairs_seen": progress["pairs_seen"],
                                    "epoch": progress["pairs_seen"] / len(dpo.train), "elapsed_s": time.time() - started}
                run.log(progress["last"], step=step)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['rewards/accuracies']:.2f}")
            if (cfg.eval_every and step % cfg.eval_every == 0) or last_step:
                progress["last_eval"] = evaluate_on_main(wrapped, tokenizer, dpo, references["validation"], cfg, step,
                                                         run, precision)
            t2 = time.time()
            walls["evaluation"] += t2 - t1
            progress["loop_seconds"] += t2 - t0
            if over_time:
                progress["budget_stop"] = {"max_seconds": cfg.max_seconds, "step": step,
                                           "episode": progress["pairs_seen"]}
                bar.close()
            # 5. checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
            saver.step_done(step, pack)
            walls["save"] += time.time() - t2
            if over_time:
                break
        t3 = time.time()
        saver.finish(progress["step"], pack)
    # 6. the policy as an ordinary HF folder (rank 0)
    with wrapped.gathered() as whole:
        model_dir = world.from_main(lambda: save_policy_folder(whole, tokenizer, run.path, cfg.lora_r > 0))
    walls["save"] += time.time() - t3
    summary = run.update_summary(**summary_fields(cfg, dpo, progress, walls, started, pairs_before),
                                 model_dir=str(model_dir), parallel={**wrapped.layout.describe(), **world.describe()},
                                 precision=precision.describe())
    run.close()
    return RunResult(run.path, summary, model_dir)


def summary_fields(cfg: DPOConfig, dpo: DPOData, progress: dict, walls: dict, started: float,
                   pairs_before: int) -> dict:
    """summary.json: what ran, how far, the held-out numbers at the start and the end, where the time went."""
    first, last_eval = progress["first"], progress["last_eval"]
    held_out = {key: {"start": first.get(f"val/{name}"), "end": last_eval.get(f"val/{name}")}
                for key, name in (("validation_pass_rate", "pass_rate"), ("validation_accuracy", "rewards/accuracies"),
                                  ("validation_margin", "rewards/margins"))}
    return {"stage": "dpo", "loss_type": cfg.loss_type, "beta": cfg.beta, "prompts": dpo.source,
            "train_pairs": len(dpo.train), "validation_pairs": len(dpo.validation),
            "verifier": getattr(dpo.verifier, "name", type(dpo.verifier).__name__) if dpo.verifier else None,
            "steps": progress["step"], "pairs_seen": progress["pairs_seen"], "episodes": progress["pairs_seen"],
            **held_out, "final": progress["last"], "stopped": None, "budget_stop": progress["budget_stop"],
            "pairs_per_s": round((progress["pairs_seen"] - pairs_before) / max(walls["loop"], 1e-9), 1),
            "wall_time_s": {**{k: round(v, 3) for k, v in walls.items()}, "total": round(time.time() - started, 3)},
            "nonfinite": {"mode": cfg.nonfinite, "skipped_updates": progress["skipped"]}}
