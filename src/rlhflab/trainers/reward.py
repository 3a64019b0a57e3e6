"""Reward model: a scalar scorer trained on (prompt, chosen, rejected) with Bradley-Terry.

    rlhflab rm --model runs/demo-.../sft/model

loss = -log sigmoid(r_chosen - r_rejected - margin) [+ coef * (r_chosen + r_rejected)^2]
(Bradley & Terry 1952; Ouyang et al. 2022 §3.5; reward centring: Eisenstein et al. 2023).
One epoch by default: it overfits fast (MISSION.md §2). The score is read at the last
real token (`models.sequence_scores`), whatever the padding side; an encoder backbone
(BERT, MiniLM) reads it at [CLS], as its own head does, and its text is framed as
`rewards.encoder_rows` frames it when the reward model scores PPO's answers.

Several processes (docs/scaling-out.md "Several processes"): `batch_size` pairs is the global batch; each rank
scores its block, the loss and metrics are over every rank's pairs (`parallel`), rank 0 alone evaluates
and writes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rlhflab import data, models, parallel, rewards, sources
from rlhflab.rewards.model import encoder_rows
from rlhflab.checkpoint import atomic_folder, open_run, weight_bytes
from rlhflab.config import RMConfig
from rlhflab.core import bradley_terry_loss, pass_fail_loss, reward_centering_penalty
from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision, float32_for_training, precision_from_config
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.nonfinite import clip_and_step, guarded_step
from rlhflab.trainers.single_state import checkpointer, pack_single, unpack_single
from rlhflab.trainers.weight_average import WeightAverage, first_averaged_step
from rlhflab.trainers.setup import (
    configure_threads,
    make_optimizer,
    make_scheduler,
    resolve_device,
    seed_everything,
    stream_seed,
)

log = logging.getLogger("rlhflab")
HARD_NEGATIVE_TOKENS = 32  # response cap when sampling the policy's answers


@dataclass(frozen=True)
class TokenizedPair:
    chosen: list[int]  # prompt + chosen + EOS; [CLS] prompt chosen [SEP] for an encoder
    rejected: list[int]  # prompt + rejected + EOS; [CLS] prompt rejected [SEP] for an encoder
    family: str | None
    violation: str | None
    labels: tuple[bool, bool] | None = None  # a SAMPLED row: whether each answer passes; None = a preference pair
    prompt_tokens: int = 0  # the prompt's share of both sequences (rows of one prompt score it once); 0: not known


def tokenize_pairs(pairs: list[data.PairExample], tokenizer, max_length: int,
                   encoder: bool = False) -> list[TokenizedPair]:
    if encoder:  # the reward model's own framing, shared with rewards.ModelReward
        prompts = [p.prompt for p in pairs]
        chosen = encoder_rows(tokenizer, prompts, [p.chosen for p in pairs], max_length)
        rejected = encoder_rows(tokenizer, prompts, [p.rejected for p in pairs], max_length)
        return [TokenizedPair(c, r, p.family, p.violation) for p, c, r in zip(pairs, chosen, rejected)]
    as_sft = [data.SFTExample(p.prompt, text, p.family, p.violation) for p in pairs for text in (p.chosen, p.rejected)]
    seqs = data.tokenize_sft(as_sft, tokenizer, max_length)
    return [TokenizedPair(c.prompt_ids + c.completion_ids, r.prompt_ids + r.completion_ids, p.family, p.violation,
                          prompt_tokens=len(c.prompt_ids)) for p, c, r in zip(pairs, seqs[0::2], seqs[1::2])]


HARD_NEGATIVE = "policy_answer"  # the violation label of a hard negative: the policy's own failing answer
SAMPLED = "policy_samples"  # a calibration row: two of the policy's own answers to one prompt, each checked
# rows of the policy's own sampled answers: shuffled one by one even with prompt_rows_together (side by side, the
# demo's reward model learned less per step: docs/reward-models.md "Training")
POLICY_ROWS = (HARD_NEGATIVE, SAMPLED)


@dataclass(frozen=True)
class PolicyAnswers:
    """`cfg.hard_negatives` answers sampled from the policy per prompt, checked (prompt-major order)."""

    items: list[sources.SuiteItem]  # one per answer
    texts: list[str]
    passed: list[bool]


# sampled answers per generation batch; each batch draws from a generator of its own (the demo's policy samples
# 1,024 answers in 1.8 s at 128 a batch against 2.6 s at 64; 256 gains nothing more)
ANSWER_BATCH = 128


def answer_batch_seed(seed: int, stream: str, batch: int) -> int:
    """The sampling seed of batch `batch` of the answers sampled for `stream` (a split)."""
    return stream_seed("rlhflab-rm-answers", seed, stream, batch)


def sample_policy_answers(cfg, tokenizer, items: list[sources.SuiteItem], stream: str = "train",
                          world: parallel.World | None = None) -> PolicyAnswers:
    """`cfg.hard_negatives` answers per prompt sampled from the policy (`cfg.model`) and checked. Batch i of
    ANSWER_BATCH answers draws from its own generator (`answer_batch_seed`), so an answer does not depend on
    the process that samples it: with several processes each samples every W-th batch and the answers are
    gathered, the same as one process draws, in about 1/W of its time."""
    world = world or parallel.World()
    policy = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                   device=resolve_device(cfg.device) if not world.distributed else world.device)
    settings = GenerationSettings(HARD_NEGATIVE_TOKENS, True, 1.0)
    checker = rewards.CheckerVerifier()
    repeated = [item for item in items for _ in range(cfg.hard_negatives)]
    batches = [repeated[s : s + ANSWER_BATCH] for s in range(0, len(repeated), ANSWER_BATCH)]
    mine = {}  # batch index -> [(text, passed)] of the batches this process samples
    for b in tqdm(range(world.rank, len(batches), world.world_size), desc=f"sampling {stream} answers",
                  unit="batch", disable=not (cfg.progress and world.is_main)):
        generator = torch.Generator().manual_seed(answer_batch_seed(cfg.seed, stream, b))
        prompts = [i.prompt for i in batches[b]]
        answers = generate_answers(policy, tokenizer, prompts, settings, batch_size=ANSWER_BATCH, generator=generator)
        texts = [a.text for a in answers]
        checks = checker(prompts, texts, batches[b], [a.ended_with_eos for a in answers])
        mine[b] = [(text, c.passed) for text, c in zip(texts, checks)]
    every = {b: rows for part in parallel.gather_objects(mine, world) for b, rows in part.items()}
    rows = [row for b in range(len(batches)) for row in every[b]]
    return PolicyAnswers(repeated, [text for text, _ in rows], [passed for _, passed in rows])


def hard_negative_pairs(cfg, tokenizer, items: list[sources.SuiteItem],
                        world: parallel.World | None = None) -> list[data.PairExample]:
    """Sample `cfg.hard_negatives` answers per prompt from the policy; distinct failing ones vs the reference."""
    return failing_answer_pairs(sample_policy_answers(cfg, tokenizer, items, "train", world))


def failing_answer_pairs(answers: PolicyAnswers) -> list[data.PairExample]:
    """The distinct failing answers, each rejected against the reference."""
    seen, pairs = set(), []
    for item, text, passed in zip(answers.items, answers.texts, answers.passed):
        if passed or (item.prompt, text) in seen:
            continue
        seen.add((item.prompt, text))
        pairs.append(data.PairExample(item.prompt, item.reference, text, item.family, HARD_NEGATIVE))
    return pairs


def calibration_pairs(answers: PolicyAnswers) -> tuple[list[data.PairExample], list[tuple[bool, bool]]]:
    """The sampled answers two by two (consecutive answers to one prompt; an odd last one is left out), as
    they came, failing and passing alike, with the checker's verdicts: rows for the calibration term."""
    rows, labels = [], []
    for i in range(0, len(answers.items) - 1, 2):
        item = answers.items[i]
        if answers.items[i + 1] is not item:
            continue
        rows.append(data.PairExample(item.prompt, answers.texts[i], answers.texts[i + 1], item.family, SAMPLED))
        labels.append((answers.passed[i], answers.passed[i + 1]))
    return rows, labels


def load_pairs(cfg: RMConfig, tokenizer, encoder: bool = False,
               world: parallel.World | None = None) -> dict[str, list[TokenizedPair]]:
    """Every split's pairs, tokenised (the same on every process of `world`, which share the answer sampling)."""
    if cfg.hard_negatives and cfg.train_file:
        raise UserInputError("hard negatives need the built-in suite's checker", "--hard_negatives",
                             "drop --hard_negatives, or add the policy's failing answers to your pairs file")
    if cfg.calibration_coef and not cfg.hard_negatives:
        raise UserInputError("the calibration term reads the policy's sampled answers", "--calibration_coef",
                             "add --hard_negatives 2 (answers sampled per prompt), or drop --calibration_coef")
    if cfg.near_misses and cfg.train_file:
        raise UserInputError("near misses are built from the built-in suite's items", "--near_misses",
                             "drop --near_misses, or add near-miss rejected answers to your pairs file")
    splits = sources.pair_prompt_sets(cfg)
    pairs = sources.suite_pairs(cfg, splits)
    if cfg.near_misses:  # training pairs only, like pair_kinds_always: held-out accuracies stay comparable
        pairs["train"] += sources.near_miss_pairs(cfg, splits["train"])
    calibration, labels = [], []
    if cfg.hard_negatives:
        for split, items in splits.items():
            answers = sample_policy_answers(cfg, tokenizer, items, split, world)
            pairs[split] += failing_answer_pairs(answers)
            if split == "train" and cfg.calibration_coef > 0:
                calibration, labels = calibration_pairs(answers)
        log.info("hard negatives (the policy's failing answers): %s",
                 {s: sum(p.violation == HARD_NEGATIVE for p in v) for s, v in pairs.items()})
    for split, path in (("train", cfg.train_file), ("validation", cfg.validation_file)):
        if path:
            pairs[split] = data.load_examples(path, "pairs", tokenizer=tokenizer,
                                              max_prompt_tokens=cfg.max_prompt_tokens, strict=cfg.strict,
                                              split=cfg.dataset_split if split == "train" else None,  # validation:
                                              config=cfg.dataset_config)  # NAME:SPLIT, else its only split
    if cfg.train_file and not cfg.validation_file:
        pairs.pop("validation")
    if cfg.train_file:
        pairs.pop("test")  # the suite's test split says nothing about a user's data
    if not pairs["train"]:
        raise UserInputError("no training pairs", "--pair_kinds", "allow violation kinds the suite's families produce")
    tokenized = {split: tokenize_pairs(p, tokenizer, cfg.max_length, encoder) for split, p in pairs.items()}
    if calibration:  # training rows only: held-out accuracies stay those of preference pairs
        rows = tokenize_pairs(calibration, tokenizer, cfg.max_length, encoder)
        tokenized["train"] += [dataclasses.replace(row, labels=label) for row, label in zip(rows, labels)]
        log.info("calibration rows (two sampled answers each, %.0f %% of the answers pass): %d", 100 *
                 sum(map(sum, labels)) / (2 * len(labels)), len(rows))
    return tokenized


def padded_scores(model, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """(N,) scores of token sequences from one right-padded forward pass."""
    length = max(map(len, seqs))
    device = next(model.parameters()).device
    ids = torch.tensor([s + [pad_id] * (length - len(s)) for s in seqs], device=device)  # (N, L)
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs], device=device)  # (N, L)
    return models.sequence_scores(model, ids, mask).float()


def length_groups(lengths: list[int], chunks: int) -> list[list[int]]:
    """Indices sorted by length, cut into `chunks` near-equal groups (one group, in order, when chunks <= 1)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if chunks > 1 else list(range(len(lengths)))
    size = math.ceil(len(order) / max(1, chunks))
    return [order[s : s + size] for s in range(0, len(order), size)]


def in_batch_order(parts: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Per-group results, concatenated, put back in the order of the indices `groups` split up."""
    inverse = torch.argsort(torch.tensor([i for g in groups for i in g], device=parts[0].device))
    return torch.cat(parts)[inverse]


def prompt_key(pair: TokenizedPair, row: int) -> tuple | int:
    """What rows that share a prompt have in common: the prompt's tokens (a row of unknown prompt: its own number)."""
    return tuple(pair.chosen[: pair.prompt_tokens]) if pair.prompt_tokens else row


def prompt_major(pairs: list[TokenizedPair], order: list[int], together: int = 0, apart: tuple = ()) -> list[int]:
    """`order` with each prompt's rows moved up to follow its first one (prompts keep the order of their first
    rows), so that a batch cut from it holds whole prompts, but where its edges cut one. With `together` > 0, a
    prompt's rows go in pieces of at most that many, each piece moved up to its own first row (its own place).
    Rows whose violation is in `apart` keep their own places."""
    pieces, seen = defaultdict(list), defaultdict(int)
    for i in order:
        key = prompt_key(pairs[i], i) if pairs[i].violation not in apart else i
        pieces[key, seen[key] // together if together else 0].append(i)
        seen[key] += 1
    return [i for members in pieces.values() for i in members]


def grouped_pair_scores(model, batch: list[TokenizedPair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_scores` with the distinct sequences of each prompt in the batch scored in one group, the prompt
    run once (`models.pack_groups`): a row's two sequences at least, all of a prompt's rows where they share a
    batch (`prompt_major`)."""
    groups: dict[tuple | int, dict[tuple, int]] = {}  # prompt key -> {sequence: its number in the group}
    for i, pair in enumerate(batch):
        members = groups.setdefault(prompt_key(pair, i), {})
        for sequence in (pair.chosen, pair.rejected):
            members.setdefault(tuple(sequence), len(members))
    first, start = {}, 0  # prompt key -> the number of its group's first sequence among all
    for key, members in groups.items():
        first[key], start = start, start + len(members)
    packed = models.pack_groups([[list(s) for s in members] for members in groups.values()], pad_id)
    scores = models.grouped_scores(model, packed).float()

    def numbers(side: str) -> torch.Tensor:
        """Each row's chosen (or rejected) sequence's number among all the groups' sequences."""
        keys = [prompt_key(pair, i) for i, pair in enumerate(batch)]
        return torch.tensor([first[k] + groups[k][tuple(getattr(pair, side))] for k, pair in zip(keys, batch)],
                            device=scores.device)

    return scores[numbers("chosen")], scores[numbers("rejected")]


def pair_scores(model, batch: list[TokenizedPair], pad_id: int, chunks: int = 1,
                shared_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected, both (B,).

    With `chunks` > 1 the sequences are sorted by length and scored in that many forward passes, each
    padded only to its own longest row: the same scores with less padding (one backward pass still goes
    through all of them). With `shared_prefix` (a model where `models.can_pack_pairs` holds) each prompt's
    distinct sequences in the batch are packed together and the prompt runs once (`grouped_pair_scores`;
    `chunks` does not apply: packed rows carry no padding to speak of).
    """
    if shared_prefix:
        return grouped_pair_scores(model, batch, pad_id)
    seqs = [p.chosen for p in batch] + [p.rejected for p in batch]
    groups = length_groups([len(s) for s in seqs], chunks)
    parts = [padded_scores(model, [seqs[i] for i in group], pad_id) for group in groups]
    scores = in_batch_order(parts, groups)  # back to chosen..., rejected...
    return scores[: len(batch)], scores[len(batch) :]


@torch.no_grad()
def evaluate_pairs(model, pairs: list[TokenizedPair], pad_id: int, batch_size: int = 64,
                   shared_prefix: bool = False) -> dict:
    """Pairwise accuracy and margin, overall, per family and per violation kind; score statistics."""
    model.eval()
    order = prompt_major(pairs, list(range(len(pairs)))) if shared_prefix else list(range(len(pairs)))
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = [pairs[i] for i in order[start : start + batch_size]]
        c, r = pair_scores(model, batch, pad_id, chunks=2, shared_prefix=shared_prefix)
        chosen.append(c.float().cpu())  # float32 statistics of bf16 / fp16 scores under autocast
        rejected.append(r.float().cpu())
    model.train()
    back = torch.argsort(torch.tensor(order))  # scores in the pairs' own order
    c, r = torch.cat(chosen)[back], torch.cat(rejected)[back]
    correct = (c > r).float()
    groups = {"per_family": [p.family for p in pairs], "per_violation": [p.violation for p in pairs]}
    out = {"accuracy": correct.mean().item(), "margin": (c - r).mean().item(), "pairs": len(pairs),
           "chosen_mean": c.mean().item(), "chosen_std": c.std().item() if len(c) > 1 else 0.0,
           "rejected_mean": r.mean().item(), "rejected_std": r.std().item() if len(r) > 1 else 0.0}
    for name, keys in groups.items():
        by = defaultdict(list)
        for key, ok in zip(keys, correct.tolist()):
            by[str(key)].append(ok)
        out[name] = {k: sum(v) / len(v) for k, v in sorted(by.items())}
    return out


# length_chunks 0: one forward pass per this many pairs of the step (demo model, 1 thread, 32 pairs a step:
# 2 length-sorted passes 86-92 ms, 4 passes 97-100, 1 pass 98-112)
PAIRS_PER_CHUNK = 16
TRAIN_METRIC_PAIRS = 2000  # the train split's metrics are read on a random sample this large


def metric_sample(pairs: list[TokenizedPair], split: str, seed: int) -> list[TokenizedPair]:
    """All held-out pairs; a fixed random sample of the (often much larger) train split."""
    pairs = [p for p in pairs if p.labels is None]  # calibration rows have no preferred answer
    if split != "train" or len(pairs) <= TRAIN_METRIC_PAIRS:
        return pairs
    return random.Random(f"rlhflab.rm.train_metrics:{seed}").sample(pairs, TRAIN_METRIC_PAIRS)


def use_shared_prefix(cfg: RMConfig, model) -> bool:
    """`cfg.shared_prefix` where the model allows it (`models.can_pack_pairs`); says so when it does not."""
    if not cfg.shared_prefix:
        return False
    if parallel.holds_shards(model):  # the packed forward reads whole weights
        log.info("reward model: FSDP2 shards the weights; chosen and rejected are scored as separate sequences "
                 "(shared_prefix off)")
        return False
    if models.can_pack_pairs(model):
        return True
    log.info("reward model: %s is not a Llama / Qwen2 layout without dropout; chosen and rejected are scored "
             "as separate sequences (shared_prefix off)", type(model).__name__)
    return False


def batch_loss(chosen: torch.Tensor, rejected: torch.Tensor, batch: list[TokenizedPair],
               cfg: RMConfig) -> tuple[torch.Tensor, dict]:
    """The step's loss over its (B,) chosen and rejected scores, and accuracy / margin of its preference pairs.

    Preference pairs: Bradley-Terry (+ centring, + the pass / fail term). Calibration rows (`labels`): binary
    cross-entropy of each sampled answer's score as the logit of "passes", against the checker's verdict, so
    a score says how likely the policy's own answer of that kind is to pass. Both are sums over their rows
    divided by the batch's rows, so a batch of preference pairs only is the plain mean."""
    sampled = torch.tensor([p.labels is not None for p in batch], device=chosen.device)  # (B,)
    preference = ~sampled
    loss = chosen.sum() * 0.0
    stats = {"accuracy": math.nan, "margin": math.nan}
    if preference.any():
        c, r = chosen[preference], rejected[preference]
        pair_loss, pair_stats = bradley_terry_loss(c, r, margin=cfg.margin if cfg.margin else None)
        if cfg.center_rewards_coef > 0:
            pair_loss = pair_loss + reward_centering_penalty(c, r, cfg.center_rewards_coef)
        if cfg.pass_fail_coef > 0:
            pair_loss = pair_loss + cfg.pass_fail_coef * pass_fail_loss(c, r)
        loss = loss + pair_loss * preference.float().mean()
        stats = {k: v.item() for k, v in pair_stats.items()}
    if sampled.any():
        scores = torch.stack((chosen[sampled], rejected[sampled]), dim=1)  # (S, 2)
        labels = torch.tensor([p.labels for p in batch if p.labels is not None], dtype=scores.dtype,
                              device=scores.device)  # (S, 2)
        bce = F.binary_cross_entropy_with_logits(scores, labels)
        loss = loss + cfg.calibration_coef * bce * sampled.float().mean()
    return loss, stats


def train_step(wrapped: parallel.Wrapped, optimizer, scheduler, batch: list[TokenizedPair], share: parallel.Share,
               pad_id: int, cfg: RMConfig, shared_prefix: bool, precision: MixedPrecision | None = None) -> dict:
    """One optimiser step on this rank's pairs of the global batch (`share.real` real ones, then padding).

    Each rank's loss is its mean weighted by its share of the global batch, so the parts sum to the
    global batch's mean loss (a last, partial batch splits unevenly). Accuracy and margin are means over the
    global batch's preference pairs: each rank sends its sums and its count (calibration rows are not pairs,
    and ranks hold different numbers of them). The forward runs under `precision`'s autocast; the loss is
    taken from float32 scores, the backward outside autocast (fp16: of the scaled loss)."""
    precision = precision or MixedPrecision()
    chunks = cfg.length_chunks or max(1, len(batch) // PAIRS_PER_CHUNK)  # len(batch): the same on every rank
    with precision.autocast():
        chosen, rejected = wrapped(pair_scores, batch, pad_id, chunks, shared_prefix)
    chosen, rejected = chosen.float(), rejected.float()  # bf16 / fp16 scores under autocast
    chosen, rejected = chosen[: share.real], rejected[: share.real]  # padding rows carry no weight
    parts = {"loss/rm": 0.0, "accuracy_sum": 0.0, "margin_sum": 0.0, "pairs": 0.0}
    if share.real:
        loss, stats = batch_loss(chosen, rejected, batch[: share.real], cfg)
        part = loss * share.weight
        pairs = sum(p.labels is None for p in batch[: share.real])  # preference pairs (not calibration rows) here
        parts |= {"loss/rm": part.item(), "pairs": float(pairs)}
        if pairs:
            parts |= {"accuracy_sum": stats["accuracy"] * pairs, "margin_sum": stats["margin"] * pairs}
    else:  # no real pair here: a zero loss still runs backward, as every rank must
        part = (chosen.sum() + rejected.sum()) * 0.0  # both outputs: ZeRO-3 fetches weights per output in backward
    wrapped.backward(precision.scale(part))
    sums = parallel.sum_metrics(parts, wrapped.world)  # the global batch's
    per_pair = lambda key: sums[key] / sums["pairs"] if sums["pairs"] else math.nan  # noqa: E731
    stats = {"loss/rm": sums["loss/rm"], "rm/accuracy": per_pair("accuracy_sum"), "rm/margin": per_pair("margin_sum")}
    grad_norm = clip_and_step(optimizer, scheduler, wrapped.model.parameters(), cfg.max_grad_norm, stats["loss/rm"],
                              cfg.nonfinite, "reward-model", engine=wrapped, precision=precision)  # None: dropped
    return {**stats, "grad_norm": math.nan if grad_norm is None else grad_norm.item(),
            "skipped": grad_norm is None and not precision.overflowed, **precision.metrics()}


def train(cfg: RMConfig, run: RunDir | None = None, given: Given = NOTHING) -> RunResult:
    """Train a reward model as configured; returns the run folder and the HF reward-model folder."""
    started = time.time()
    if not cfg.model:
        raise UserInputError("no backbone given", "--model",
                             "pass the SFT model folder (or any HF causal LM, or an encoder such as BERT)")
    for field, least in (("num_epochs", 1), ("batch_size", 1), ("length_chunks", 0), ("extra_layers", 0),
                         ("frozen_layers", 0), ("prompt_rows_together", 0)):
        if getattr(cfg, field) < least:
            raise UserInputError(f"{field} must be >= {least}, not {getattr(cfg, field)}", f"rm config, --{field}",
                                 f"use {least} or more")
    if cfg.gradient_accumulation_steps != 1:  # OptimFields' field, which this trainer never read: refused, not ignored
        raise UserInputError(f"rlhflab rm has no gradient accumulation (gradient_accumulation_steps "
                             f"{cfg.gradient_accumulation_steps})", "--gradient_accumulation_steps",
                             "leave it at 1: each step scores its pairs in --length_chunks forward passes over "
                             "length-sorted pairs with --shared_prefix false (the same gradient, less memory), or "
                             "lower --batch_size")
    if not 0.0 <= cfg.average_weights <= 1.0:
        raise UserInputError(f"average_weights must be a fraction of the steps in [0, 1], not {cfg.average_weights}",
                             "--average_weights", "use e.g. 0.4 (the last 40 % of the steps) or 0 (off)")
    world = parallel.init_world(cfg.device)
    parallel.local_batch_size(cfg.batch_size, world)  # a batch that does not divide over the ranks is refused
    if cfg.average_weights and parallel.resolve_strategy(cfg.parallel_strategy, world) in ("fsdp2", "deepspeed"):
        raise UserInputError("weight averaging keeps whole weights, which FSDP2 / DeepSpeed shard",
                             "--average_weights",
                             "use --parallel_strategy ddp, or --average_weights 0")
    # before any model is loaded: what the device cannot do is refused here (models/precision.py)
    precision = precision_from_config(cfg, world.device, parallel.resolve_strategy(cfg.parallel_strategy, world))
    configure_threads(world.threads(cfg.threads))
    seed_everything(cfg.seed, cfg.deterministic)
    # 1. backbone -> scalar reward model (score head: small normal, zero bias)
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    model = models.build_reward_model(cfg.model, tokenizer, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    model = models.freeze_lower_layers(models.grow_trunk(model, cfg.extra_layers), cfg.frozen_layers)
    model = float32_for_training(model, f"reward model from {cfg.model}")  # whole weights train
    if cfg.gradient_checkpointing:  # before wrapping: the engines wrap the checkpointed layers
        models.enable_gradient_checkpointing(model, "reward model")
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(world.device)
    models.disable_dropout(model)
    model.train()
    # 2. pairs, validated and tokenised before the run folder exists (every rank builds the same)
    pairs = load_pairs(cfg, tokenizer, models.is_encoder_reward_model(model), world)
    world.check_same(pairs["train"], "the tokenised training pairs")
    wrapped = parallel.wrap_model(model, world, cfg.parallel_strategy)
    shared_prefix = use_shared_prefix(cfg, wrapped.model)
    run, resumed = open_run(cfg, "rm", wrapped.layout, given.callbacks) if run is None else (run, None)
    steps_per_epoch = math.ceil(len(pairs["train"]) / cfg.batch_size)
    total = steps_per_epoch * cfg.num_epochs
    optimizer = make_optimizer(wrapped.model.parameters(), cfg, fused=not wrapped.layout.sharded)
    optimizer = wrapped.prepare(optimizer, cfg.max_grad_norm)
    scheduler = make_scheduler(optimizer, cfg, total)
    rng = random.Random(cfg.seed)
    log.info("reward model: %d train pairs, %d steps, mixed precision %s", len(pairs["train"]), total, precision.mode)
    together = cfg.prompt_rows_together if shared_prefix else 0
    if cfg.prompt_rows_together and not shared_prefix:  # side by side would cost agreement and save nothing
        log.info("reward model: prompt_rows_together needs the grouped scorer (shared_prefix), which this model "
                 "does not run; rows are shuffled one by one")

    done, skipped, average_state = 0, 0, None  # steps already trained: all but the data order come back
    if resumed is not None:
        progress = unpack_single(resumed, wrapped, optimizer, scheduler)
        resumed.commit()  # only now cut the histories back, record the resume
        done, skipped, average_state = progress["step"], progress.get("skipped", 0), progress.get("average")
        precision.load_state_dict(progress.get("amp", {}))
    average = WeightAverage(model, average_state)
    average_from = first_averaged_step(total, cfg.average_weights)
    pack = lambda: pack_single(wrapped, optimizer, scheduler,  # noqa: E731
                               {"step": done, "skipped": skipped, "average": average.state(),
                                "amp": precision.state_dict()})

    # 3. epochs over shuffled pairs (a resumed run replays the shuffles and skips the steps done)
    step = 0
    bar = tqdm(total=total, initial=done, desc="rm", unit="step", disable=not (cfg.progress and world.is_main))
    with checkpointer(run, cfg, resumed, wrapped, optimizer) as saver:  # SIGINT / SIGTERM handlers
        for _ in range(cfg.num_epochs):
            order = list(range(len(pairs["train"])))
            rng.shuffle(order)
            if together:  # a prompt's pairs side by side: it runs once for them (grouped_pair_scores)
                order = prompt_major(pairs["train"], order, together, apart=POLICY_ROWS)
            for start in range(0, len(order), cfg.batch_size):
                step += 1
                if step <= done:
                    continue
                batch_ids = order[start : start + cfg.batch_size]
                share = parallel.share_of(len(batch_ids), world)  # this rank's block of the global batch
                batch = [pairs["train"][i] for i in parallel.take(batch_ids, share)]
                stats, skipped = guarded_step(
                    lambda: train_step(wrapped, optimizer, scheduler, batch, share, tokenizer.pad_token_id, cfg,
                                       shared_prefix, precision),
                    f"reward-model step {step}", f"train pairs {batch_ids}", skipped, cfg.nonfinite)
                if step % cfg.log_every == 0 or step == total:
                    run.log({**stats, "lr": scheduler.get_last_lr()[0]}, step=step)
                    bar.set_postfix(loss=f"{stats['loss/rm']:.3f}", acc=f"{stats['rm/accuracy']:.2f}")
                bar.update(1)
                if step >= average_from:
                    average.update()
                # checkpoint when due, or when SIGINT / SIGTERM asked (then raises Interrupted)
                done = step
                saver.step_done(step, pack)
        saver.finish(done, pack)
    bar.close()
    if average.apply():  # the steps this process and the checkpoints before it averaged: the last `count`
        log.info("reward model: the mean of the weights of steps %d-%d", step - average.count + 1, step)

    # 4. held-out metrics per split, then the model as an ordinary HF folder (rank 0, on the whole model)
    model_dir = run.path / "model"
    with wrapped.gathered() as whole, precision.autocast():  # held-out scores as the training forward gives them
        metrics = world.from_main(lambda: held_out_and_save(whole, tokenizer, pairs, cfg, model_dir))
    run.log({f"{split}/{k}": v[k] for split, v in metrics.items() for k in ("accuracy", "margin")}, step=step)
    summary = run.update_summary(stage="rm", steps=step, pairs=metrics, train_pairs=len(pairs["train"]),
                                 averaged_steps=average.count, shared_prefix=shared_prefix,
                                 wall_time_s={"rm": round(time.time() - started, 1)}, model_dir=str(model_dir),
                                 nonfinite={"mode": cfg.nonfinite, "skipped_updates": skipped},
                                 parallel={**wrapped.layout.describe(), **world.describe()},
                                 precision=precision.describe())
    run.close()
    return RunResult(run.path, summary, model_dir)


def held_out_and_save(model, tokenizer, pairs: dict[str, list[TokenizedPair]], cfg: RMConfig, model_dir) -> dict:
    """Pairwise metrics of every split (the train split on a sample), then the HF folder. The packed forward
    where it applies: `model` is whole here."""
    shared_prefix = use_shared_prefix(cfg, model)
    metrics = {split: evaluate_pairs(model, metric_sample(p, split, cfg.seed), tokenizer.pad_token_id,
                                     shared_prefix=shared_prefix) for split, p in pairs.items()}
    model_dir = Path(model_dir)
    with atomic_folder(model_dir, "the final reward model folder", model_dir.parent, weight_bytes(model)) as tmp:
        models.save_model_folder(tmp, model, tokenizer)  # whole or not at all: a later stage loads it
    return metrics
