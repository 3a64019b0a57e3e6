"""train_online's optional paths with the stand-ins of test_online_loop_unit.py (issue 36): --dynamic_sampling's
refill rounds, --async_generation's rollouts taken from a generator, --filter_prompts, a resumed asynchronous
checkpoint run synchronously, and the sampler-correction weights."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from online_stubs import LoopAlgorithm
from rlhflab.trainers.online import loop
from rlhflab.trainers.online.state import Progress
from tests.trainers.test_online_loop_unit import SIGNAL, train


def test_dynamic_sampling_refills_from_the_next_prompts_and_logs_the_generated_answers(monkeypatch):
    refills = []

    def refill(first, sample_round, groups, group, max_rounds, pad_id):
        second = sample_round(1)  # one more round: the next prompts, its own sampling noise
        refills.append((first, second, groups, group, max_rounds, pad_id))
        chosen = loop.Round(second.batch_ids, second.rollout, second.scores * 10, second.valid, 0.25)
        return chosen, {"dynamic/generated": 8, "dynamic/rounds": 2}

    monkeypatch.setattr(loop, "refill", refill)
    h = train(monkeypatch, cfg=dict(dynamic_sampling=True, max_refill_rounds=3, total_episodes=8))
    assert [(r["update"], r["keep_graph"]) for r in h.rollouts] == [(1, True), (1, False), (2, True), (2, False)]
    first, second, groups, group, max_rounds, pad_id = refills[0]
    assert (groups, group, max_rounds, pad_id) == (2, 2, 3, 0) and first.scoring_s == 0.5
    assert first.batch_ids == h.rollouts[0]["batch_ids"] and second.batch_ids == h.rollouts[1]["batch_ids"]
    assert h.rollouts[1]["steps"] == 2 and h.rollouts[1]["batch_ids"] != h.rollouts[2]["batch_ids"]
    assert h.passes[0]["batch_ids"] == second.batch_ids and h.passes[0]["batch"].scores.tolist() == [10, 20, 30, 60]
    row = h.run.rows[0][1]
    assert (row["dynamic/generated"], row["dynamic/rounds"], row["episodes_generated"], row["episode"]) == (8, 2, 8, 4)
    assert h.run.rows[1][1]["episodes_generated"] == 16 and h.run.summary["episodes_generated"] == 16
    assert row["time/scoring"] == 0.5 + 1.25  # forward 0.5, then t2 - (t1 - the chosen round's 0.25 s)


def test_a_sampling_round_is_handed_its_number(monkeypatch):
    rounds = []
    monkeypatch.setattr(loop, "refill", lambda first, sample_round, *a: (sample_round(2), {}))
    original = loop.rollout_of_update
    h = train(monkeypatch, cfg=dict(dynamic_sampling=True, total_episodes=4))
    assert len(h.rollouts) == 2 and h.run.summary["episodes_generated"] == 4  # no dynamic/generated: the batch
    assert original is not loop.rollout_of_update


class Ahead:
    """The asynchronous generator's books: rollout u sampled with the weights of update u - 1 - stale[u]."""

    startup_s = 5.0

    def __init__(self, stale, prompts):
        self.stale, self.prompts, self.calls = stale, prompts, []

    def take(self, update):
        self.calls.append(("take", update))
        generated = SimpleNamespace(seconds={"generation": 99.0})
        delivered = SimpleNamespace(generated=generated, version=update - 1 - self.stale[update], seconds=2.0)
        return self.prompts(update), delivered, 0.5

    def after_update(self, roles, update):
        self.calls.append(("after", update))

    def in_flight(self):
        return [[9, [1, 1, 2, 2], 8]], {"in_flight.9.x": torch.zeros(1)}


def test_async_rollouts_are_taken_from_the_generator_and_their_staleness_logged(monkeypatch):
    ahead = Ahead({1: 0, 2: 1, 3: 0}, lambda u: [u % 3, u % 3, (u + 1) % 3, (u + 1) % 3])
    opened = []

    @contextmanager
    def async_rollouts(cfg, roles, tokenizer, settings, draws, prompt_ids, start, num_updates, in_flight, kept, world):
        opened.append((start, num_updates, in_flight, kept, draws.count, draws.group))
        yield ahead

    monkeypatch.setattr(loop, "async_rollouts", async_rollouts)
    weights = []
    real = loop.with_sampler_weights
    monkeypatch.setattr(loop, "with_sampler_weights", lambda batch, cfg, pg, fresh: weights.append((pg, fresh)) or
                        real(batch, cfg, pg, fresh))
    h = train(monkeypatch, cfg=dict(async_generation=True))
    assert opened == [(0, 3, [], {}, 2, 2)] and weights == [(True, True), (True, False), (True, True)]
    assert ahead.calls == [("take", 1), ("after", 1), ("take", 2), ("after", 2), ("take", 3), ("after", 3)]
    assert [r["batch_ids"] for r in h.rollouts] == [[1, 1, 2, 2], [2, 2, 0, 0], [0, 0, 1, 1]]
    row = h.run.rows[1][1]
    assert (row["async/staleness"], row["async/wait_s"], row["async/generator_s"]) == (1, 0.5, 2.0)
    assert row["tokens_per_s"] == 9 / 2.0  # the generator's own seconds, not the rollout's
    assert h.run.summary["wall_time_s"]["setup"] == 1.0 + 5.0
    assert h.savers[0].calls[0][2].in_flight == [[9, [1, 1, 2, 2], 8]]


def test_a_resumed_async_checkpoint_hands_the_generator_its_rollouts_in_flight(monkeypatch):
    opened = []

    @contextmanager
    def async_rollouts(cfg, roles, tokenizer, settings, draws, prompt_ids, start, num_updates, in_flight, kept, world):
        opened.append((start, in_flight, kept))
        yield None

    monkeypatch.setattr(loop, "async_rollouts", async_rollouts)
    flight = [[2, [1, 1, 0, 0], 1]]
    state = {"in_flight_rollouts": {"in_flight.2.x": 1}}
    resumed = SimpleNamespace(step=1, state=state, commit=lambda: None)
    before = Progress(update=1, episode=4, order=[2, 0], first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75},
                      in_flight=flight)
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: before)
    h = train(monkeypatch, resumed=resumed, cfg=dict(async_generation=True))
    assert opened == [(1, flight, {"in_flight.2.x": 1})]
    # the generator takes the prompts in flight back itself: the draws go on from the checkpoint's order
    assert [r["batch_ids"] for r in h.rollouts][:1] == [[2, 2, 0, 0]]


def test_a_resumed_async_checkpoint_run_synchronously_draws_its_prompts_in_flight_first(monkeypatch):
    flight = [[2, [1, 1, 0, 0], 1], [3, [2, 2, 1, 1], 1]]
    before = Progress(update=1, episode=4, order=[2, 0], first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75},
                      in_flight=flight)
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: before)
    h = train(monkeypatch, resumed=SimpleNamespace(step=1, state={}, commit=lambda: None),
              cfg=dict(total_episodes=16))
    assert [r["batch_ids"] for r in h.rollouts] == [[1, 1, 0, 0], [2, 2, 1, 1], [2, 2, 0, 0]]


def test_filter_prompts_keeps_the_probes_prompts_and_records_it(monkeypatch):
    probed = []

    def filtered_rows(cfg, run, resumed, probe):
        probed.append((run, resumed))
        return {"kept_indices": [2, 0], "kept": 2, "dropped": 1}

    monkeypatch.setattr(loop, "filtered_rows", filtered_rows)
    h = train(monkeypatch, cfg=dict(filter_prompts="both"))
    assert probed == [(h.run, False)]
    assert sorted(set(i for r in h.rollouts for i in r["batch_ids"])) == [0, 1]  # indices of the 2 kept prompts
    assert h.run.summary["prompt_filter"] == {"kept": 2, "dropped": 1}


def test_sampler_correction_weights_the_batch_of_a_policy_gradient(monkeypatch):
    monkeypatch.setattr(loop, "sampler_correction_mode", lambda cfg: "token_truncate")
    seen = []
    monkeypatch.setattr(loop, "sampler_correction_weights", lambda lp, slp, mask, mode, low, high: seen.append(
        (mode, low, high)) or torch.full(lp.shape, 0.5))
    from online_stubs import rollout_of
    from tests.trainers.test_online_loop_unit import Harness

    def with_sampler(self, ranks, update, batch_ids, *a, **k):
        self.rollouts.append(dict(update=update, batch_ids=batch_ids))
        rollout = rollout_of([[5, 9, 0]] * 4, [2] * 4, [True] * 4, logprobs=[[-1.0, -1.0, 0.0]] * 4,
                             sampler_logprobs=[[-1.0, -0.5, 0.0]] * 4)
        return rollout, torch.ones(4), torch.ones(4, dtype=torch.bool), 0.0

    monkeypatch.setattr(Harness, "rollout_of_update", with_sampler)
    h = train(monkeypatch, cfg=dict(sampler_correction="token_truncate"))
    assert seen == [("token_truncate", 0.5, 2.0)] * 3 and h.passes[0]["batch"].sampler_weights[0, 0] == 0.5
    assert h.run.rows[0][1]["sampler/is_weight_mean"] == 0.5 and h.run.rows[0][1]["sampler/logprob_diff_max"] == 0.5
    no_gradient = LoopAlgorithm()
    no_gradient.policy_gradient = False  # online DPO: no policy-gradient term to weight
    h = train(monkeypatch, no_gradient, cfg=dict(sampler_correction="token_truncate"))
    assert len(seen) == 3 and h.passes[0]["batch"].sampler_weights is None


def test_the_collaborators_are_built_with_the_runs_objects(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness, loop_config

    seen = {}
    cfg = loop_config(tokenizer="tok", trust_remote_code=True)
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    monkeypatch.setattr(loop.models, "load_tokenizer", lambda name, trust_remote_code: seen.setdefault(
        "tokenizer", (name, trust_remote_code)) and h.roles)
    monkeypatch.setattr(loop.sources, "prompt_splits", lambda c, tok: seen.setdefault("splits", (c, tok)) and
                        SimpleNamespace(train=[SimpleNamespace(prompt=f"p{i}") for i in range(3)], validation=["v"],
                                        source="s"))
    verifier = SimpleNamespace(name="checker")
    monkeypatch.setattr(loop, "build_verifier", lambda c, prompts, given: seen.setdefault("verifier", given) and
                        verifier)
    build_roles = loop.build_roles
    monkeypatch.setattr(loop, "build_roles", lambda c, critic, precision: seen.setdefault(
        "roles", (critic, precision)) and build_roles(c, critic, precision))
    monkeypatch.setattr(loop, "build_reward", lambda c, tok, policy, rows, precision, given: seen.setdefault(
        "reward", (policy, [r.prompt for r in rows], precision, given)) and (h.reward, {}))
    monkeypatch.setattr(loop, "Evaluator", lambda *a: seen.setdefault("evaluator", a) and SimpleNamespace(
        signal="val/pass_rate", evaluate=lambda policy, step, episode: {"val/pass_rate": 0.5, "episode": episode}))
    monkeypatch.setattr(loop, "RunWatch", lambda *a: seen.setdefault("watch", a) and h.watches.append(
        __import__("online_stubs").LoopWatch(*a)) or h.watches[-1])
    autocasts = []
    monkeypatch.setattr(loop, "generation_autocast", lambda policy, autocast: autocasts.append((policy, autocast))
                        or __import__("contextlib").nullcontext())
    given = loop.Given(callbacks=("cb",))
    opened = []
    monkeypatch.setattr(loop, "open_run", lambda c, name, layout, callbacks: opened.append((name, callbacks)) or
                        (h.run, None))
    monitor = SimpleNamespace(signal="val/pass_rate")
    loop.train_online(cfg, h.algorithm, monitor=monitor, given=given)
    assert seen["tokenizer"] == ("tok", True) and seen["splits"][0] is cfg and seen["verifier"] is given
    assert seen["roles"][0] is False and seen["roles"][1].mode == "no" and opened == [("stub", ("cb",))]
    policy, prompts, precision, given_to_reward = seen["reward"]
    assert (policy, prompts, given_to_reward) == ("policy", ["p0", "p1"], given)  # calibration_prompts 2
    assert seen["evaluator"][0] == ["v"] and seen["evaluator"][2:] == (cfg, h.run, verifier, h.reward, 2)
    assert seen["watch"] == (monitor, h.run, h.roles, False, "val/pass_rate")
    assert autocasts[0] == ("policy", None) and len(autocasts) == 1 + 3  # headroom, evaluations at 0, 2 and the last, 3
    assert ("check_prompt_filter", (cfg, True), {}) in h.calls
    s = h.run.summary
    assert s["validation_pass_rate"] == {"start": 0.5, "end": 0.5} and s["held_out"]["verifier"] == "checker"


class Whole:
    """A trained module whose whole-parameter gathers are recorded (enabled or not)."""

    def __init__(self, log):
        self.log = log

    def prepare(self, optimizer, norm):
        return optimizer

    @contextmanager
    def whole_parameters(self, enabled):
        self.log.append(("whole", enabled))
        yield

    def save_sharded(self, optimizer, folder):
        self.log.append(("shards", folder))


@pytest.mark.parametrize("best", [None, "kept"])
def test_the_best_policy_is_gathered_whole_only_where_the_watch_keeps_one(monkeypatch, best):
    from tests.trainers.test_online_loop_unit import Harness

    log = []
    original = Harness.patch

    def patch(self, mp, *a):
        original(self, mp, *a)
        self.ranks.trained = Whole(log)
        mp.setattr(loop, "RunWatch", lambda *w: self.watches.append(__import__("online_stubs").LoopWatch(*w)) or
                   setattr(self.watches[-1], "best", best) or self.watches[-1])

    monkeypatch.setattr(Harness, "patch", patch)
    train(monkeypatch, cfg=dict(max_seconds=6, total_episodes=40, eval_every=0))
    # first evaluation, the budget's evaluation, the finish
    assert log == [("whole", best is not None)] * 3


def test_a_sharded_layout_writes_and_reads_its_shards(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness

    log, packed, unpacked = [], [], []
    original = Harness.patch

    def patch(self, mp, *a):
        original(self, mp, *a)
        self.ranks.trained, self.ranks.sharded = Whole(log), True
        mp.setattr(loop, "pack_online", lambda *p, sharded, rollouts: packed.append((sharded, rollouts)) or p[5])

    monkeypatch.setattr(Harness, "patch", patch)
    before = Progress(update=2, episode=8, first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75})
    monkeypatch.setattr(loop, "unpack_online", lambda *a, trained: unpacked.append((a[4], a[5], trained)) or before)
    h = train(monkeypatch, resumed=SimpleNamespace(step=2, state={}, commit=lambda: None))
    assert ("optimizer", h.calls[[c[0] for c in h.calls].index("optimizer")][1], False) in h.calls
    assert unpacked[0][2] is h.ranks.trained and unpacked[0][0] is h.algorithm
    assert set(unpacked[0][1]) == {"order", "prompts"}
    assert packed == [(True, {})] * 2  # update 3's step and the finish
    h.savers[0].kwargs["write_shards"]("/folder")
    assert log[-1] == ("shards", "/folder") and h.savers[0].kwargs["layout"] is h.ranks.layout


def test_several_processes_train_with_the_rank_engine_and_never_reuse_the_rollouts_forward(monkeypatch):
    from tests.trainers.test_online_loop_unit import World

    monkeypatch.setattr(World, "distributed", True)
    h = train(monkeypatch)
    assert [r["keep_graph"] for r in h.rollouts] == [False] * 3
    assert all(p["trained"] is h.ranks.trained for p in h.passes)


def recorded(monkeypatch, owner, names, log):
    """Each of `owner`'s `names` wrapped: its arguments recorded in `log[name]` (a list of (args, kwargs))."""
    for name in names:
        inner = getattr(owner, name)

        def wrapper(*a, _inner=inner, _name=name, **k):
            log.setdefault(_name, []).append((a, k))
            return _inner(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)


def test_every_set_up_step_is_handed_the_config_and_the_runs_objects(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness, loop_config

    cfg = loop_config(tokenizer=None, model="the-model", parallel_strategy="ddp", device="cpu:0",
                      calibration_prompts=1)
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    log = {}
    recorded(monkeypatch, loop, ["check_online_config", "check_world", "check_async", "check_dynamic",
                                 "precision_from_config", "build_verifier", "check_prompt_filter", "build_roles",
                                 "build_reward", "wrap_roles", "open_run", "make_optimizer", "make_scheduler",
                                 "Evaluator", "record_start_headroom", "Checkpointer", "save_policy_models",
                                 "pack_online", "rollout_of_update", "update_passes", "configure_threads",
                                 "seed_everything", "configure_allocator"], log)
    recorded(monkeypatch, loop.parallel, ["init_world", "resolve_strategy"], log)
    recorded(monkeypatch, loop.sources, ["prompt_splits"], log)
    recorded(monkeypatch, loop.models, ["load_tokenizer", "configure_logits_chunks"], log)
    recorded(monkeypatch, loop.data, ["encode_prompts"], log)
    recorded(monkeypatch, loop.rewards, ["error_summary"], log)
    loop.train_online(cfg, h.algorithm)
    for name in ("check_online_config", "check_world", "check_async", "check_dynamic", "precision_from_config",
                 "build_verifier", "check_prompt_filter", "build_roles", "build_reward", "open_run", "make_optimizer",
                 "prompt_splits", "rollout_of_update"):
        call = log[name][0]
        assert cfg in call[0][:9] and any(a is cfg for a in call[0]), name
    assert log["wrap_roles"][0][0] == (h.roles, cfg, h.world) and log["init_world"][0][0] == ("cpu:0",)
    assert log["resolve_strategy"][0][0] == ("ddp", h.world)
    assert log["precision_from_config"][0][0][1:] == (h.world.device, "none")
    assert log["load_tokenizer"][0] == (("the-model",), {"trust_remote_code": False})
    assert log["build_roles"][0][1]["critic"] is False and log["build_roles"][0][1]["precision"].mode == "no"
    tokenizer = log["build_reward"][0][0][1]
    assert log["build_reward"][0][0][2:4] == ("policy", log["prompt_splits"][0][0][1] and
                                              log["build_reward"][0][0][3]) and len(log["build_reward"][0][0][3]) == 1
    assert log["build_reward"][0][0][5] is loop.NOTHING and log["build_reward"][0][0][4].mode == "no"
    assert log["encode_prompts"][0][0][0] is tokenizer and log["encode_prompts"][0][0][1] == ["p0", "p1", "p2"]
    assert log["open_run"][0][0][1:] == ("stub", h.ranks.layout, ())
    assert log["make_scheduler"][0][0][1] is cfg and log["make_scheduler"][0][0][2] == 6
    evaluator = log["Evaluator"][0][0]
    assert evaluator[0] == ["v"] and evaluator[1] is tokenizer and evaluator[2:] == (cfg, h.run, None, h.reward, 2)
    headroom = log["record_start_headroom"][0][0]
    assert headroom[:4] == ("policy", tokenizer, ["v"], None) and headroom[4] is cfg and headroom[5] is h.run
    saver = log["Checkpointer"][0]
    assert saver[0] == ("/run", 2, 1, None) and saver[1]["layout"] is h.ranks.layout
    assert log["save_policy_models"][0][0] == ("whole", tokenizer, "/run")
    pack = log["pack_online"][0]
    assert pack[0][0] is h.roles and pack[0][3] is h.algorithm and pack[0][4]["order"] is not pack[0][4]["prompts"]
    assert pack[0][6] is h.watches[0] and pack[1] == {"sharded": False, "rollouts": {}}
    assert pack[0][1] is log["update_passes"][0][0][2] and pack[0][2] is log["update_passes"][0][0][3]
    order = torch.Generator().manual_seed(3)
    assert torch.equal(pack[0][4]["order"].get_state(), log["update_passes"][0][0][7].get_state())
    assert pack[0][4]["order"] is log["update_passes"][0][0][7]
    rollout = log["rollout_of_update"][0][0]
    assert rollout[0] is h.ranks and rollout[3] == [[10], [11], [12]] and rollout[5] == h.reward
    assert rollout[6] is tokenizer and rollout[9] == 2 and rollout[4][0].prompt == "p0"
    passes = log["update_passes"][0][0]
    assert passes[0] is h.algorithm and passes[1] is h.roles and passes[6] is cfg and passes[8] == 1
    assert log["error_summary"][0] == ((h.reward, None), {"world": h.world})
    assert log["configure_threads"][0][0] == (2,) and log["seed_everything"][0][0] == (3, False)
    assert order.initial_seed() == 3


def test_the_filters_probe_runs_the_whole_policy_on_the_train_prompts(monkeypatch):
    probes = []
    monkeypatch.setattr(loop, "probe_train_prompts", lambda *a: probes.append(a) or {"kept_indices": [1], "n": 1})
    monkeypatch.setattr(loop, "filtered_rows", lambda cfg, run, resumed, probe: probe())
    h = train(monkeypatch, LoopAlgorithm(group=1), cfg=dict(filter_prompts="both", batch_size=2, total_episodes=4))
    policy, tokenizer, rows, verifier, cfg = probes[0]
    assert policy == "policy" and tokenizer.eos_token_id == 9 and [r.prompt for r in rows] == ["p0", "p1", "p2"]
    assert verifier is None and cfg.filter_prompts == "both"
    assert [r["batch_ids"] for r in h.rollouts] == [[0, 0], [0, 0]]  # the one kept prompt, index 0 of the kept
    assert h.run.summary["prompt_filter"] == {"n": 1}


def test_the_start_up_and_the_time_budget_are_logged(monkeypatch, caplog):
    caplog.set_level("INFO", logger="rlhflab")
    train(monkeypatch, cfg=dict(max_seconds=6, total_episodes=40, eval_every=0))
    messages = [r.getMessage() for r in caplog.records if r.name == "rlhflab"]
    assert "STUB: 10 updates x 4 responses (2 per prompt), mixed precision no ({'layout': 'one'})" in messages
    assert "stub: max_seconds 6 spent at update 1 (episode 4)" in messages


def test_the_filter_evaluations_and_headroom_run_rank_0s_whole_policy_under_generation_autocast(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness

    wholes, autocasts, filtered, schedulers = [], [], [], []
    original = Harness.patch

    def patch(self, mp, *a):
        original(self, mp, *a)
        self.ranks.whole_policy = lambda on_every_rank: wholes.append(on_every_rank) or __import__(
            "contextlib").nullcontext("whole-policy")
        mp.setattr(loop, "precision_from_config", lambda cfg, device, strategy: SimpleNamespace(
            autocast="bf16", mode="no", metrics=dict, describe=dict))
        mp.setattr(loop, "generation_autocast", lambda policy, autocast: autocasts.append((policy, autocast)) or
                   __import__("contextlib").nullcontext())
        mp.setattr(loop, "filtered_rows", lambda cfg, run, resumed, probe: filtered.append(cfg) or
                   {"kept_indices": [0, 1, 2]})
        make_scheduler = loop.make_scheduler
        mp.setattr(loop, "make_scheduler", lambda opt, cfg, total: schedulers.append(opt) or
                   make_scheduler(opt, cfg, total))

    monkeypatch.setattr(Harness, "patch", patch)
    h = train(monkeypatch, cfg=dict(filter_prompts="both", total_episodes=4))
    assert wholes == [False] * 4 and autocasts == [("whole-policy", "bf16")] * 4  # filter, headroom, 2 evaluations
    assert filtered == [h.cfg] and isinstance(schedulers[0], torch.optim.SGD)


def test_a_given_run_folder_is_used_and_the_set_up_sees_the_prompts_and_the_optimiser(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness, Run, loop_config

    cfg = loop_config(filter_prompts="both")
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    verifier, seen, policies = SimpleNamespace(name="v"), {}, []
    monkeypatch.setattr(loop, "open_run", lambda *a: pytest.fail("a run folder was given"))
    monkeypatch.setattr(loop, "build_verifier", lambda c, prompts, given: seen.setdefault("prompts", prompts) and
                        verifier)
    monkeypatch.setattr(loop, "probe_train_prompts", lambda *a: seen.setdefault("probe", a) and {"kept_indices": [0, 1, 2]})
    monkeypatch.setattr(loop, "filtered_rows", lambda cfg, run, resumed, probe: probe())
    made = []
    monkeypatch.setattr(loop, "make_optimizer", lambda groups, c, fused: made.append(
        torch.optim.SGD(groups[0]["params"], lr=0.1)) or made[-1])
    monkeypatch.setattr(h.trained, "prepare", lambda opt, norm: seen.setdefault("prepared", opt) and opt)
    monkeypatch.setattr(loop, "Evaluator", lambda *a: SimpleNamespace(signal=SIGNAL, evaluate=lambda policy, step,
                        episode: policies.append(policy) or {SIGNAL: 1.0, "episode": episode}))
    checked = []
    monkeypatch.setattr(h.world, "check_same", lambda value, what: checked.append((value, what)))
    given = Run("/given")
    result = loop.train_online(cfg, h.algorithm, run=given, reward_fn=h.reward)
    assert result.run_dir == "/given" and given.summary["updates"] == 3 and h.run.summary is None
    assert seen["prompts"].source == "stub" and seen["probe"][3] is verifier and seen["prepared"] is made[0]
    assert checked == [([[10], [11], [12]], "the tokenised train prompts")] and policies == ["policy"] * 3


def test_the_start_headroom_is_probed_with_the_verifier(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness, loop_config

    cfg = loop_config()
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    verifier, probed = SimpleNamespace(name="v"), []
    monkeypatch.setattr(loop, "build_verifier", lambda *a: verifier)
    monkeypatch.setattr(loop, "record_start_headroom", lambda *a: probed.append(a))
    loop.train_online(cfg, h.algorithm, reward_fn=h.reward)
    assert probed[0][3] is verifier and probed[0][4] is cfg and probed[0][2] == ["v"]


def test_each_checkpoint_packs_the_loops_state_at_that_update(monkeypatch):
    h = train(monkeypatch)  # eval_every 2: update 1's checkpoint still holds the first evaluation
    step_1 = h.savers[0].calls[0][2]
    assert step_1.last == h.run.rows[0][1] and step_1.last_eval == {SIGNAL: 0.5, "episode": 0}
    assert step_1.walls == {"setup": 1.0, "loop": 4.0, "evaluation": 2.0, "save": 0.0} and step_1.order == [1, 0, 2, 1]
    assert (step_1.update, step_1.episode, step_1.finished) == (1, 4, False)


def test_a_run_of_no_update_saves_the_starting_policys_numbers(monkeypatch):
    h = train(monkeypatch, cfg=dict(total_episodes=2))  # fewer episodes than one batch: 0 updates
    assert h.rollouts == [] and h.watches[0].finished == [(0, 0.5)]
    assert h.run.summary["validation_reward"] == {"start": 0.5, "end": 0.5} and h.run.summary["updates"] == 0


def test_a_resume_hands_the_checkpoint_its_objects_and_keeps_its_generated_count(monkeypatch):
    unpacked = []
    before = Progress(update=1, episode=4, order=[2], first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75},
                      walls={"loop": 3.0}, generated=10)
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: unpacked.append((a, k)) or before)
    resumed = SimpleNamespace(step=1, state={}, commit=lambda: None)
    h = train(monkeypatch, resumed=resumed)
    args, kwargs = unpacked[0]
    passes = h.passes[0]
    assert args[0] is resumed and args[1] is h.roles and args[6] is h.watches[0] and kwargs == {"trained": None}
    assert isinstance(args[2], torch.optim.SGD) and args[3].get_last_lr() == [0.25] and args[4] is h.algorithm
    assert h.run.summary["episodes_generated"] == 10 + 8
    walls = h.run.summary["wall_time_s"]  # the checkpoint had no evaluation or save seconds: 0 from there
    assert (walls["loop"], walls["evaluation"], walls["save"]) == (3.0 + 8.0, 2.0, 3.0)
    assert passes["update"] == 2


def test_a_one_answer_checkpoint_in_flight_is_drawn_again_whole(monkeypatch):
    before = Progress(update=1, episode=2, order=[2], first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75},
                      in_flight=[[2, [1, 0], 1]])
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: before)
    h = train(monkeypatch, LoopAlgorithm(group=1), resumed=SimpleNamespace(step=1, state={}, commit=lambda: None),
              cfg=dict(batch_size=2, total_episodes=4))
    assert [r["batch_ids"] for r in h.rollouts] == [[1, 0]]


def test_a_sharded_checkpoint_writes_the_optimisers_shards(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness

    log = []
    original = Harness.patch

    def patch(self, mp, *a):
        original(self, mp, *a)
        self.ranks.trained, self.ranks.sharded = Whole(log), True
        self.ranks.trained.save_sharded = lambda optimizer, folder: log.append((optimizer, folder))

    monkeypatch.setattr(Harness, "patch", patch)
    h = train(monkeypatch)
    h.savers[0].kwargs["write_shards"]("/f")
    assert isinstance(log[-1][0], torch.optim.SGD) and log[-1][1] == "/f"


def test_the_asynchronous_generator_is_handed_the_runs_objects(monkeypatch):
    opened = []

    @contextmanager
    def async_rollouts(*a):
        opened.append(a)
        yield None

    monkeypatch.setattr(loop, "async_rollouts", async_rollouts)
    h = train(monkeypatch)
    cfg, roles, tokenizer, settings, draws, prompt_ids, start, num_updates, in_flight, kept, world = opened[0]
    assert cfg is h.cfg and roles is h.roles and tokenizer.eos_token_id == 9 and settings.max_new_tokens == 3
    assert prompt_ids == [[10], [11], [12]] and (start, num_updates, in_flight, kept) == (0, 3, [], {})
    assert world is h.world and draws.num_rows == 3


def test_each_refill_round_is_sampled_like_the_first_with_its_own_round_number(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness

    calls, firsts = [], []
    real = Harness.rollout_of_update
    monkeypatch.setattr(Harness, "rollout_of_update", lambda self, *a: calls.append(a) or real(self, *a))

    def refill(first, sample_round, groups, group, max_rounds, pad_id):
        assert type(groups) is int
        firsts.append(first)
        return sample_round(3), {}

    monkeypatch.setattr(loop, "refill", refill)
    h = train(monkeypatch, cfg=dict(dynamic_sampling=True, total_episodes=4))
    first, again = calls
    assert again[0] is first[0] is h.ranks and again[3] == first[3] == [[10], [11], [12]]
    assert [r.prompt for r in again[4]] == ["p0", "p1", "p2"] and again[5:9] == first[5:9]
    assert again[9:] == (2, False, None, 2, 3) and first[9:] == (2, True, None, 2)
    rollout, scores, valid, _ = real(h, *first)
    assert torch.equal(firsts[0].rollout.response_ids, rollout.response_ids)
    assert firsts[0].scores.tolist() == scores.tolist() and firsts[0].valid.tolist() == valid.tolist()


def test_an_async_rollout_hands_on_what_the_generator_sampled(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness

    ahead = Ahead({1: 0}, lambda u: [0, 0, 1, 1])
    sampled = []
    real = Harness.rollout_of_update
    monkeypatch.setattr(Harness, "rollout_of_update", lambda self, *a: sampled.append(a[11]) or real(self, *a))

    @contextmanager
    def async_rollouts(*a):
        yield ahead

    monkeypatch.setattr(loop, "async_rollouts", async_rollouts)
    train(monkeypatch, cfg=dict(async_generation=True, total_episodes=4))
    assert sampled[0][0].seconds == {"generation": 99.0} and sampled[0][1] == 0.5


@pytest.mark.parametrize("bad", ["advantages", "returns"])
def test_only_the_rows_with_non_finite_advantages_or_returns_are_named(monkeypatch, bad):
    class OneRow(LoopAlgorithm):
        def advantages(self, batch):
            adv = super().advantages(batch)
            adv.returns = adv.advantages.clone()
            getattr(adv, bad)[2, 1] = float("nan")
            return adv

    with pytest.raises(FloatingPointError, match=r"non-finite advantages \(rollout rows \[2\], train prompts"):
        train(monkeypatch, OneRow())


def test_the_rollouts_forward_is_dropped_from_a_batch_with_an_invalid_row(monkeypatch):
    import dataclasses

    from tests.trainers.test_online_loop_unit import Harness

    real = Harness.rollout_of_update

    def with_forward(self, *a):
        rollout, scores, valid, seconds = real(self, *a)
        return dataclasses.replace(rollout, policy_forward="forward"), scores, valid, seconds

    monkeypatch.setattr(Harness, "rollout_of_update", with_forward)
    h = train(monkeypatch, valid=lambda update: torch.tensor([True, True, update != 2, True]))
    assert [p["batch"].rollout.policy_forward for p in h.passes] == ["forward", None, "forward"]
    assert h.passes[1]["batch"].rollout.response_ids.shape == (4, 3)


def test_the_generator_gets_the_updated_roles(monkeypatch):
    ahead = Ahead({1: 0}, lambda u: [0, 0, 1, 1])
    pushed = []
    ahead.after_update = lambda roles, update: pushed.append((roles, update))

    @contextmanager
    def async_rollouts(*a):
        yield ahead

    monkeypatch.setattr(loop, "async_rollouts", async_rollouts)
    h = train(monkeypatch, cfg=dict(async_generation=True, total_episodes=4))
    assert pushed == [(h.roles, 1)]


def test_the_summary_rounds_seconds_to_the_millisecond_and_names_the_given_reward(monkeypatch):
    from tests.trainers.test_online_loop_unit import Harness, loop_config

    cfg = loop_config(reward="auto", reward_model="", reward_fn="")
    h = Harness(monkeypatch, cfg, LoopAlgorithm(), stop_at=2)
    monkeypatch.setattr(h, "tick", lambda: setattr(h, "clock", h.clock + 0.5004) or h.clock)
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=h.tick))
    verifier, stops, errors = SimpleNamespace(name="v"), [], []
    monkeypatch.setattr(loop, "build_verifier", lambda *a: verifier)
    monkeypatch.setattr(loop.rewards, "error_summary", lambda fn, v, world: errors.append(v) or {})
    watch_stop = h.watches.append
    monkeypatch.setattr(loop, "RunWatch", lambda *a: watch_stop(__import__("online_stubs").LoopWatch(*a)) or
                        setattr(h.watches[-1], "should_stop", lambda step, episode: stops.append(episode)) or
                        h.watches[-1])
    given = loop.Given(reward_functions=[(lambda p, c, **k: [0.0] * len(c), 1.0)])
    loop.train_online(cfg, h.algorithm, reward_fn=h.reward, given=given)
    walls = h.run.summary["wall_time_s"]
    assert walls["setup"] == 0.5 and walls["total"] == round(26 * 0.5004, 3) == 13.01
    assert h.run.summary["reward"] == "functions" and errors == [verifier] and stops == [4, 8, 12]
