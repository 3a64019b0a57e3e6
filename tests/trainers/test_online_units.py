"""The online loop's passes, its per-rank cut and seeds, and its checkpoint state, on hand-made numbers, no model
(issue 36: docs/mutation.md lists the mutants of trainers/online/passes.py, ranks.py and state.py they kill).

The passes run a stand-in algorithm that records every loss call (its rows, its StepShare, its part) over
stand-in roles whose log-probs are one trainable scalar: the shares, the shuffles, the micro-batch cut, the
stats and the steps are read off by hand."""

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


def test_rows_are_named_with_the_train_prompts_they_answered():
    assert rows_named([2, 0], [10, 11, 12]) == "rollout rows [2, 0], train prompts [12, 10]"
    assert rows_named([1], None) == "rollout rows [1]"


def test_a_shuffle_of_whole_groups_keeps_each_group_contiguous_and_in_order():
    groups = torch.randperm(3, generator=torch.Generator().manual_seed(0))
    order = shuffled_rows(6, 2, torch.Generator().manual_seed(0))
    assert order.tolist() == [r for g in groups.tolist() for r in (2 * g, 2 * g + 1)]
    assert shuffled_rows(5, 1, torch.Generator().manual_seed(1)).tolist() == \
        torch.randperm(5, generator=torch.Generator().manual_seed(1)).tolist()


def test_stats_average_over_steps_and_extremes_keep_their_extreme():
    history = [{"loss": torch.tensor(1.0), "ratio_max": torch.tensor(3.0), "ratio_min": torch.tensor(-1.0)},
               {"loss": torch.tensor(4), "ratio_max": torch.tensor(5.0), "ratio_min": torch.tensor(2.0)},
               {"grad_norm": torch.tensor(7.0)}]
    assert average_stats(history) == {"loss": 2.5, "ratio_max": 5.0, "ratio_min": -1.0, "grad_norm": 7.0}
    assert average_stats([]) == {}


def test_each_step_share_counts_its_minibatch_the_rollout_and_the_steps():
    """Rows of 0, 0, 2 and 3 real tokens in two minibatches of two rows: a minibatch's `tokens` is its own count
    (at least 1: a minibatch of two failed rows), `rollout_tokens` the rollout's 5, `steps` 2: the normalisers
    a DAPO step (rollout_tokens / steps) and a BNPO step (tokens) divide by."""
    lengths = [0, 0, 2, 3]
    algorithm = Recorder()
    run(algorithm, scored(lengths), config(response_length=9), seed=3)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(3)).tolist()
    assert [rows for rows, *_ in algorithm.calls] == [order[:2], order[2:]]
    for rows, share, *_ in algorithm.calls:
        assert share.tokens == max(1, sum(lengths[r] for r in rows))
        assert (share.rows, share.rollout_tokens, share.response_length, share.steps) == (2, 5, 9, 2)
        assert share.index.tolist() == rows
    assert sorted(share.tokens for _, share, *_ in algorithm.calls) == [1, 5]  # seed 3 puts both empty rows together


def test_a_rollout_without_a_real_token_counts_one():
    algorithm = Recorder()
    run(algorithm, scored([0, 0]), config(num_mini_batches=1))
    assert [(share.tokens, share.rollout_tokens, share.steps) for _, share, *_ in algorithm.calls] == [(1, 1, 1)]


def test_micro_batches_add_up_to_the_step_and_every_pass_reshuffles():
    """4 rows, 2 minibatches, 2 accumulation steps, 2 passes: 8 micro-batches of one row each, 4 optimiser steps
    (the schedule steps with each), the forwards at the config's temperature, in training mode; the stats
    average the 8 micro-batches and the 4 steps' gradient norms."""
    lengths = [1, 2, 3, 1]
    algorithm = Recorder(epochs=2)
    stats, roles, scheduler = run(algorithm, scored(lengths), config(gradient_accumulation_steps=2), seed=5,
                                  lr=0.1)
    generator = torch.Generator().manual_seed(5)
    orders = [torch.randperm(4, generator=generator).tolist() for _ in range(2)]
    assert [rows for rows, *_ in algorithm.calls] == [[r] for order in orders for r in order]
    assert [f[0] for f in roles.forwards] == [[r] for order in orders for r in order]
    assert {f[1:] for f in roles.forwards} == {(0.7, "all", False)}
    assert roles.training is True and scheduler.last_epoch == 4
    # a step's loss is w * (its minibatch's tokens) / (the same): gradient 1, so w is -0.1 k at step k, and the
    # micro-batches' losses of step k add up to -0.1 k: the mean over 8 micro-batches is -0.6 / 8
    assert roles.weight.item() == pytest.approx(-0.4)
    assert stats == pytest.approx({"loss": -0.075, "rows": 1.0, "rows_max": 11.0, "rows_min": -9.0,
                                   "grad_norm": 1.0, "skipped": 0})


def test_whole_group_algorithms_train_on_whole_groups():
    algorithm = Recorder(whole_groups=True)
    run(algorithm, scored([1, 1, 1, 1, 1, 1], group=3), config(), seed=2)
    first = torch.randperm(2, generator=torch.Generator().manual_seed(2))[0].item()
    assert [rows for rows, *_ in algorithm.calls] == [[3 * first + i for i in range(3)],
                                                      [3 * (1 - first) + i for i in range(3)]]


# --- the checkpoint state (trainers/online/state.py) ------------------------------------------


class StateRoles:
    """A policy and a value head (no value model), and a precision whose state is recorded."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.policy, self.value_head, self.value_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1), None
        self.precision = SimpleNamespace(state_dict=lambda: {"scale": 8.0 + seed}, loaded=None)
        self.precision.load_state_dict = lambda state: setattr(self.precision, "loaded", state)


class Baseline(AlgorithmDefaults):
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"baseline": self.value}

    def load_state_dict(self, state):
        self.value = state["baseline"]


def built(seed: int):
    """Roles, AdamW, a schedule, an algorithm with state, generators, a watch: a run's objects at `seed`."""
    from rlhflab.trainers.online.monitor import RunWatch

    roles = StateRoles(seed)
    params = [*roles.policy.parameters(), *roles.value_head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    generators = {"order": torch.Generator().manual_seed(seed), "sampler": torch.Generator().manual_seed(seed + 1)}
    return roles, optimizer, scheduler, Baseline(float(seed)), generators, RunWatch(None, None, roles, False)


def test_an_online_checkpoint_round_trips_weights_moments_state_rngs_and_position(tmp_path):
    """Pack a run that took two steps, through the checkpoint's JSON + tensors, into one built afresh with
    another seed: every part comes back, and the generators draw what the first run's would have drawn."""
    import json

    from rlhflab.checkpoint import Resumed
    from rlhflab.checkpoint.state import decode, encode
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    for _ in range(2):
        loss = roles.policy(torch.ones(2)).sum() + roles.value_head(torch.ones(2)).sum()
        loss.backward()
        optimizer.step()
        scheduler.step()
    torch.randint(9, (3,), generator=generators["order"])
    watch.alarms, watch.stopped = [{"name": "kl", "step": 2}], {"step": 2}
    progress = Progress(update=2, episode=16, order=[3, 1], last={"loss": 0.5}, skipped=1, generated=20)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, progress, watch,
                                 rollouts={"ids": torch.ones(2)})
    assert set(weights) == {"policy.weight", "policy.bias", "value_head.weight", "value_head.bias"}
    assert state["amp"] == {"scale": 8.0} and torch.equal(state["in_flight_rollouts"]["ids"], torch.ones(2))
    tensors = {}
    state = decode(json.loads(json.dumps(encode(state, tensors))), tensors)
    expected = {name: torch.randint(99, (4,), generator=g.clone_state()) for name, g in generators.items()}

    fresh = built(1)
    roles2, optimizer2, scheduler2, algorithm2, generators2, watch2 = fresh
    back = unpack_online(Resumed(tmp_path / "step-2", 2, weights, state, {}), roles2, optimizer2, scheduler2,
                         algorithm2, generators2, watch2)
    assert back == progress
    for name, tensor in weights.items():
        module, param = name.split(".")
        assert torch.equal(getattr(getattr(roles2, module), param), tensor)
    assert scheduler2.last_epoch == 2 and optimizer2.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    for p, p2 in zip(optimizer.state.values(), optimizer2.state.values(), strict=True):
        assert torch.equal(p["exp_avg_sq"], p2["exp_avg_sq"]) and p["step"] == p2["step"]
    assert algorithm2.value == 0.0 and roles2.precision.loaded == {"scale": 8.0}
    assert watch2.alarms == [{"name": "kl", "step": 2}] and watch2.stopped == {"step": 2}
    assert generators2.keys() == expected.keys()
    for name, g in generators2.items():
        assert torch.equal(torch.randint(99, (4,), generator=g), expected[name])


def test_a_sharded_checkpoint_packs_no_weights_or_moments_and_reads_them_from_its_shards(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(update=1), watch,
                                 sharded=True)
    assert weights == {} and "optimizer" not in state and state["in_flight_rollouts"] == {}
    roles2, optimizer2, scheduler2, algorithm2, generators2, watch2 = built(1)
    policy = roles2.policy.weight.detach().clone()
    read = []
    trained = SimpleNamespace(load_sharded=lambda optimizer, folder: read.append((optimizer, folder)))
    back = unpack_online(Resumed(tmp_path / "step-1", 1, {}, state, {}), roles2, optimizer2, scheduler2, algorithm2,
                         generators2, watch2, trained=trained)
    assert back.update == 1 and read == [(optimizer2, tmp_path / "step-1" / "sharded")]
    assert torch.equal(roles2.policy.weight, policy)  # the shards hold the weights: none from `weights`
    assert algorithm2.value == 0.0 and roles2.precision.loaded == {"scale": 8.0}


def test_an_online_checkpoint_that_does_not_fit_names_its_file(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(), watch)
    del state["amp"]  # a checkpoint written before fp16's scaler was kept: no scaler state
    fresh = built(1)
    with pytest.raises(UserInputError) as err:
        unpack_online(Resumed(tmp_path / "step-1", 1, {"policy.weight": weights["policy.weight"]}, state, {}),
                      *fresh)
    assert err.value.where == str(tmp_path / "step-1" / "model.safetensors")
    unpack_online(Resumed(tmp_path / "step-1", 1, weights, state, {}), *fresh)
    assert fresh[0].precision.loaded == {}
    state["optimizer"] = {"state": {}, "param_groups": []}
    with pytest.raises(UserInputError) as err:
        unpack_online(Resumed(tmp_path / "step-1", 1, weights, state, {}), *built(1))
    assert err.value.where == str(tmp_path / "step-1" / "state.safetensors")


# --- the passes' forwards, parts, dropped steps and ranks ----------------------------------------


def test_the_rollouts_forward_serves_the_first_step_only_when_it_sees_every_row():
    """One minibatch of every row in one micro-batch: its first step reads the rollout's log-probs (7), the
    second pass runs a forward; any narrower step, a --mask_truncated_completions batch with a truncated row, or
    an entropy loss runs its own forward from the start."""
    def reused(algorithm, cfg, eos=None):
        roles = Roles()
        forward = (roles.weight + torch.full((3, 3), 7.0), None)  # the graph of the rollout's own forward
        run(algorithm, scored([1, 2, 3], forward=forward, eos=eos), cfg, roles=roles)
        return roles

    algorithm, one = Recorder(epochs=2), config(num_mini_batches=1)
    roles = reused(algorithm, one)
    assert len(roles.forwards) == 1 and roles.forwards[0][0] == algorithm.calls[1][0]
    assert algorithm.calls[0][3].tolist() == [[7.0] * 3] * 3 and algorithm.calls[0][4] is None
    for algorithm, cfg, eos in [(Recorder(), config(num_mini_batches=1, gradient_accumulation_steps=3), None),
                                (Recorder(), config(num_mini_batches=1, mask_truncated_completions=True),
                                 [True, False, True]),
                                (Recorder(entropy=True), one, None)]:
        roles = reused(algorithm, cfg, eos)
        assert len(roles.forwards) == len(algorithm.calls) and 7.0 not in algorithm.calls[0][3]
    # the truncated row (1) left the loss: one minibatch of 1 + 3 tokens; the entropy loss got the entropy
    masked = Recorder()
    run(masked, scored([1, 2, 3], eos=[True, False, True]), config(num_mini_batches=1, mask_truncated_completions=True))
    assert (masked.calls[0][1].tokens, masked.calls[0][1].rollout_tokens) == (4, 4)
    entropic = Recorder(entropy=True)
    _, roles, _ = run(entropic, scored([1, 2, 3]), one)
    assert roles.forwards[0][3] is True and entropic.calls[0][2]["entropy"].tolist() == [[0.5] * 3] * 3


def test_a_micro_batch_loss_takes_the_forward_of_its_part():
    roles, batch = Roles(), scored([1, 2, 3])
    forward = (torch.full((3, 3), 7.0), torch.full((3, 3), 5.0, dtype=torch.float64))
    idx = torch.tensor([2, 0])
    for part, logprobs, values in [("all", 7.0, 5.0), ("policy", 7.0, None), ("value", None, 5.0)]:
        algorithm = Recorder()
        micro_losses(algorithm, roles, batch, None, idx, SimpleNamespace(tokens=1), 0.5, forward, part)
        rows, _, extra, got_logprobs, got_values = algorithm.calls[0]
        assert rows == [2, 0] and extra == ({} if part == "all" else {"part": part})
        assert (got_logprobs is None) == (logprobs is None) and (got_values is None) == (values is None)
        if values is not None:
            assert got_values.dtype == torch.float32 and got_values.tolist() == [[5.0] * 3] * 2
        if logprobs is not None:
            assert got_logprobs.tolist() == [[7.0] * 3] * 2
    assert roles.forwards == []
    algorithm = Recorder()
    micro_losses(algorithm, roles, batch, None, idx, SimpleNamespace(tokens=1), 0.5, (forward[0], None), "all")
    assert algorithm.calls[0][4] is None
    micro_losses(algorithm, roles, batch, None, idx, SimpleNamespace(tokens=1), 0.5, None, "value")
    assert roles.forwards == [([2, 0], 0.5, "value", False)] and algorithm.calls[1][4].dtype == torch.float32


def test_an_algorithm_stepping_its_models_in_turn_takes_a_step_per_part_and_one_schedule_step_a_minibatch():
    algorithm = Recorder(parts=("policy", "value"))
    stats, roles, scheduler = run(algorithm, scored([1, 2, 3, 1]), config(), lr=0.5)
    assert [extra["part"] for _, _, extra, *_ in algorithm.calls] == ["policy", "value"] * 2
    assert [f[2] for f in roles.forwards] == ["policy", "value"] * 2
    assert scheduler.last_epoch == 2 and roles.weight.item() == pytest.approx(-2.0)  # 4 steps of gradient 1
    assert stats["grad_norm"] == 1.0 and stats["value_grad_norm"] == 1.0 and stats["skipped"] == 0


def test_a_non_finite_step_is_dropped_and_counted_or_stops_naming_its_rows_and_prompts():
    """Two minibatches of two rows, the second's loss NaN: skip drops that step (its stats too) and counts it;
    stop raises naming the update, the rows and the prompts they answered."""
    lengths = [1, 2, 3, 1]
    algorithm = Recorder(nan_calls=(1,))
    stats, roles, scheduler = run(algorithm, scored(lengths), config(nonfinite="skip"), lr=0.5)
    assert stats["skipped"] == 1 and roles.weight.item() == pytest.approx(-0.5) and scheduler.last_epoch == 1
    assert stats["loss"] == 0.0 and stats["grad_norm"] == 1.0  # the first step's alone
    order = torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(FloatingPointError, match=rf"^STUB update 3: non-finite STUB loss nan .*\(rollout rows "
                                                 rf"\[{order[2]}, {order[3]}\], train prompts \[{10 + order[2]}, "
                                                 rf"{10 + order[3]}\]\); no checkpoint written after it$"):
        run(Recorder(nan_calls=(1,)), scored(lengths), config(), update=3, prompt_keys=[10, 11, 12, 13])
    with pytest.raises(FloatingPointError, match=r"^STUB value update 0: "):
        run(Recorder(parts=("policy", "value"), nan_calls=(1,)), scored(lengths), config())


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


def test_rank_1_of_2_trains_its_block_of_micro_batches_and_logs_every_ranks_stats(monkeypatch):
    """4 rows, one minibatch, 1 accumulation step over 2 processes: 2 micro-batches of 2 rows, rank 1 trains
    the second (synchronising on it: its last) and logs both ranks' stats in one process's order."""
    from rlhflab import parallel

    others = []
    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: others.append(plain) or
                        [[((0, 0, 0), {"loss": 10.0, "rows": 2.0})], plain])
    engine, algorithm = Engine(1), Recorder()
    stats, roles, _ = run(algorithm, scored([1, 2, 3, 1]), config(num_mini_batches=1), trained=engine)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()
    assert [rows for rows, *_ in algorithm.calls] == [order[2:]] and engine.syncs == [True]
    assert engine.backwards == [0.0] and len(others[0]) == 1 and others[0][0][0] == (0, 0, 1)
    assert stats["loss"] == 5.0 and stats["rows"] == 2.0 and stats["rows_max"] == 12.0


def test_a_rank_short_of_micro_batches_runs_a_padding_one_with_zero_weight_and_logs_nothing_of_it(monkeypatch):
    from rlhflab import parallel

    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: [plain, plain])
    engine = Engine(1, sharded=True)
    roles = Roles()
    roles.weight.data.fill_(2.0)
    optimizer = torch.optim.SGD([roles.weight], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    algorithm = Recorder()
    stats = update_passes(algorithm, roles, optimizer, scheduler, scored([2, 2]), None, config(), torch.Generator(),
                          trained=engine)
    assert engine.backwards == [0.0, 0.0]  # each minibatch's one row is rank 0's: rank 1 repeats it at weight 0
    assert roles.weight.item() == 2.0 and scheduler.last_epoch == 2
    assert stats == {"skipped": 0}


def test_a_padding_backward_is_a_zero_weight_one_through_the_engine():
    weight, engine = torch.nn.Parameter(torch.tensor(3.0)), Engine(0)
    backward(weight * 2, False, engine, MixedPrecision("no"))
    backward(weight * 2, True, engine, MixedPrecision("no"))
    assert engine.backwards == [0.0, 6.0] and weight.grad.item() == 2.0
    backward(weight * 2, True, None, MixedPrecision("no"))
    assert weight.grad.item() == 4.0


# --- ranks: seeds, the micro-batch cut, the global batch --------------------------------------


def test_every_update_and_refill_round_samples_from_a_seed_of_its_own_the_same_in_every_process():
    """The seeds runs have drawn so far: another value would make a resumed run (or another world size) sample
    other tokens than the run it continues. Round 0 is the update's own stream; each refill round another."""
    from rlhflab.trainers.online.ranks import rollout_generator, rollout_seed

    assert rollout_seed(3, 7) == rollout_seed(3, 7, 0) == 5370235883621230672
    assert rollout_seed(3, 7, 1) == 1600045660505250705 and rollout_seed(3, 7, 2) == 8184965079505648233
    assert rollout_seed(3, 8) == 6080524364339861933 and rollout_seed(4, 7) == 2352436981877922888
    for round_ in (0, 2):
        first, again = rollout_generator(3, 7, "cpu", round_), rollout_generator(3, 7, torch.device("cpu"), round_)
        assert first.initial_seed() == rollout_seed(3, 7, round_) and first.device == torch.device("cpu")
        assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=again))


def test_a_minibatch_is_cut_as_one_process_with_accumulation_rounded_up_to_the_world_cuts_it():
    from rlhflab.trainers.online.ranks import accumulation_over, micro_cut

    assert [accumulation_over(s, 2) for s in (1, 2, 3, 4)] == [2, 2, 4, 4]
    assert [accumulation_over(s, 3) for s in (1, 3, 4)] == [3, 3, 6] and accumulation_over(5, 1) == 5
    assert micro_cut(8, 1, 1) == (8, 1) and micro_cut(8, 3, 1) == (3, 3)  # 3 + 3 + 2
    assert micro_cut(8, 3, 2) == (2, 4) and micro_cut(5, 2, 2) == (3, 2) and micro_cut(7, 2, 1) == (4, 2)
    assert micro_cut(1, 4, 2) == (1, 1) and micro_cut(0, 2, 2) == (1, 0)  # never a micro-batch of 0 rows


def test_every_ranks_stats_merge_in_one_process_order(monkeypatch):
    """Rank 0 logged micro-batches 0 and 2 of a pass, rank 1 micro-batch 1: merged by position, as plain floats
    back into tensors; one process keeps its own, untouched."""
    from rlhflab import parallel
    from rlhflab.trainers.online.ranks import merged_history

    mine = [((0, 0, 0), {"loss": torch.tensor(1.0)}), ((0, 0, 2), {"loss": torch.tensor(3.0)})]
    theirs = [((0, 0, 1), {"loss": 2.0, "grad_norm": 5.0})]
    sent = []
    two = parallel.World(0, 2)
    monkeypatch.setattr(parallel, "gather_objects",
                        lambda plain, world: sent.append(plain) or ([plain, theirs] if world is two else None))
    merged = merged_history(mine, two)
    assert sent == [[((0, 0, 0), {"loss": 1.0}), ((0, 0, 2), {"loss": 3.0})]]
    assert [{k: v.item() for k, v in stats.items()} for stats in merged] == [
        {"loss": 1.0}, {"loss": 2.0, "grad_norm": 5.0}, {"loss": 3.0}]
    assert all(isinstance(v, torch.Tensor) for stats in merged for v in stats.values())
    assert merged_history(mine, parallel.SINGLE) == [stats for _, stats in mine]


def test_a_ranks_answers_sit_at_its_prompts_place_in_the_global_batch():
    from rlhflab import parallel
    from rlhflab.trainers.online.ranks import rollout_place

    prompts = [[1, 2], [3], [4, 5, 6], [7], [8], [9]]  # one per answer: 3 prompts x 2 answers
    place = rollout_place(prompts, parallel.share_of(3, parallel.World(1, 2)), 2)
    assert (place.first, place.total, place.prompt_width) == (4, 6, 3)
    place = rollout_place(prompts, parallel.share_of(3, parallel.World(0, 2)), 2)
    assert (place.first, place.total, place.prompt_width) == (0, 6, 3)


def test_every_ranks_rollout_rows_are_gathered_in_order_and_its_forward_dropped(monkeypatch):
    from rlhflab import parallel
    from rlhflab.rollout.rollout import Rollout
    from rlhflab.trainers.online.ranks import gather_rollout

    fields = ("query_ids", "query_mask", "response_ids", "response_mask", "logprobs", "ref_logprobs", "values",
              "entropy", "ended_with_eos")

    def rollout(rank, sampler):
        tensors = {name: torch.full((1, 2), float(rank)) for name in fields}
        return Rollout(**tensors, seconds={}, sampler_logprobs=torch.full((1, 2), 10.0 + rank) if sampler else None,
                       policy_forward=(torch.zeros(1, 2), None))

    world = SimpleNamespace(distributed=True, any=lambda flag: flag)
    monkeypatch.setattr(parallel, "gather_rows", lambda t, w: torch.cat([t, t + 1]) if w is world else None)
    for sampler in (True, False):
        whole = gather_rollout(rollout(0, sampler), world)
        assert whole.policy_forward is None
        for name in fields:
            assert getattr(whole, name).tolist() == [[0.0, 0.0], [1.0, 1.0]], name
        assert (whole.sampler_logprobs.tolist() == [[10.0, 10.0], [11.0, 11.0]]) if sampler else \
            whole.sampler_logprobs is None
    one = rollout(0, True)
    assert gather_rollout(one, parallel.SINGLE) is one


def test_a_global_batch_is_refused_unless_whole_prompts_and_whole_groups_share_out():
    from rlhflab import parallel
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.ranks import check_world

    def cfg(batch, minibatches=1, accumulation=1):
        return SimpleNamespace(batch_size=batch, num_mini_batches=minibatches, gradient_accumulation_steps=accumulation)

    def refused(*args):
        with pytest.raises(UserInputError) as err:
            check_world(*args)
        return str(err.value)

    two = parallel.World(0, 2)
    assert refused(cfg(4), 4, False, two) == (
        "--batch_size: batch_size 4 is 1 prompts x 4 answers, and 1 prompts do not share out over 2 processes (each "
        "process answers whole prompts: a prompt's answers stay together for their group statistics) -> use a "
        "batch_size of a multiple of 8 answers, e.g. 8")
    assert refused(cfg(12), 4, False, two).endswith("use a batch_size of a multiple of 8 answers, e.g. 8 or 16")
    assert refused(cfg(18), 3, False, parallel.World(1, 4)).endswith("multiple of 12 answers, e.g. 12 or 24")
    assert refused(cfg(6), 1, False, parallel.World(0, 4)).startswith("--batch_size: batch_size 6 does not divide")
    assert refused(cfg(16, 2, 3), 4, True, two) == (
        "--num_mini_batches: over 2 processes a minibatch of 8 answers is cut into micro-batches of 2, which do not "
        "hold whole groups of 4 answers -> make batch_size / num_mini_batches a multiple of 8")
    check_world(cfg(16, 2, 1), 4, True, two)  # accumulation 1 over 2 processes: 2 micro-batches of 4
    check_world(cfg(16, 2, 3), 4, False, two)  # groups need not stay whole in a micro-batch
    check_world(cfg(16, 1, 2), 1, True, two)
    check_world(cfg(8, 1, 3), 4, True, parallel.SINGLE)  # one process: nothing to share out


class Base(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self._no_split_modules = layers


class Adapted(torch.nn.Module):  # a LoRA-wrapped policy: the decoder layers are its base model's
    def __init__(self, base):
        super().__init__()
        self.base = base

    def get_base_model(self):
        return self.base


def test_the_trained_module_holds_policy_and_value_and_names_every_trunks_decoder_layers():
    from rlhflab.trainers.online.ranks import Trained

    head = torch.nn.Linear(1, 1)
    value_model = torch.nn.Module()
    value_model.backbone = Base(["Qwen2DecoderLayer", "LlamaDecoderLayer"])
    roles = SimpleNamespace(policy=Adapted(Base(["GPT2Block"])), value_head=head, value_model=value_model)
    trained = Trained(roles)
    assert trained.policy is roles.policy and trained.value_head is head and trained.value_model is value_model
    assert trained._no_split_modules == ["GPT2Block", "LlamaDecoderLayer", "Qwen2DecoderLayer"]
    for policy in (Base(None), torch.nn.Linear(1, 1)):  # None, or no such attribute at all: no layers named
        alone = Trained(SimpleNamespace(policy=policy, value_head=None, value_model=None))
        assert alone._no_split_modules == [] and alone.value_head is None and alone.value_model is None


def test_one_process_wraps_nothing_and_several_bind_the_roles_forwards_to_the_engines(monkeypatch):
    from rlhflab import parallel
    from rlhflab.rollout.backends import backend_of, use_backend
    from rlhflab.rollout.roles import Engines
    from rlhflab.trainers.online import ranks

    def roles_of(reference):
        return SimpleNamespace(policy=Base(["L"]), value_head=None, value_model=None, lean=True,
                               reference=Base(["L"]) if reference else None, engines=Engines(),
                               generation_policy=None)

    cfg = SimpleNamespace(parallel_strategy="auto", shard_frozen_models=True)
    roles = roles_of(reference=True)
    backend = object()
    use_backend(roles.policy, backend)
    one = ranks.wrap_roles(roles, cfg, parallel.SINGLE)
    assert one.world is parallel.SINGLE and one.roles is roles and one.backend is backend
    assert one.device == torch.device("cpu") and one.layout.strategy == "none" and not one.sharded
    assert not one.partitioned and one.reference is not None and roles.engines == Engines() and roles.lean
    assert isinstance(one.trained.model, ranks.Trained) and one.trained.model.policy is roles.policy
    with one.whole_policy() as policy:
        assert policy is roles.policy
    with one.whole_roles() as whole:
        assert whole is roles

    seen = {}

    class Engine:
        def __init__(self, model, layout):
            self.model, self.layout = model, layout

        def __call__(self, fn):
            seen.setdefault("calls", []).append(self)
            return fn(self.model)

    def wrap_model(model, world, strategy, plain_on_every_rank=False):
        seen["model"] = (strategy, plain_on_every_rank)
        return Engine(model, parallel.Layout("fsdp2", world))

    def wrap_frozen(model, world, strategy, shard=True):
        seen["frozen"] = (strategy, shard)
        return Engine(model, parallel.Layout("fsdp2" if shard else "replicated", world))

    monkeypatch.setattr(parallel, "wrap_model", wrap_model)
    monkeypatch.setattr(parallel, "wrap_frozen", wrap_frozen)
    monkeypatch.setattr(parallel, "holds_shards", lambda model: isinstance(model, ranks.Trained))
    cfg = SimpleNamespace(parallel_strategy="fsdp2", shard_frozen_models=False)
    for shard in (False, True):
        cfg.shard_frozen_models = shard
        roles = roles_of(reference=True)
        many = ranks.wrap_roles(roles, cfg, parallel.World(1, 2))
        assert seen["model"] == ("fsdp2", True) and seen["frozen"] == ("fsdp2", shard)
        assert many.sharded and many.partitioned and roles.lean is False
        assert roles.generation_policy == many.whole_policy
        seen["calls"] = []
        assert roles.engines.trained(lambda: 5) == 5 and seen["calls"] == [many.trained]
        assert roles.engines.reference(lambda: 6) == 6
        assert seen["calls"] == ([many.trained, many.reference] if shard else [many.trained])
    roles = roles_of(reference=False)
    monkeypatch.setattr(parallel, "holds_shards", lambda model: False)
    many = ranks.wrap_roles(roles, cfg, parallel.World(0, 2))
    assert many.reference is None and roles.lean is True and roles.generation_policy is None
    assert roles.engines.reference is Engines().reference and backend_of(roles.policy) is not backend


class Gathering:
    """A partitioned trained module whose gathered whole copy is `whole` (None on ranks that get none)."""

    def __init__(self, whole):
        self.whole, self.asked = whole, []

    def gathered(self, all_ranks=False):
        from contextlib import contextmanager

        @contextmanager
        def copy():
            self.asked.append(all_ranks)
            yield self.whole
        return copy()


def test_whole_weights_come_from_a_gathered_copy_when_the_weights_are_partitioned(monkeypatch):
    from rlhflab import parallel
    from rlhflab.rollout.backends import backend_of
    from rlhflab.trainers.online.ranks import OnlineRanks

    roles = SimpleNamespace(policy="sharded policy", value_head="sharded head", value_model=None, precision="p")
    whole = SimpleNamespace(policy=torch.nn.Linear(1, 1), value_head="whole head", value_model="whole value")
    backend = object()
    gathering = Gathering(whole)
    gathering.model = "trained"
    monkeypatch.setattr(parallel, "holds_shards", lambda model: model == "trained")
    ranks = OnlineRanks(parallel.World(1, 2), gathering, None, roles, torch.device("cpu"), backend)
    with ranks.whole_policy() as policy:
        assert policy is whole.policy and backend_of(policy) is backend
    with ranks.whole_policy(on_every_rank=False) as policy:
        assert policy is whole.policy
    with ranks.whole_roles() as plain:
        assert (plain.policy, plain.value_head, plain.value_model, plain.precision) == (
            whole.policy, "whole head", "whole value", "p")
    assert gathering.asked == [True, False, False] and roles.policy == "sharded policy"
    gathering.whole = None  # a rank the copy is not made on
    with ranks.whole_policy(on_every_rank=False) as policy:
        assert policy is None
    with ranks.whole_roles() as plain:
        assert plain is None
    monkeypatch.setattr(parallel, "holds_shards", lambda model: False)  # DDP: whole weights on every rank
    for rank, every, mine in [(0, False, True), (1, True, True), (1, False, False)]:
        ranks.world = parallel.World(rank, 2)
        with ranks.whole_policy(on_every_rank=every) as policy:
            assert policy is (roles.policy if mine else None)
        with ranks.whole_roles() as plain:
            assert plain is (roles if rank == 0 else None)


def test_a_step_another_rank_found_non_finite_is_dropped_on_every_rank_through_the_engine(monkeypatch):
    """Rank 1's losses are finite, but the engine says some rank's was not: each step is dropped (DeepSpeed's
    accumulated part too), none applied; with 4 accumulation steps over 2 processes each rank would run 2
    micro-batches, synchronising on its second only."""
    from rlhflab import parallel

    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: [plain, plain])
    engine = Engine(1)
    engine.world.any = lambda flag: True
    stats, roles, scheduler = run(Recorder(), scored([1, 2, 3, 1]), config(nonfinite="skip"), trained=engine)
    assert stats == {"skipped": 2} and len(engine.dropped) == 2 and engine.backwards == []
    assert roles.weight.item() == 0.0 and scheduler.last_epoch == 0
    with pytest.raises(FloatingPointError, match=r"^STUB update 0: non-finite STUB loss nan "):
        run(Recorder(), scored([1, 2, 3, 1]), config(), trained=engine)
    engine = Engine(1)
    algorithm = Recorder()
    stats, _, _ = run(algorithm, scored([1, 2, 3, 1] * 2), config(num_mini_batches=1, gradient_accumulation_steps=4),
                      trained=engine)
    assert engine.syncs == [False, True] and len(algorithm.calls) == 2
    assert [len(rows) for rows, *_ in algorithm.calls] == [2, 2]


def test_an_updates_own_sampling_generator_is_its_round_0_one():
    from rlhflab.trainers.online.ranks import rollout_generator, rollout_seed

    assert rollout_generator(3, 7, "cpu").initial_seed() == rollout_seed(3, 7) == 5370235883621230672


def test_the_checkpointed_modules_are_the_roles_trained_ones_by_name(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.state import role_modules, unpack_online

    policy, value_model = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert role_modules(SimpleNamespace(policy=policy, value_head=None, value_model=value_model)) == {
        "policy": policy, "value_model": value_model}
    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    trained = SimpleNamespace(load_sharded=lambda optimizer, folder: None)
    with pytest.raises(UserInputError) as err:  # a sharded checkpoint's state that does not fit names its file
        unpack_online(Resumed(tmp_path / "step-1", 1, {}, {"scheduler": {}}, {}), roles, optimizer, scheduler,
                      algorithm, generators, watch, trained=trained)
    assert err.value.where == str(tmp_path / "step-1" / "state.safetensors")


def test_a_row_level_algorithm_shuffles_rows_even_in_a_grouped_rollout():
    algorithm = Recorder()
    run(algorithm, scored([1, 1, 1, 1], group=2), config(num_mini_batches=1), seed=4)
    assert algorithm.calls[0][0] == torch.randperm(4, generator=torch.Generator().manual_seed(4)).tolist()


class Extra(Roles):
    """Roles with one more trainable parameter than the optimiser steps, holding a gradient of 3 throughout."""

    def __init__(self):
        super().__init__()
        self.other = torch.nn.Parameter(torch.zeros(()))
        self.other.grad = torch.tensor(3.0)

    def trainable_parameters(self):
        return [self.weight, self.other]


def test_the_clipped_parameters_are_the_roles_or_under_sharded_training_the_optimisers(monkeypatch):
    """The gradient norm (the step's gradient 1, the extra parameter's 3) is over the roles' trainable parameters
    in one process, over the optimiser's (the shards) when several processes train sharded."""
    from rlhflab import parallel

    stats, _, _ = run(Recorder(), scored([1, 2]), config(num_mini_batches=1), roles=Extra())
    assert stats["grad_norm"] == pytest.approx(math.sqrt(10))
    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: [[], plain])  # rank 1's: the last
    for sharded, norm in [(True, 0.5), (False, math.sqrt(0.25 + 9))]:  # this rank's half of the tokens: 0.5
        stats, _, _ = run(Recorder(), scored([1, 2, 1, 2]), config(num_mini_batches=1), roles=Extra(),
                          trained=Engine(1, sharded=sharded))
        assert stats["grad_norm"] == pytest.approx(norm)


def test_the_schedule_steps_for_a_minibatch_when_any_of_its_parts_was_applied():
    """Two minibatches of a policy then a value step, skip mode: the first minibatch's value step dropped (its
    policy step applied: the schedule steps), the second's both dropped (it does not)."""
    algorithm = Recorder(parts=("policy", "value"), nan_calls=(1, 2, 3))
    stats, roles, scheduler = run(algorithm, scored([1, 2, 3, 1]), config(nonfinite="skip"), lr=0.5)
    assert stats["skipped"] == 3 and scheduler.last_epoch == 1 and roles.weight.item() == pytest.approx(-0.5)


def test_an_infinite_loss_is_named_as_it_is():
    with pytest.raises(FloatingPointError, match=r"^STUB update 0: non-finite STUB loss inf "):
        run(Recorder(nan_calls=(0,), bad=float("inf")), scored([1, 2]), config(num_mini_batches=1))


def test_a_micro_batch_loss_is_the_whole_steps_unless_a_part_is_named_and_a_value_part_has_no_entropy():
    """The forward reads the micro-batch's prompts, their mask, its responses and the batch's loss mask (not the
    response mask: row 2's reward failed), at the run's temperature; the loss gets the update's advantages."""
    roles, idx, share = Roles(), torch.tensor([2, 0]), SimpleNamespace(tokens=1)
    batch = scored([1, 2, 3])
    batch = ScoredRollout(batch.rollout, batch.scores, torch.tensor([True, True, False]),
                          batch.mask & torch.tensor([[True], [True], [False]]), batch.kl, 1)
    batch.rollout.query_ids = torch.tensor([[1, 1], [2, 2], [3, 3]])
    batch.rollout.query_mask = torch.tensor([[True, True], [False, True], [False, False]])

    def read_the_rows():
        q, qm, rm = roles.inputs
        return (q.tolist(), qm.tolist(), rm.tolist()) == ([[3, 3], [1, 1]], [[False, False], [True, True]],
                                                          [[False] * 3, [True, False, False]])

    for entropy, part, extra, entropy_grad in [(False, "all", set(), False), (False, "value", {"part"}, False),
                                               (True, "value", {"part"}, False),
                                               (True, "policy", {"part", "entropy"}, True),
                                               (True, "all", {"entropy"}, True)]:
        algorithm = Recorder(entropy=entropy)
        if part == "all":
            micro_losses(algorithm, roles, batch, ADVANTAGES, idx, share, 0.5)
        else:
            micro_losses(algorithm, roles, batch, ADVANTAGES, idx, share, 0.5, None, part)
        assert set(algorithm.calls[0][2]) == extra and algorithm.advantages is ADVANTAGES
        assert roles.forwards[-1] == ([2, 0], 0.5, part, entropy_grad) and read_the_rows()


def test_a_rank_backs_its_real_micro_batches_through_the_engine_at_full_weight(monkeypatch):
    from rlhflab import parallel

    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: [[], plain])
    lengths, roles, engine = [1, 2, 3, 1], Roles(), Engine(1)
    roles.weight.data.fill_(2.0)
    run(Recorder(), scored(lengths), config(num_mini_batches=1), roles=roles, trained=engine)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()
    assert engine.backwards == [pytest.approx(2.0 * sum(lengths[r] for r in order[2:]) / 7)]
    engine = Engine(1)
    engine.world.any = lambda flag: True
    run(Recorder(), scored(lengths), config(nonfinite="skip"), trained=engine)
    assert all(isinstance(loss, torch.Tensor) for loss in engine.dropped) and len(engine.dropped) == 2


def test_an_engine_that_steps_itself_clips_and_steps_in_place_of_the_optimiser(monkeypatch):
    """DeepSpeed: its step applies the update and gives the norm (2.5 here); the optimiser is never stepped."""
    from rlhflab import parallel

    monkeypatch.setattr(parallel, "gather_objects", lambda plain, world: [[], plain])
    engine = Engine(1)
    engine.steps_itself, engine.step = True, lambda: torch.tensor(2.5)
    stats, roles, scheduler = run(Recorder(), scored([1, 2, 3, 1]), config(num_mini_batches=1), trained=engine)
    assert stats["grad_norm"] == 2.5 and roles.weight.item() == 0.0 and scheduler.last_epoch == 1


class Huge(Recorder):
    """A loss whose gradient 1e34 overflows float32 once fp16's scaler multiplies it by 65536."""

    def loss(self, *args, **kwargs):
        loss, stats = super().loss(*args, **kwargs)
        return loss * 1e34, stats


def test_a_step_fp16s_scaler_skips_is_its_own_not_a_dropped_one():
    roles = Roles()
    roles.precision = MixedPrecision("fp16", "cpu")
    stats, _, scheduler = run(Huge(), scored([1, 2]), config(num_mini_batches=1), roles=roles)  # stop mode
    assert stats == {"skipped": 0} and roles.weight.item() == 0.0 and scheduler.last_epoch == 0
    assert roles.precision.skipped_steps == 1 and roles.precision.scaler.get_scale() < 65536
