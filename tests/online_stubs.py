"""Stand-ins for the online loop's unit tests (test_online_units.py, test_online_state.py,
test_online_ranks_units.py): an algorithm that records every loss call, roles whose log-probs are one trainable
scalar, hand-made scored rollouts, and a rank's engine whose collectives a test stands in for."""


import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers.online.algorithm import AlgorithmDefaults, ScoredRollout
from rlhflab.trainers.online.passes import average_stats, backward, micro_losses, rows_named, shuffled_rows
from rlhflab.trainers.online.passes import update_passes



class Recorder(AlgorithmDefaults):
    """A loss of sum(logprobs over the real tokens) / share.tokens, recording what each call was given."""

    name = "stub"
    critic = False
    samples_per_prompt = 1

    def __init__(self, epochs: int = 1, whole_groups: bool = False, parts=("all",), nan_calls=(), entropy=False,
                 bad: float = float("nan")):
        self.epochs, self.whole_groups, self.parts, self.nan_calls = epochs, whole_groups, tuple(parts), nan_calls
        self.bad = bad  # what the calls in `nan_calls` add to their loss
        self.entropy_in_loss = entropy
        self.calls = []  # (rows, share, extra, logprobs, values)

    def step_parts(self):
        return self.parts

    def loss(self, logprobs, values, batch, adv, idx, share, **extra):
        self.calls.append((idx.tolist(), share, extra, logprobs, values))
        self.advantages = adv
        live = logprobs if logprobs is not None else values
        loss = (live * batch.mask[idx]).sum() / share.tokens
        if len(self.calls) - 1 in self.nan_calls:
            loss = loss + self.bad
        rows = torch.tensor(float(len(idx)))
        return loss, {"loss": loss.detach(), "rows": rows, "rows_max": rows + 10, "rows_min": rows - 10}


class Roles:
    """Log-probs (and values) of every token = one trainable scalar, which starts at 0."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.precision = MixedPrecision("no")
        self.forwards = []  # (rows' first response token, temperature, part, entropy_grad)
        self.training = None

    def train(self, mode):
        self.training = mode

    def trainable_parameters(self):
        return [self.weight]

    def logprobs_and_values(self, q, qm, r, rm, temperature, part="all", entropy_grad=False):
        self.forwards.append((r[:, 0].tolist(), temperature, part, entropy_grad))
        self.inputs = (q, qm, rm)
        out = self.weight * torch.ones(r.shape)
        entropy = torch.full(r.shape, 0.5)
        return out, entropy, out.double()


def scored(lengths, width: int = 3, group: int = 1, forward=None, eos=None) -> ScoredRollout:
    """Rows of `lengths` real tokens; row i's response tokens are all i (the forwards record which rows ran)."""
    rows = len(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    rollout = SimpleNamespace(query_ids=torch.zeros(rows, 2, dtype=torch.long), query_mask=torch.ones(rows, 2),
                              response_ids=torch.arange(rows).unsqueeze(1).expand(rows, width), response_mask=mask,
                              batch_size=rows, policy_forward=forward,
                              ended_with_eos=torch.ones(rows, dtype=torch.bool) if eos is None else torch.tensor(eos))
    return ScoredRollout(rollout, torch.zeros(rows), torch.ones(rows, dtype=torch.bool), mask,
                         torch.zeros(rows, width), group)


def config(**overrides):
    base = dict(mask_truncated_completions=False, num_mini_batches=2, gradient_accumulation_steps=1,
                temperature=0.7, max_grad_norm=0.0, nonfinite="stop", response_length=3)
    return SimpleNamespace(**{**base, **overrides})


ADVANTAGES = object()  # what the passes hand every loss call as is


def run(algorithm, batch, cfg, seed: int = 0, roles=None, lr: float = 1.0, **kwargs):
    roles = roles or Roles()
    optimizer = torch.optim.SGD([roles.weight], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = update_passes(algorithm, roles, optimizer, scheduler, batch, ADVANTAGES, cfg,
                          torch.Generator().manual_seed(seed), **kwargs)
    assert not algorithm.calls or algorithm.advantages is ADVANTAGES
    return stats, roles, scheduler


class Engine:
    """The trained module's engine of rank `rank` of 2, whose collectives a test stands in for."""

    def __init__(self, rank: int, sharded: bool = False):
        self.world = SimpleNamespace(rank=rank, world_size=2, distributed=True, is_main=rank == 0,
                                     any=lambda flag: bool(flag))
        self.layout, self.steps_itself = SimpleNamespace(sharded=sharded), False
        self.syncs, self.backwards, self.dropped = [], [], []

    def sync(self, last):
        from contextlib import nullcontext

        self.syncs.append(last)
        return nullcontext()

    def backward(self, loss):
        self.backwards.append(loss.item())
        loss.backward()

    def drop_step(self, loss):
        self.dropped.append(loss)


class Tokenizer:
    """Token ids decode to their numbers joined by spaces; 0 pads, 9 ends a response."""

    pad_token_id, eos_token_id = 0, 9

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def rollout_of(response_ids, lengths, eos, logprobs=None, ref_logprobs=None, entropy=None, sampler_logprobs=None):
    """A Rollout of (B, T) `response_ids` whose row b has `lengths[b]` real tokens; `eos` (B,) ended with EOS;
    log-probs and entropy (B, T) as given, 0 where not given."""
    from rlhflab.rollout.rollout import Rollout

    ids = torch.tensor(response_ids)
    rows, width = ids.shape
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    given = lambda x: torch.zeros(rows, width) if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return Rollout(torch.ones(rows, 1, dtype=torch.long), torch.ones(rows, 1, dtype=torch.bool), ids, mask,
                   given(logprobs), given(ref_logprobs), torch.zeros(rows, width), given(entropy), torch.tensor(eos),
                   {"generation": 1.0, "forward": 0.5},
                   sampler_logprobs=None if sampler_logprobs is None else torch.tensor(sampler_logprobs))


class LoopAlgorithm:
    """The algorithm train_online is handed (test_online_loop_unit.py): advantages = the scores per token (returns
    None), recording each call; a step metric of the passes' stats."""

    name, critic, whole_groups, policy_gradient, group_relative, entropy_in_loss = "stub", False, False, True, False, False

    def __init__(self, epochs: int = 2, group: int = 2, bad_update: int | None = None, returns: bool = False):
        self.epochs, self.samples_per_prompt, self.bad_update, self.returns = epochs, group, bad_update, returns
        self.batches, self.after, self.updates = [], [], 0

    def param_groups(self, roles):
        return [{"params": roles.trainable_parameters()}]

    def advantages(self, batch):
        self.updates += 1
        self.batches.append(batch)
        adv = batch.scores.unsqueeze(1).expand_as(batch.mask).clone()
        if self.updates == self.bad_update:
            adv[0, 0] = float("nan")
        returns = adv.clone() if self.returns else None
        return SimpleNamespace(advantages=adv, returns=returns, metrics={"adv/mean": adv.mean().item()})

    def after_update(self, batch):
        self.after.append(batch)

    def step_metrics(self, stats):
        return {"loss/stub": stats.get("loss", -1.0)}

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = state["updates"]


class LoopWatch:
    """RunWatch's stand-in: records each observed row; stops at update `stop_at`; `finish` returns `monitored`."""

    def __init__(self, monitor, run, roles, keep_best, signal, stop_at=None, monitored=None):
        self.keep_best, self.signal, self.stop_at = keep_best, signal, stop_at
        self.rows, self.finished, self.monitored, self.best = [], [], monitored or {}, None

    def observe(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def should_stop(self, step, episode):
        return step == self.stop_at

    def finish(self, step, end):
        self.finished.append((step, end))
        return dict(self.monitored)


class LoopSaver:
    """The Checkpointer's stand-in: records step_done / finish with what pack() gave (a Progress-like dict)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.calls = args, kwargs, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step_done(self, update, pack):
        self.calls.append(("step", update, pack()))

    def finish(self, done, pack):
        self.calls.append(("finish", done, pack()))
