"""The online loop's passes, its per-rank cut and seeds, and its checkpoint state, on hand-made numbers, no model
(issue 36: docs/mutation.md lists the mutants of trainers/online/passes.py, ranks.py and state.py they kill).

The passes run a stand-in algorithm that records every loss call (its rows, its StepShare, its part) over
stand-in roles whose log-probs are one trainable scalar: the shares, the shuffles, the micro-batch cut, the
stats and the steps are read off by hand."""


import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers.online.algorithm import AlgorithmDefaults, ScoredRollout
from rlhflab.trainers.online.passes import average_stats, backward, micro_losses, rows_named, shuffled_rows
from rlhflab.trainers.online.passes import update_passes

from online_stubs import ADVANTAGES, Engine, Recorder, Roles, config, run, scored  # noqa: F401 - not every file uses each
from online_stubs import Tokenizer, rollout_of


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


def test_an_updates_own_sampling_generator_is_its_round_0_one():
    from rlhflab.trainers.online.ranks import rollout_generator, rollout_seed

    assert rollout_generator(3, 7, "cpu").initial_seed() == rollout_seed(3, 7) == 5370235883621230672


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


# --- the loop's scoring, KL and per-update metrics (trainers/online/loop.py) ------------------------------------


class Moved(torch.Tensor):
    """A tensor that records the devices it is moved to."""

    moves: list = []

    def to(self, *args, **kwargs):
        Moved.moves.append(args)
        return super().to(*args, **kwargs)


def test_scores_lose_the_length_penalties_and_a_row_the_reward_failed_on_scores_zero():
    """Responses "5 6" + EOS (EOS 9: 3 tokens), "7 8 7 8" and "1 2 3 4" (both cut at the cap of 4 without EOS).
    The reward gives 1, fails on row 1 (None), gives 3. Missing-EOS penalty 0.5; overlong cap 4, buffer 2,
    factor 1: lengths 3, 4, 4 lose 0.5, 1, 1. Row 0: 1 - 0.5 = 0.5; row 2: 3 - 0.5 - 1 = 1.5; row 1, shaped
    0 - 0.5 - 1 = -1.5, scores 0 and is invalid. The reward reads each response's text (its EOS left out), its
    prompt and row, its token ids (EOS in, padding out) and the optimiser steps done."""
    from rlhflab.trainers.online.loop import score_rollout

    calls = []

    def reward(prompts, responses, rows, context=None):
        calls.append((prompts, responses, rows, context))
        return [1.0, None, 3.0]

    rows = [SimpleNamespace(prompt=f"p{i}") for i in range(3)]
    rollout = rollout_of([[5, 6, 9, 0], [7, 8, 7, 8], [1, 2, 3, 4]], [3, 4, 4], [True, False, False])
    scores, valid = score_rollout(rollout, reward, Tokenizer(), rows, 0.5, global_step=6, overlong=(4, 2, 1.0))
    assert scores.tolist() == [0.5, 0.0, 1.5] and valid.tolist() == [True, False, True]
    prompts, responses, got_rows, context = calls[0]
    assert (prompts, responses, got_rows) == (["p0", "p1", "p2"], ["5 6", "7 8 7 8", "1 2 3 4"], rows)
    assert context.completion_ids == [[5, 6, 9], [7, 8, 7, 8], [1, 2, 3, 4]] and context.global_step == 6
    # no overlong shaping by default, and step 0: row 1 (no EOS) loses the 0.5 alone
    scores, _ = score_rollout(rollout, lambda p, r, rows, context=None: [1.0, 2.0, 3.0], Tokenizer(), rows, 0.5)
    assert scores.tolist() == [1.0, 1.5, 2.5]
    score_rollout(rollout, reward, Tokenizer(), rows, 0.0)
    assert calls[-1][3].global_step == 0


def test_a_reward_with_the_wrong_number_of_scores_is_refused_and_scores_move_to_the_rollouts_device():
    from rlhflab import rewards
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.loop import score_rollout

    rows = [SimpleNamespace(prompt="p")] * 3
    rollout = rollout_of([[5, 9], [5, 9], [5, 9]], [2, 2, 2], [True] * 3)
    with pytest.raises(UserInputError) as error:
        score_rollout(rollout, lambda p, r, rows: [1.0, 2.0], Tokenizer(), rows, 0.0)
    assert str(error.value) == ("reward_fn: the reward returned (2,) scores for 3 responses -> return one score per "
                                "response, in the order given")
    Moved.moves = []
    scored = rewards.Scored(torch.tensor([1.0, 2.0, 3.0]).as_subclass(Moved),
                            torch.ones(3, dtype=torch.bool).as_subclass(Moved))
    scores, valid = score_rollout(rollout, lambda p, r, rows: scored, Tokenizer(), rows, 0.0)
    assert scores.tolist() == [1.0, 2.0, 3.0] and valid.tolist() == [True] * 3
    assert Moved.moves == [(torch.device("cpu"),), (torch.device("cpu"),)]


def test_a_scored_batch_masks_failed_rows_and_holds_the_k1_kl_of_their_tokens():
    """Row 1 the reward failed on: out of the mask, its KL 0. KL = log pi_old - log pi_ref on the rest's tokens
    (0 on padding, whatever the log-probs there), its sum per response the sequence KL."""
    from rlhflab.trainers.online.loop import scored_batch

    rollout = rollout_of([[5, 6, 9], [5, 9, 0], [9, 0, 0]], [3, 2, 1], [True] * 3,
                         logprobs=[[-1.0, -2.0, -0.5], [-1.0, -1.0, -4.0], [-0.25, -3.0, -3.0]],
                         ref_logprobs=[[-1.5, -1.0, -0.5], [-3.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    scores, valid = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([True, False, True])
    batch = scored_batch(rollout, scores, valid, 3)
    assert batch.rollout is rollout and batch.scores is scores and batch.valid is valid and batch.group_size == 3
    assert batch.mask.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    assert batch.kl.tolist() == [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [0.75, 0.0, 0.0]]
    assert batch.sequence_kl.tolist() == [-0.5, 0.0, 0.75] and batch.sampler_weights is None


def sampler_cfg(**overrides):
    base = dict(sampler_correction="token_truncate", sampler_correction_min=0.5, sampler_correction_max=2.0,
                generation_backend="hf", async_generation=False)
    return SimpleNamespace(**{**base, **overrides})


def test_sampler_weights_are_the_truncated_ratios_when_the_correction_is_on_and_has_something_to_weigh(caplog):
    """Trainer minus sampler log-probs ln 4, 0, ln 1.5 | ln 0.25, (masked) ln 8: weights 2 (clamped), 1, 1.5 |
    0.5 (clamped), 0 where the batch's mask is False. Off ("none"), auto with the process's own sampler, auto
    on a fresh asynchronous rollout, or no policy gradient: the batch as it is; no sampler log-probs: as it is,
    warned about once."""
    import logging

    from rlhflab.trainers.online.loop import scored_batch, warn_uncorrected, with_sampler_weights

    ln = math.log
    sampler = [[0.0, -1.0, -ln(1.5)], [0.0, -ln(8.0)]]
    rollout = rollout_of([[5, 6, 9], [5, 9, 0]], [3, 2], [True, True],
                         logprobs=[[ln(4.0), -1.0, 0.0], [ln(0.25), 0.0, 0.0]],
                         sampler_logprobs=[sampler[0], sampler[1] + [0.0]])
    batch = scored_batch(rollout, torch.zeros(2), torch.tensor([True, True]), 1)
    batch = dataclasses.replace(batch, mask=batch.mask & torch.tensor([[True, True, True], [True, False, False]]))
    expected = [2.0, 1.0, 1.5, 0.5, 0.0, 0.0]
    for cfg, kwargs in [(sampler_cfg(), {}), (sampler_cfg(), {"fresh": True}),
                        (sampler_cfg(sampler_correction="auto", generation_backend="vllm"), {})]:
        weighted = with_sampler_weights(batch, cfg, **kwargs)
        assert weighted.sampler_weights.flatten().tolist() == pytest.approx(expected) and weighted.kl is batch.kl
    for cfg, kwargs in [(sampler_cfg(sampler_correction="none"), {}), (sampler_cfg(sampler_correction="auto"), {}),
                        (sampler_cfg(sampler_correction="auto", generation_backend="vllm"), {"fresh": True}),
                        (sampler_cfg(), {"policy_gradient": False})]:
        assert with_sampler_weights(batch, cfg, **kwargs) is batch
    warn_uncorrected.cache_clear()
    bare = dataclasses.replace(batch, rollout=dataclasses.replace(rollout, sampler_logprobs=None))
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        assert with_sampler_weights(bare, sampler_cfg(generation_backend="stub")) is bare
        with_sampler_weights(bare, sampler_cfg(generation_backend="stub"))
    assert [r.getMessage() for r in caplog.records] == [
        "--sampler_correction token_truncate: the stub sampler reported no log-probs; the update is not corrected"]


def test_sampler_weight_metrics_read_the_masked_tokens_only():
    """Weights 0.5, 1, 1 | 2, 0, 1.5 on the six real tokens (9 and 0 on the masked ones), bounds [0.5, 2]: mean
    6 / 6, min 0, max 2, at a bound 2 / 6, dropped (0) 1 / 6."""
    from rlhflab.trainers.online.loop import sampler_weight_metrics

    batch = scored([3, 3], width=4)
    assert sampler_weight_metrics(batch, 0.5, 2.0) == {}
    weights = torch.tensor([[0.5, 1.0, 1.0, 9.0], [2.0, 0.0, 1.5, 0.0]])
    assert sampler_weight_metrics(dataclasses.replace(batch, sampler_weights=weights), 0.5, 2.0) == pytest.approx({
        "sampler/is_weight_mean": 1.0, "sampler/is_weight_min": 0.0, "sampler/is_weight_max": 2.0,
        "sampler/is_truncated_share": 2 / 6, "sampler/is_dropped_share": 1 / 6})
    weights = torch.tensor([[1.0, 1.0, 1.0, -9.0], [1.0, 1.0, 1.0, 0.0]])  # the masked extremes stay out
    metrics = sampler_weight_metrics(dataclasses.replace(batch, sampler_weights=weights), 0.5, 2.0)
    assert (metrics["sampler/is_weight_min"], metrics["sampler/is_dropped_share"]) == (1.0, 0.0)


def test_sampler_metrics_compare_the_samplers_logprobs_with_the_trainers_on_real_tokens():
    """Sampler minus trainer log-probs 0.5, -1 | 0, -1, 1 on the real tokens (5 on row 0's padding): mean |gap|
    3.5 / 5, largest 1, the per-response sums -0.5 and 0 average -0.25. No sampler log-probs: nothing."""
    from rlhflab.trainers.online.loop import sampler_metrics

    rollout = rollout_of([[5, 9, 0], [5, 6, 9]], [2, 3], [True, True], logprobs=[[-1.5, -1.0, 0.0], [-0.5, -2.0, -2.0]],
                         sampler_logprobs=[[-1.0, -2.0, 5.0], [-0.5, -3.0, -1.0]])
    assert sampler_metrics(rollout) == pytest.approx({"sampler/logprob_diff_mean": 0.7, "sampler/logprob_diff_max": 1.0,
                                                      "sampler/kl": -0.25})
    assert sampler_metrics(dataclasses.replace(rollout, sampler_logprobs=None)) == {}


def test_an_updates_metrics_average_the_valid_rows_scores_and_kl_and_every_rows_length_and_entropy():
    """Four responses of 3, 2, 1, 3 tokens in groups of 2, row 1's reward failed, row 2 cut without EOS: scores
    1, 2, 3 of the valid rows average 2; their sequence KLs 0.75, 0.5, -0.25 average 1 / 3; entropy over the 9
    real tokens 24 / 9 (99 on padding left out); lengths average 2.25; 3 ended with EOS; 1 invalid row."""
    from rlhflab.rollout.diversity import diversity_metrics
    from rlhflab.trainers.online.loop import rollout_metrics, sampler_metrics, sampler_weight_metrics, scored_batch

    rollout = rollout_of([[5, 6, 9], [5, 9, 0], [7, 0, 0], [5, 6, 9]], [3, 2, 1, 3], [True, True, False, True],
                         logprobs=[[0.25, 0.5, 0.0], [1.0, 1.0, 0.0], [0.5, 0.0, 0.0], [-0.25, 0.0, 0.0]],
                         entropy=[[1, 2, 3], [4, 5, 99], [6, 99, 99], [1, 1, 1]],
                         sampler_logprobs=[[0.0, 0.5, 0.0], [1.0, 1.0, 0.0], [0.5, 0.0, 0.0], [-0.25, 0.0, 0.0]])
    batch = scored_batch(rollout, torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([True, False, True, True]), 2)
    batch = dataclasses.replace(batch, sampler_weights=torch.where(batch.mask, 0.5, 0.0))
    keys = [4, 4, 8, 8]
    assert rollout_metrics(batch, keys, (0.5, 2.0)) == pytest.approx({
        "objective/scores": 2.0, "objective/kl": 1 / 3, "objective/entropy": 24 / 9, "val/num_eos_tokens": 3,
        "response/length_mean": 2.25, "reward/invalid_rows": 1,
        **diversity_metrics(rollout.response_ids, rollout.response_mask, rollout.ended_with_eos, keys, 2),
        **sampler_metrics(rollout), **sampler_weight_metrics(batch, 0.5, 2.0)})
    assert "response/duplicate_share_group" in rollout_metrics(batch, keys, (0.5, 2.0))
    none = scored_batch(rollout, torch.zeros(4), torch.zeros(4, dtype=torch.bool), 2)
    assert math.isnan(rollout_metrics(none, keys, (0.5, 2.0))["objective/scores"])
