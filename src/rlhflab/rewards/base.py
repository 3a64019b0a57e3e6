"""What every reward source returns, and the one call they all answer."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlhflab.data.prompt_rows import PromptRow


@dataclass(frozen=True)
class Check:
    """A verifier's judgement on one completion."""

    passed: bool
    kind: str  # "pass", or why it failed: a violation kind of the suite, "fail", "unverified", ...
    reason: str = ""  # short, human-readable


@dataclass(frozen=True)
class Scored:
    """Scores for a batch of finished responses."""

    scores: Tensor  # (B,) float32; 0.0 where valid is False
    valid: Tensor  # (B,) bool; False where the source failed for that row (no item, non-finite score)

    def __post_init__(self) -> None:
        if self.scores.shape != self.valid.shape or self.scores.dim() != 1:
            raise ValueError(f"scores {tuple(self.scores.shape)} and valid {tuple(self.valid.shape)} must be (B,)")


@dataclass(frozen=True)
class ScoreContext:
    """What an online trainer knows about the responses beside their text, for the reward functions that ask
    (TRL's extra keyword arguments): each response's token ids (`completion_ids`: its EOS in, padding out) and
    the optimiser steps done so far (updates x passes x minibatches, as TRL counts). It is handed to a function as
    TRL's `trainer_state`, of which it has `global_step` only."""

    completion_ids: list[list[int]] | None = None
    global_step: int = 0

    def rows(self, start: int, stop: int) -> ScoreContext:
        """The context of responses start..stop (one row's, when a failing row is looked for)."""
        ids = None if self.completion_ids is None else self.completion_ids[start:stop]
        return ScoreContext(ids, self.global_step)


class RewardSource(Protocol):
    """prompts, responses (text up to EOS, EOS excluded) and the prompt rows they answer -> Scored; `context`:
    what else the trainer knows (sources that need none ignore it)."""

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored: ...


class Verifier(Protocol):
    """Pass / fail per completion: what validation pass rates, alarms, stopping and keep_best read.

    `ended_with_eos[b]` says whether completion b ended by EOS (False: cut at the length cap)."""

    name: str

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow],
                 ended_with_eos: Sequence[bool] | None = None) -> list[Check]: ...


def score(source, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
          context: ScoreContext | None = None):
    """`source(prompts, responses, rows, context=context)`, or without the context for a callable that takes
    none (a plain function handed to a trainer's `train(cfg, reward_fn=...)`)."""
    if context is not None and _takes_context(source):
        return source(prompts, responses, rows, context=context)
    return source(prompts, responses, rows)


def _takes_context(source) -> bool:
    try:
        params = inspect.signature(source).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "context" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_lengths(prompts: Sequence, responses: Sequence, rows: Sequence) -> int:
    """B, after checking the three lists line up."""
    if not len(prompts) == len(responses) == len(rows):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses and {len(rows)} rows")
    return len(prompts)


def scored(scores: Tensor, valid: Tensor) -> Scored:
    """Scored with invalid rows zeroed (so a sum over rows never picks up NaN)."""
    scores = scores.detach().to(device="cpu", dtype=torch.float32)
    valid = valid.to(device="cpu", dtype=torch.bool) & torch.isfinite(scores)
    return Scored(scores=torch.where(valid, scores, torch.zeros_like(scores)), valid=valid)


def as_scored(result) -> Scored:
    """A user reward function's output as `Scored`: a Scored, a tensor, or a list of floats.

    NaN, inf or None marks a row the reward failed on: it is masked out and counted.
    """
    if isinstance(result, Scored):
        return result
    values = [float("nan") if v is None else float(v) for v in (result.tolist() if isinstance(result, Tensor) else result)]
    scores = torch.tensor(values, dtype=torch.float32)
    valid = torch.isfinite(scores)
    return Scored(torch.where(valid, scores, torch.zeros_like(scores)), valid)
