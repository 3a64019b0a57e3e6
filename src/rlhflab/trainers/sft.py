"""Supervised fine-tuning: next-token loss on completion tokens only.

    rlhflab sft --config configs/sft_tiny.yaml

One optimiser step = `batch_size` sequences split into
`gradient_accumulation_steps` micro-batches. The loss is the sum of token
losses over the whole step divided by the step's completion-token count, so
accumulation gives the same update as one big batch (a per-micro-batch mean
would weight short micro-batches more; see transformers issue #34191).

Several processes (docs/scaling-out.md "Several processes"): `batch_size` stays the global batch; each rank
trains on its block of it and normalises by the global token count, so the update is the single-process
one. Rank 0 alone evaluates (on the whole model) and writes; the others wait for its results.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rlhflab import data, models, parallel, rewards, sources
from rlhflab.checkpoint import open_run
from rlhflab.config import SFTConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision, precision_from_config
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.nonfinite import clip_and_step, guarded_step
from rlhflab.trainers.single_state import checkpointer, pack_single, unpack_single
from rlhflab.trainers.validation import validate_pass_rate
from rlhflab.trainers.setup import (
    configure_threads,
    load_or_build_policy,
    make_optimizer,
    make_scheduler,
    save_policy_folder,
    seed_everything,
)

log = logging.getLogger("rlhflab")


@dataclass(frozen=True)
class SFTData:
    train: list[data.TokenizedSFT]
    validation: list[data.TokenizedSFT]
    validation_rows: list[PromptRow]  # prompts the suite's checker verifies, for the pass rate (suite only)


def load_sft_data(cfg: SFTConfig, tokenizer) -> SFTData:
    """User files when given (a train file alone gives up a seeded slice for the validation loss),
    else the built-in suite (train demos + validation split, whose checker gives a pass rate)."""
    load = lambda path, split: data.load_examples(  # noqa: E731
        path, "sft", tokenizer=tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, strict=cfg.strict,
        split=split, config=cfg.dataset_config)
    validation_rows: list[PromptRow] = []
    if cfg.train_file:
        train = load(cfg.train_file, cfg.dataset_split)
        if cfg.validation_file:
            validation = load(cfg.validation_file, None)  # its split: NAME:SPLIT, else its only one
        else:
            train, validation = held_out_examples(train, cfg.seed)
    else:
        train = sources.sft_demonstrations(cfg)
        if cfg.validation_file:
            validation = load(cfg.validation_file, None)
        else:
            validation, validation_rows = sources.validation_references(cfg)
    return SFTData(
        train=data.tokenize_sft(train, tokenizer, cfg.max_length),
        validation=data.tokenize_sft(validation, tokenizer, cfg.max_length),
        validation_rows=validation_rows[: cfg.eval_prompts],
    )


def held_out_examples(examples: list, seed: int, share: float = 0.05) -> tuple[list, list]:
    """A seeded `share` of a user's train file (at least 1 row, none when it has < 20) set apart for the
    validation loss: the built-in suite's validation split says nothing about their data."""
    if len(examples) < 20:
        log.warning("no --validation_file and only %d rows: no validation loss", len(examples))
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, int(len(examples) * share))])
    log.info("no --validation_file: %d of %d rows set apart for the validation loss", len(held), len(examples))
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def completion_loss_sum(model: torch.nn.Module, batch: data.SFTBatch) -> torch.Tensor:
    """Summed cross-entropy over completion tokens (labels != -100): minus their summed log-probs, taken chunk by
    chunk at a large vocabulary (models/token_head.py), so no (B, L, V) float32 tensor is formed."""
    device = next(model.parameters()).device
    input_ids, attention, labels = (t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.labels))
    scores = models.head_inputs(model, input_ids, attention)  # predicts (B, L) positions
    targets = labels[:, 1:]
    trained = targets != -100
    return -models.token_logprobs(scores[:, :-1][trained], targets[trained]).sum()


def packed_loss_sum(model: torch.nn.Module, packed: models.PackedSequences) -> torch.Tensor:
    """`completion_loss_sum` of packed rows (models/packed_sequences.py): the same sum, no padding run."""
    scores, targets = models.packed_target_logits(model, packed)  # predicts (N,) positions, (N,) targets
    return -models.token_logprobs(scores, targets).sum()


def micro_batches(examples: list[data.TokenizedSFT], pad_id: int, parts: int,
                  packing: bool) -> list[data.SFTBatch] | list[models.PackedSequences]:
    """The step's sequences cut into `parts` micro-batches.

    Packed: several sequences per row, rows no longer than the step's longest sequence, whole rows
    per micro-batch. Padded: sorted by length before they are cut, so each micro-batch is padded only
    to its own longest sequence (on the built-in suite 2 micro-batches of 32 are 29 % padding instead
    of 46 % for one batch of 64; packed rows are ~8 %, and an SFT step ~25 % faster on 2 CPU cores)."""
    if packing:
        sequences = [(e.prompt_ids + e.completion_ids, len(e.prompt_ids)) for e in examples]
        rows = models.fill_rows([len(ids) for ids, _ in sequences], max(len(ids) for ids, _ in sequences))
        per = math.ceil(len(rows) / parts)
        return [models.pack_rows(sequences, rows[i : i + per], pad_id) for i in range(0, len(rows), per)]
    micro = math.ceil(len(examples) / parts)
    by_length = sorted(examples, key=lambda e: len(e.prompt_ids) + len(e.completion_ids))
    return [data.collate_sft(by_length[i : i + micro], pad_id) for i in range(0, len(by_length), micro)]


def train_step(wrapped: parallel.Wrapped, optimizer, scheduler, examples: list[data.TokenizedSFT], pad_id: int,
               cfg: SFTConfig, packing: bool = False, precision: MixedPrecision | None = None) -> dict:
    """One optimiser step over `examples` (this rank's block of the global batch), in
    gradient_accumulation_steps micro-batches (`micro_batches`, packed or padded); forwards under
    `precision`'s autocast, backwards outside it (fp16: of the scaled loss).

    The loss is normalised over the whole step (every rank's tokens), so the gradient is the one
    big batch's whatever the micro-batches and packing."""
    batches = micro_batches(examples, pad_id, cfg.gradient_accumulation_steps, packing)
    loss_fn = packed_loss_sum if packing else completion_loss_sum
    total_tokens = parallel.total(sum(b.num_label_tokens for b in batches), wrapped.world)  # the global count
    precision = precision or MixedPrecision()
    loss_sum = 0.0
    for i, batch in enumerate(batches):
        with wrapped.sync(i == len(batches) - 1):  # gradients cross ranks once, after the last micro-batch
            with precision.autocast():
                loss = wrapped(loss_fn, batch) / total_tokens
            wrapped.backward(precision.scale(loss))
        loss_sum += loss.item()
    loss_sum = parallel.total(loss_sum, wrapped.world)  # the global loss on every rank: all agree on a non-finite one
    grad_norm = clip_and_step(optimizer, scheduler, wrapped.model.parameters(), cfg.max_grad_norm, loss_sum,
                              cfg.nonfinite, "SFT", engine=wrapped, precision=precision)  # None: dropped
    return {"loss/sft": loss_sum, "grad_norm": math.nan if grad_norm is None else grad_norm.item(),
            "tokens": total_tokens, "skipped": grad_norm is None and not precision.overflowed, **precision.metrics()}


def use_packing(cfg: SFTConfig, model, same_passes: bool = False) -> bool:
    """`cfg.packing` where the model allows it (`models.can_pack_sequences`); says so when it does not.
    `same_passes`: every rank must run as many micro-batches (`Wrapped.same_passes`), which packed rows do not."""
    if not cfg.packing:
        return False
    if parallel.holds_shards(model) or same_passes:  # the packed forward reads whole weights; its rows vary by rank
        log.info("SFT: every backward is a collective (FSDP2 / DeepSpeed); sequences are padded, not packed")
        return False
    if models.can_pack_sequences(model):
        return True
    log.info("SFT: %s is not a Llama / Qwen2 layout without dropout; sequences are padded, not packed",
             type(model).__name__)
    return False


@torch.no_grad()
def validation_loss(model, examples: list[data.TokenizedSFT], pad_id: int, batch_size: int = 64) -> float:
    model.eval()
    loss_sum, tokens = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = data.collate_sft(examples[start : start + batch_size], pad_id)
        loss_sum += completion_loss_sum(model, batch).item()
        tokens += batch.num_label_tokens
    model.train()
    return loss_sum / max(tokens, 1)


def evaluate_now(wrapped: parallel.Wrapped, tokenizer, sft_data: SFTData, cfg, step: int, run: RunDir,
                 precision: MixedPrecision | None = None) -> dict:
    """Held-out metrics, computed by rank 0 on the whole model (as one process would) and sent to every rank,
    under the training forward's autocast."""
    with wrapped.gathered() as model, (precision or MixedPrecision()).autocast():
        return wrapped.world.from_main(lambda: held_out_metrics(model, tokenizer, sft_data, cfg, step, run))


def held_out_metrics(model, tokenizer, sft_data: SFTData, cfg, step: int, run: RunDir) -> dict:
    metrics = {"val/loss": validation_loss(model, sft_data.validation, tokenizer.pad_token_id)} \
        if sft_data.validation else {}
    if sft_data.validation_rows:
        table = validate_pass_rate(model, tokenizer, sft_data.validation_rows, rewards.CheckerVerifier(), cfg, step,
                                   run)
        metrics["val/pass_rate"] = table["overall"]
    if metrics:
        run.log(metrics, step=step)
    return metrics


def batch_stream(lengths: list[int], batch_size: int, group_by_length: int, rng: random.Random) -> Iterator[list[int]]:
    """Batches of indices from back-to-back shuffled passes over the data.

    With group_by_length = k > 1, each run of k batches is sorted by sequence length
    before it is cut (less padding, faster steps) and the k batches are shuffled. On the
    built-in suite this groups families together and hurt learning badly (validation pass
    rate 0.07 instead of ~0.5 after 600 steps), so it is off by default.
    """
    order: list[int] = []
    per_draw = batch_size * max(1, group_by_length)
    while True:
        while len(order) < per_draw:
            epoch = list(range(len(lengths)))
            rng.shuffle(epoch)
            order.extend(epoch)
        drawn, order = order[:per_draw], order[per_draw:]
        if group_by_length <= 1:
            yield drawn
            continue
        drawn.sort(key=lengths.__getitem__)
        groups = [drawn[s : s + batch_size] for s in range(0, per_draw, batch_size)]
        rng.shuffle(groups)
        yield from groups


def train(cfg: SFTConfig, run: RunDir | None = None, given: Given = NOTHING) -> RunResult:
    """Run SFT as configured; returns the run folder and the HF model folder it wrote. `given.callbacks` watch
    the run (rlhflab.callbacks)."""
    started = time.time()
    world = parallel.init_world(cfg.device)
    configure_threads(world.threads(cfg.threads))
    models.configure_logits_chunks(cfg.logits_chunk_mib)
    seed_everything(cfg.seed, cfg.deterministic)
    if cfg.max_steps < 1 or cfg.batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise UserInputError("max_steps, batch_size and gradient_accumulation_steps must be >= 1", "sft config")
    parallel.local_batch_size(cfg.batch_size, world)  # a batch that does not divide over the ranks is refused
    # before any model is loaded: what the device cannot do is refused here (models/precision.py)
    precision = precision_from_config(cfg, world.device, parallel.resolve_strategy(cfg.parallel_strategy, world))
    # 1. a given model's data checked before the model is loaded; the model and tokenizer (the tiny default is
    # built from the suite's templates)
    early_data = load_sft_data(cfg, models.load_tokenizer(cfg.tokenizer or cfg.model,
                                                          trust_remote_code=cfg.trust_remote_code)) if cfg.model else None
    model, tokenizer = load_or_build_policy(cfg)
    model.to(world.device)
    models.disable_dropout(model)
    model.train()
    if cfg.gradient_checkpointing:  # before wrapping: the engines wrap the checkpointed layers
        models.enable_gradient_checkpointing(model, "SFT model")
    # 2. data, validated and tokenised before the run folder is created (every rank builds the same)
    sft_data = early_data if early_data is not None else load_sft_data(cfg, tokenizer)
    world.check_same(sft_data.train, "the tokenised SFT training data")
    wrapped = parallel.wrap_model(model, world, cfg.parallel_strategy)
    packing = use_packing(cfg, wrapped.model, wrapped.same_passes)
    run, resumed = open_run(cfg, "sft", wrapped.layout, given.callbacks) if run is None else (run, None)
    order_rng = random.Random(cfg.seed)
    optimizer = make_optimizer(wrapped.model.parameters(), cfg, fused=not wrapped.layout.sharded)
    optimizer = wrapped.prepare(optimizer, cfg.max_grad_norm)
    scheduler = make_scheduler(optimizer, cfg, cfg.max_steps)
    log.info("SFT: %d train / %d validation sequences, %d steps x %d, mixed precision %s (%s)", len(sft_data.train),
             len(sft_data.validation), cfg.max_steps, cfg.batch_size, precision.mode, wrapped.layout.describe())

    lengths = [len(e.prompt_ids) + len(e.completion_ids) for e in sft_data.train]
    batches = batch_stream(lengths, cfg.batch_size, cfg.group_by_length, order_rng)
    done, stats, metrics, skipped = 0, {}, {}, 0
    if resumed is not None:  # weights, optimiser, RNGs back; replay the data order of the steps done
        progress = unpack_single(resumed, wrapped, optimizer, scheduler)
        resumed.commit()  # only now cut the histories back, record the resume
        done, stats, metrics = progress["step"], progress["stats"], progress["metrics"]
        skipped = progress.get("skipped", 0)
        precision.load_state_dict(progress.get("amp", {}))
        for _ in range(done):
            next(batches)
    pack = lambda: pack_single(wrapped, optimizer, scheduler,  # noqa: E731
                               {"step": done, "stats": stats, "metrics": metrics, "skipped": skipped,
                                "amp": precision.state_dict()})
    bar = tqdm(range(done + 1, cfg.max_steps + 1), desc="sft", unit="step", disable=not (cfg.progress and world.is_main))
    with checkpointer(run, cfg, resumed, wrapped, optimizer) as saver:  # SIGINT / SIGTERM handlers
        for step in bar:
            # 3. next global batch: shuffled passes over the data (grouped by length if asked); this rank's block
            batch_ids = next(batches)
            # 4. one optimiser step with completion-only loss (a non-finite one stops the run or is dropped)
            batch = [sft_data.train[i] for i in parallel.take(batch_ids, parallel.share_of(len(batch_ids), world))]
            stats, skipped = guarded_step(
                lambda: train_step(wrapped, optimizer, scheduler, batch, tokenizer.pad_token_id, cfg, packing,
                                   precision),
                f"SFT step {step}", f"train examples {batch_ids}", skipped, cfg.nonfinite)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                run.log({**stats, "lr": scheduler.get_last_lr()[0], "elapsed_s": time.time() - started}, step=step)
                bar.set_postfix(loss=f"{stats['loss/sft']:.3f}")
            # 5. periodic validation: loss on reference answers and checked pass rate
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
                metrics = evaluate_now(wrapped, tokenizer, sft_data, cfg, step, run, precision)
                bar.set_postfix(loss=f"{stats['loss/sft']:.3f}",
                                **{k.replace("/", "_"): f"{v:.3f}" for k, v in metrics.items()})
            # 6. checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
            done = step
            saver.step_done(step, pack)
        saver.finish(done, pack)

    # 7. the model, as an ordinary HF folder (rank 0)
    with wrapped.gathered() as whole:
        model_dir = world.from_main(lambda: save_policy_folder(whole, tokenizer, run.path, cfg.lora_r > 0))
    summary = run.update_summary(
        stage="sft",
        final_loss=stats["loss/sft"],
        validation=metrics,
        parameters=models.count_parameters(model),
        wall_time_s={"sft": round(time.time() - started, 1)},
        model_dir=str(model_dir),
        nonfinite={"mode": cfg.nonfinite, "skipped_updates": skipped},
        parallel={**wrapped.layout.describe(), **world.describe()},
        packing=packing,
        precision=precision.describe(),
    )
    run.close()
    return RunResult(run.path, summary, model_dir)
