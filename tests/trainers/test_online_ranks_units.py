"""The online loop's per-rank pieces (trainers/online/ranks.py and the passes under several ranks): seeds, the
micro-batch cut, the global batch, the wrapped roles, on stand-ins, no model (issue 36)."""


import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers.online.algorithm import AlgorithmDefaults, ScoredRollout
from rlhflab.trainers.online.passes import average_stats, backward, micro_losses, rows_named, shuffled_rows
from rlhflab.trainers.online.passes import update_passes

from online_stubs import ADVANTAGES, Engine, Recorder, Roles, config, run, scored  # noqa: F401 - not every file uses each


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


# --- one update's rollout: this rank's prompts generated and scored, every rank's gathered (loop.py) ----------


def one_update(monkeypatch, world, batch_ids, *args, **kwargs):
    """trainers/online/loop.rollout_of_update over 3 train prompts (ids [10], [11, 11], [12, 12, 12]) with
    collect_rollout, rollout_generator and gather_rollout stood in for (what they were asked is recorded) and the
    real scoring: rows "9", "7 8 7" (cut, no EOS), "1 2" + EOS, "6" + EOS; reward 1, 2, 3, 4; missing-EOS penalty
    0.5, overlong cap 3, buffer 1, factor 2 (lengths 3 lose 2): scores 1, 2 - 0.5 - 2, 3 - 2, 4."""
    from online_stubs import Tokenizer, rollout_of

    from rlhflab.trainers.online import loop

    asked = SimpleNamespace(collect=[], seeds=[], rewards=[], gathered=[])

    def collect(roles, prompts, **options):
        rows = len(prompts)
        asked.collect.append((roles, prompts, options))
        asked.rollout = rollout_of([[9, 0, 0], [7, 8, 7], [1, 2, 9], [6, 9, 0]][:rows], [1, 3, 3, 2][:rows],
                                   [True, False, True, True][:rows])
        return asked.rollout

    def reward(prompts, responses, rows, context=None):
        asked.rewards.append((prompts, context.global_step))
        return [1.0, 2.0, 3.0, 4.0][: len(prompts)]

    monkeypatch.setattr(loop, "collect_rollout", collect)
    monkeypatch.setattr(loop, "rollout_generator",
                        lambda *seed: asked.seeds.append(seed) or f"generator {len(asked.seeds)}")
    monkeypatch.setattr(loop, "gather_rollout",
                        lambda rollout, world: asked.gathered.append((rollout, world)) or "whole")
    cfg = SimpleNamespace(seed=3, missing_eos_penalty=0.5, response_length=3, overlong_buffer_len=1,
                          overlong_penalty_factor=2.0)
    ranks = SimpleNamespace(world=world, roles="roles", device="cuda:7")
    rows = [SimpleNamespace(prompt=f"p{i}") for i in range(3)]
    got = loop.rollout_of_update(ranks, 3, batch_ids, [[10], [11, 11], [12, 12, 12]], rows, reward, Tokenizer(),
                                 "settings", cfg, *args, **kwargs)
    return asked, got


def test_an_update_generates_and_scores_its_batch_with_its_own_sampling_seed_and_optimiser_step(monkeypatch):
    """One process, prompts 2 and 0 in groups of 2, update 3 of 4 optimiser steps each: 8 steps done; the update's
    own generator (seed 3, update 3, round 0), the rollout's forward kept, the asynchronous generator's responses
    handed on as they are."""
    from rlhflab import parallel

    world = parallel.World()
    asked, (rollout, scores, valid, seconds) = one_update(monkeypatch, world, [2, 2, 0, 0], 2, True, ("drawn", 1.5), 4)
    assert asked.collect == [("roles", [[12, 12, 12], [12, 12, 12], [10], [10]], dict(
        pad_id=0, eos_id=9, settings="settings", generator="generator 1", keep_graph=True, place=None,
        response_width=None, sampled=("drawn", 1.5)))]
    assert asked.seeds == [(3, 3, "cuda:7", 0)] and asked.rewards == [(["p2", "p2", "p0", "p0"], 8)]
    assert rollout == "whole" and asked.gathered == [(asked.rollout, world)]
    assert scores.tolist() == [1.0, -0.5, 1.0, 4.0] and valid.tolist() == [True] * 4 and 0 <= seconds < 60
    # by default one optimiser step an update (2 done) and round 0; a refill round samples with its own seed
    asked, _ = one_update(monkeypatch, world, [2, 2, 0, 0], 2, False)
    assert asked.seeds == [(3, 3, "cuda:7", 0)] and asked.rewards[0][1] == 2 and not asked.collect[0][2]["keep_graph"]
    asked, _ = one_update(monkeypatch, world, [1, 0], 1, False, None, 1, 2)
    assert asked.seeds == [(3, 3, "cuda:7", 2)] and asked.collect[0][1] == [[11, 11], [10]]


class Drawn:
    """The asynchronous generator's responses for a global batch: `rows` gives one rank's share."""

    def rows(self, first, count):
        return ("rows", first, count)


def test_a_rank_generates_its_share_of_whole_prompts_at_its_place_and_gathers_every_ranks_scores(monkeypatch):
    """Rank 1 of 2, 3 prompts in groups of 2: rank 1 answers prompt 2 (rows 4, 5 of 6, prompts 3 tokens wide at
    most), takes those rows of the asynchronous generator's responses, decodes to the widest rank's length, and
    gathers the scores and the validity (as uint8: gloo gathers no bool) after rank 0's 4 rows."""
    from rlhflab import parallel
    from rlhflab.rollout.generate import BatchPlace

    gathered = []

    def gather_rows(t, world):
        gathered.append((t.dtype, world))
        first = torch.full((4,), 7, dtype=t.dtype) if t.is_floating_point() else torch.zeros(4, dtype=t.dtype)
        return torch.cat([first, t])

    monkeypatch.setattr(parallel, "gather_rows", gather_rows)
    world = parallel.World(rank=1, world_size=2)
    asked, (rollout, scores, valid, _) = one_update(monkeypatch, world, [0, 0, 1, 1, 2, 2], 2, False, (Drawn(), 1.5))
    (roles, prompts, options), = asked.collect
    assert prompts == [[12, 12, 12]] * 2 and options["place"] == BatchPlace(first=4, total=6, prompt_width=3)
    assert options["sampled"] == (("rows", 4, 2), 1.5) and options["response_width"] == world.max
    assert asked.rewards == [(["p2", "p2"], 2)] and asked.gathered == [(asked.rollout, world)] and rollout == "whole"
    assert gathered == [(torch.float32, world), (torch.uint8, world)]
    assert scores.tolist() == [7.0] * 4 + [1.0, -0.5] and valid.tolist() == [False] * 4 + [True] * 2
