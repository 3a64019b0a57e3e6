"""train_online's loop in-process with stand-ins for every collaborator (issue 36): how many rollouts and updates
run, what the algorithm and the passes are handed, what is logged, evaluated and checkpointed, early stops by the
monitor and the time budget, a resume, and summary.json's numbers. No model is loaded; a clock ticks 1 s a reading."""

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

from online_stubs import LoopAlgorithm, LoopSaver, LoopWatch, Tokenizer, rollout_of
from rlhflab.trainers.online import loop
from rlhflab.trainers.online.state import Progress
from stage_stubs import RecordingBar


class Bar(RecordingBar):
    def set_postfix(self, fields):  # the online loop hands a dict
        self.postfixes.append(fields)

SIGNAL = "val/reward"


def loop_config(**overrides):
    base = dict(device="cpu", seed=3, deterministic=False, parallel_strategy="auto", logits_chunk_mib=7,
                mmap_threshold_mib=5, tokenizer=None, model="m", trust_remote_code=False, calibration_prompts=2,
                filter_prompts="none", total_episodes=12, batch_size=4, num_mini_batches=1, response_length=3,
                temperature=0.7, reuse_rollout_forward=True, gradient_accumulation_steps=1, keep_best=False,
                dynamic_sampling=False, async_generation=False, nonfinite="stop", eval_every=2, max_seconds=0,
                progress=True, reward_fn="", sampler_correction="none", sampler_correction_min=0.5,
                sampler_correction_max=2.0, generation_backend="lean", save_every=2, keep_last_n=1, threads=0,
                missing_eos_penalty=0.0, overlong_buffer_len=0, overlong_penalty_factor=0.0, max_refill_rounds=0, max_grad_norm=0.75, reward="model")
    return SimpleNamespace(**{**base, **overrides})


class World:
    device, distributed, is_main = torch.device("cpu"), False, True

    def __init__(self):
        self.anys, self.checked = [], []

    def any(self, flag):
        self.anys.append(bool(flag))
        return bool(flag)

    def from_main(self, compute):
        return compute()

    def check_same(self, value, what):
        self.checked.append(what)

    def threads(self, n):
        return n or 2

    def describe(self):
        return {"world_size": 1}


class Run:
    def __init__(self, path="/run"):
        self.path, self.rows, self.summary, self.closed = path, [], None, False

    def log(self, row, step):
        self.rows.append((step, dict(row)))

    def update_summary(self, **fields):
        self.summary = fields
        return fields

    def close(self):
        self.closed = True


class Harness:
    """Every collaborator of train_online replaced in `loop`, each call recorded."""

    def __init__(self, monkeypatch, cfg, algorithm, scores=None, valid=None, stop_at=None, monitored=None,
                 resumed=None):
        self.cfg, self.algorithm, self.calls, self.clock = cfg, algorithm, [], 0.0
        self.world, self.run, self.evals, self.rollouts, self.passes = World(), Run(), [], [], []
        self.scores = scores or (lambda update: torch.tensor([1.0, 2.0, 3.0, 6.0]) * update)
        self.valid = valid or (lambda update: torch.ones(4, dtype=torch.bool))
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.roles = SimpleNamespace(policy="policy", trainable_parameters=lambda: [self.weight], precision=None)
        self.trained = SimpleNamespace(prepare=lambda opt, norm: self.calls.append(("prepare", norm)) or opt,
                                       whole_parameters=lambda enabled: nullcontext())
        self.ranks = SimpleNamespace(world=self.world, roles=self.roles, device="cpu", trained=self.trained,
                                     sharded=False, layout=SimpleNamespace(describe=lambda: {"layout": "one"}),
                                     whole_policy=lambda on_every_rank: nullcontext("policy"),
                                     whole_roles=lambda: nullcontext("whole"))
        self.savers, self.watches = [], []
        self.patch(monkeypatch, stop_at, monitored, resumed)

    def tick(self):
        self.clock += 1.0
        return self.clock

    def patch(self, mp, stop_at, monitored, resumed):
        note = lambda name: (lambda *a, **k: self.calls.append((name, a, k)))  # noqa: E731
        mp.setattr(loop, "time", SimpleNamespace(time=self.tick))
        mp.setattr(loop.parallel, "init_world", lambda device: self.world)
        mp.setattr(loop.parallel, "resolve_strategy", lambda s, w: "none")
        for name in ("check_online_config", "check_world", "check_async", "check_dynamic", "configure_threads",
                     "configure_allocator", "seed_everything", "check_prompt_filter", "record_start_headroom"):
            mp.setattr(loop, name, note(name))
        mp.setattr(loop.models, "configure_logits_chunks", note("logits_chunks"))
        mp.setattr(loop, "generation_autocast", lambda policy, autocast: nullcontext())
        mp.setattr(loop, "precision_from_config", lambda cfg, device, strategy: SimpleNamespace(
            autocast=None, mode="no", metrics=lambda: {"amp/scale": 1.0}, describe=lambda: {"mode": "no"}))
        mp.setattr(loop.models, "load_tokenizer", lambda *a, **k: Tokenizer())
        prompts = SimpleNamespace(train=[SimpleNamespace(prompt=f"p{i}") for i in range(3)], validation=["v"],
                                  source="stub")
        mp.setattr(loop.sources, "prompt_splits", lambda cfg, tok: prompts)
        mp.setattr(loop, "build_verifier", lambda cfg, prompts, given: None)
        mp.setattr(loop, "build_roles", lambda cfg, critic, precision: (self.roles, Tokenizer()))
        mp.setattr(loop, "build_reward", lambda *a: (self.reward, {"norm": 1}))
        mp.setattr(loop.data, "encode_prompts", lambda tok, texts: [[10 + i] for i in range(len(texts))])
        mp.setattr(loop, "wrap_roles", lambda roles, cfg, world: self.ranks)
        mp.setattr(loop, "open_run", lambda cfg, name, layout, callbacks: (self.run, resumed))
        mp.setattr(loop, "make_optimizer", lambda groups, cfg, fused: self.calls.append(("optimizer", groups, fused))
                   or torch.optim.SGD(groups[0]["params"], lr=0.1))
        mp.setattr(loop, "make_scheduler", lambda opt, cfg, total: self.calls.append(("scheduler", total)) or
                   SimpleNamespace(get_last_lr=lambda: [0.25]))
        evaluator = SimpleNamespace(signal=SIGNAL, evaluate=self.evaluate)
        mp.setattr(loop, "Evaluator", lambda *a: evaluator)
        mp.setattr(loop, "RunWatch", lambda *a: self.watches.append(LoopWatch(*a, stop_at=stop_at,
                                                                                 monitored=monitored)) or self.watches[-1])
        mp.setattr(loop, "Checkpointer", lambda *a, **k: self.savers.append(LoopSaver(*a, **k)) or self.savers[-1])
        mp.setattr(loop, "pack_online", lambda roles, opt, sch, alg, gens, progress, watch, sharded, rollouts:
                   progress)
        mp.setattr(loop, "rollout_of_update", self.rollout_of_update)
        mp.setattr(loop, "update_passes", self.update_passes)
        mp.setattr(loop, "save_policy_models", lambda whole, tok, path: f"{path}/policy")
        mp.setattr(loop.rewards, "error_summary", lambda fn, verifier, world: {"errors": 0})
        self.bars = []
        mp.setattr(loop, "tqdm", lambda steps, **shown: self.bars.append(Bar(steps, **shown)) or self.bars[-1])

    def reward(self, *a):
        raise AssertionError("the loop scores through rollout_of_update")

    def evaluate(self, policy, step, episode):
        self.evals.append((step, episode))
        return {SIGNAL: 0.5 + step, "episode": episode}

    def rollout_of_update(self, ranks, update, batch_ids, prompt_ids, rows, reward_fn, tokenizer, settings, cfg,
                          group, keep_graph, sampled=None, steps_per_update=1, sampling_round=0):
        self.rollouts.append(dict(update=update, batch_ids=list(batch_ids), keep_graph=keep_graph, group=group,
                                  steps=steps_per_update, settings=settings, reward=reward_fn))
        rollout = rollout_of([[5, 9, 0], [6, 6, 9], [7, 0, 0], [8, 8, 8]], [2, 3, 1, 3], [True, True, False, False],
                             logprobs=[[-1.0, -1.0, 0.0]] * 4, ref_logprobs=[[-1.5, -1.0, 0.0]] * 4)
        return rollout, self.scores(update), self.valid(update), 0.5

    def update_passes(self, algorithm, roles, optimizer, scheduler, batch, adv, cfg, generator, update, batch_ids,
                      trained):
        self.passes.append(dict(update=update, batch=batch, adv=adv, batch_ids=list(batch_ids), trained=trained))
        return {"skipped": 0, "loss": 0.125 * update}


def train(monkeypatch, algorithm=None, **kwargs):
    cfg = loop_config(**kwargs.pop("cfg", {}))
    algorithm = algorithm or LoopAlgorithm()
    h = Harness(monkeypatch, cfg, algorithm, **kwargs)
    h.result = loop.train_online(cfg, algorithm, given=kwargs.get("given", loop.NOTHING))
    return h


def test_three_updates_run_their_rollouts_passes_evaluations_and_checkpoints(monkeypatch):
    h = train(monkeypatch)  # 12 episodes / batch 4: 3 updates; group 2, so 2 prompts of the 3 a batch
    assert [r["update"] for r in h.rollouts] == [1, 2, 3] == [p["update"] for p in h.passes]
    assert all(len(r["batch_ids"]) == 4 and r["batch_ids"][0::2] == r["batch_ids"][1::2] for r in h.rollouts)
    assert sorted(h.rollouts[0]["batch_ids"][0::2] + h.rollouts[1]["batch_ids"][:2:2]) == [0, 1, 2]
    assert [r["steps"] for r in h.rollouts] == [2, 2, 2] and h.rollouts[0]["group"] == 2
    assert h.rollouts[0]["keep_graph"] is True and h.rollouts[0]["reward"] == h.reward
    settings = h.rollouts[0]["settings"]
    assert (settings.max_new_tokens, settings.do_sample, settings.temperature, settings.top_k, settings.top_p) == (
        3, True, 0.7, 0, 1.0)
    assert ("scheduler", 3 * 2 * 1) in h.calls and ("prepare", 0.75) in h.calls
    assert h.evals == [(0, 0), (2, 8), (3, 12)]  # start, eval_every 2, the last update
    assert [(c[0], c[1]) for c in h.savers[0].calls] == [("step", 1), ("step", 2), ("step", 3), ("finish", 3)]
    end = h.savers[0].calls[-1][2]
    assert (end.update, end.episode, end.finished, end.skipped, end.generated) == (3, 12, True, 0, 12)
    assert end.first == {SIGNAL: 0.5, "episode": 0} and end.last_eval == {SIGNAL: 3.5, "episode": 12}
    assert h.savers[0].args == ("/run", 2, 1, None) and h.savers[0].kwargs["write_shards"] is None
    assert h.algorithm.after == h.algorithm.batches and len(h.algorithm.batches) == 3
    assert h.run.closed and h.result.model_dir == "/run/policy"


ROW_1 = {"objective/scores": 3.0, "objective/kl": 0.5, "objective/entropy": 0.0, "val/num_eos_tokens": 2,
         "response/length_mean": 2.25, "reward/invalid_rows": 0, "response/capped_share": 0.5,
         "response/distinct_2": 0.8, "response/duplicate_share_batch": 0.0, "response/duplicate_share_group": 0.0,
         "adv/mean": 3.0, "loss/stub": 0.125, "lr": 0.25, "episode": 4,
         "eps": 4 / 3,  # 4 answers over t3 - t0: three clock readings
         "tokens_per_s": 9.0,  # 2 + 3 + 1 + 3 tokens over the 1 s of generation
         "time/generation": 1.0, "time/scoring": 2.0,  # forward 0.5 + (t2 - t1): 1 s and the 0.5 s of scoring
         "time/training": 1.0, "amp/scale": 1.0}


def test_each_update_logs_its_row_and_the_watch_sees_rows_and_evaluations(monkeypatch):
    h = train(monkeypatch)
    assert [s for s, _ in h.run.rows] == [1, 2, 3]
    assert h.run.rows[0][1] == ROW_1
    assert h.run.rows[2][1] == {**ROW_1, "objective/scores": 9.0, "adv/mean": 9.0, "loss/stub": 0.375, "episode": 12}
    assert [(s, row.get("episode")) for s, row in h.watches[0].rows] == [(0, 0), (1, 4), (2, 8), (2, 8), (3, 12),
                                                                         (3, 12)]
    assert h.watches[0].rows[3][1] == {SIGNAL: 2.5, "episode": 8} and h.watches[0].finished == [(3, 3.5)]
    assert (h.watches[0].keep_best, h.watches[0].signal) == (False, SIGNAL)
    assert h.bars[0].steps == [1, 2, 3] and h.bars[0].shown == {"desc": "stub", "unit": "update", "disable": False}
    assert h.bars[0].postfixes == [{"reward": "2.50", "kl": "0.50", "score": "6.00"},
                                   {"reward": "3.50", "kl": "0.50", "score": "9.00"}]


def test_the_passes_get_the_scored_batch_and_the_algorithms_advantages(monkeypatch):
    h = train(monkeypatch, valid=lambda update: torch.tensor([True, True, update != 2, True]))
    first, second = h.passes[0], h.passes[1]
    assert first["batch"] is h.algorithm.batches[0] and first["adv"].advantages[3, 0] == 6.0
    assert first["batch_ids"] == h.rollouts[0]["batch_ids"] and first["trained"] is None
    batch = second["batch"]  # update 2: row 2 invalid, so the rollout's forward is not reused
    assert batch.valid.tolist() == [True, True, False, True] and batch.group_size == 2
    assert batch.mask.tolist() == [[True, True, False], [True, True, True], [False] * 3, [True, True, True]]
    assert batch.kl.tolist() == [[0.5, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0] * 3, [0.5, 0.0, 0.0]]
    assert batch.scores.tolist() == [2.0, 4.0, 6.0, 12.0] and batch.sampler_weights is None
    assert batch.rollout.policy_forward is None and h.algorithm.batches[1].rollout.policy_forward is None
    assert h.run.rows[1][1]["reward/invalid_rows"] == 1 and h.run.rows[1][1]["objective/scores"] == 6.0
    assert h.run.summary["wall_time_s"] == {"setup": 1.0, "loop": 12.0, "evaluation": 4.0, "save": 4.0,
                                            "total": 26.0}


def test_a_batch_the_reward_failed_on_entirely_stops_the_run(monkeypatch):
    with pytest.raises(FloatingPointError, match="^update 2: the reward source failed on every row of the batch$"):
        train(monkeypatch, valid=lambda update: torch.tensor([update != 2] * 4))


def test_non_finite_advantages_stop_the_run_naming_the_rows(monkeypatch):
    h_ids = []
    monkeypatch.setattr(Harness, "update_passes", lambda self, *a: {"skipped": 0})
    rollout_of_update = Harness.rollout_of_update
    monkeypatch.setattr(Harness, "rollout_of_update", lambda self, ranks, update, ids, *a: h_ids.append(ids) or
                        rollout_of_update(self, ranks, update, ids, *a))
    with pytest.raises(FloatingPointError) as err:
        train(monkeypatch, LoopAlgorithm(bad_update=2))
    assert str(err.value) == ("STUB update 2: non-finite advantages (rollout rows [0], train prompts "
                              f"[{h_ids[1][0]}]); no checkpoint written after it")


@pytest.mark.parametrize("returns", [False, True])
def test_non_finite_advantages_skip_the_update_under_nonfinite_skip(monkeypatch, returns):
    h = train(monkeypatch, LoopAlgorithm(bad_update=2, returns=returns), cfg=dict(nonfinite="skip",
                                                                                   num_mini_batches=3))
    assert [p["update"] for p in h.passes] == [1, 3] and len(h.algorithm.after) == 3
    assert [row["nonfinite/skipped_updates"] for _, row in h.run.rows] == [0, 6, 6]  # 2 epochs x 3 minibatches
    assert h.run.rows[1][1]["loss/stub"] == -1.0 and h.run.summary["nonfinite"] == {"mode": "skip",
                                                                                     "skipped_updates": 6}
    assert h.savers[0].calls[-1][2].skipped == 6


def test_non_finite_returns_alone_stop_the_run_too(monkeypatch):
    class Returns(LoopAlgorithm):
        def advantages(self, batch):
            adv = super().advantages(batch)
            adv.returns = torch.full_like(adv.advantages, float("inf"))
            return adv

    with pytest.raises(FloatingPointError, match="non-finite advantages"):
        train(monkeypatch, Returns(returns=True))


@pytest.mark.parametrize("change", [dict(reuse_rollout_forward=False), dict(num_mini_batches=2),
                                    dict(gradient_accumulation_steps=2), "entropy"])
def test_the_rollouts_forward_is_kept_only_for_one_micro_batch_without_an_entropy_bonus(monkeypatch, change):
    algorithm = LoopAlgorithm()
    if change == "entropy":
        algorithm.entropy_in_loss, change = True, {}
    h = train(monkeypatch, algorithm, cfg=change)
    assert [r["keep_graph"] for r in h.rollouts] == [False] * 3
    assert ("scheduler", 3 * 2 * change.get("num_mini_batches", 1)) in h.calls
    assert h.rollouts[0]["steps"] == 2 * change.get("num_mini_batches", 1)


def test_the_set_up_checks_and_settings_are_handed_the_runs_numbers(monkeypatch):
    h = train(monkeypatch)
    named = {c[0]: c[1] for c in h.calls if c[0] not in ("optimizer", "prepare", "scheduler")}
    assert named["check_online_config"][1:] == (2, 2) and named["check_world"][1:3] == (2, False)
    assert named["check_world"][3] is h.world and named["check_async"][1:] == ("none", True)
    assert named["check_dynamic"][1:] == ("stub", 2, False) and named["configure_threads"] == (2,)
    assert named["logits_chunks"] == (7,) and named["configure_allocator"] == (5,) and named["seed_everything"] == (3, False)
    assert named["check_prompt_filter"][1:] == (False,) and h.world.checked == ["the tokenised train prompts"]
    assert named["record_start_headroom"][0] == "policy" and named["record_start_headroom"][2:4] == (["v"], None)
    assert named["record_start_headroom"][5] is h.run
    optimizer = [c for c in h.calls if c[0] == "optimizer"][0]
    assert optimizer[1][0]["params"] == [h.weight] and optimizer[2] is True


def test_the_summary_holds_the_runs_numbers(monkeypatch):
    h = train(monkeypatch)
    s = h.run.summary
    assert (s["stage"], s["reward"], s["reward_functions"], s["reward_normalisation"]) == ("stub", "model", [],
                                                                                         {"norm": 1})
    assert (s["prompts"], s["samples_per_prompt"], s["updates"], s["episodes"], s["episodes_generated"]) == (
        "stub", 2, 3, 12, 12)
    assert s["held_out"]["metric"] == SIGNAL and s["held_out"]["verifier"] is None
    assert s["validation_reward"] == {"start": 0.5, "end": 3.5} and s["final_is"] == "last update"
    assert s["final"] == {"objective/kl": 0.5, "objective/scores": 9.0, "objective/rlhf_reward": None, "eps": 4 / 3,
                          "response/length_mean": 2.25, "kl_coef": None}
    assert (s["model_dir"], s["budget_stop"], s["prompt_filter"]) == ("/run/policy", None, None)
    assert s["nonfinite"] == {"mode": "stop", "skipped_updates": 0}
    assert s["parallel"] == {"layout": "one", "world_size": 1} and s["precision"] == {"mode": "no"}
    assert s["reward_errors"] == {"errors": 0}
    assert h.result.run_dir == "/run" and h.result.summary is s


def test_a_given_reward_function_and_the_configured_ones_are_named(monkeypatch):
    def exact(prompts, completions, **kw):
        return [1.0] * len(completions)

    cfg = loop_config(reward_fn="length, ,format")
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    given = loop.Given(reward_functions=[(exact, 1.0)])
    loop.train_online(cfg, h.algorithm, reward_fn=h.reward, given=given)
    assert h.run.summary["reward_functions"] == ["length", "format", loop.rewards.function_name(exact)]
    assert h.run.summary["reward_normalisation"] == {}  # the reward handed in is not built


def test_the_monitor_stops_the_run_before_that_updates_checkpoint(monkeypatch):
    h = train(monkeypatch, stop_at=2, cfg=dict(total_episodes=20))
    assert [p["update"] for p in h.passes] == [1, 2] and h.evals == [(0, 0), (2, 8), ]
    assert [(c[0], c[1]) for c in h.savers[0].calls] == [("step", 1), ("finish", 2)]
    end = h.savers[0].calls[-1][2]
    assert (end.update, end.episode, end.finished, end.budget_stop) == (2, 8, True, None)
    assert h.watches[0].finished == [(2, 2.5)] and h.run.summary["updates"] == 2
    assert h.run.summary["budget_stop"] is None and h.world.anys[:2] == [False, False]


@pytest.mark.parametrize("max_seconds, updates", [(6, 1), (7, 2), (12, 2), (13, 3)])
def test_the_time_budget_stops_the_run_and_evaluates_the_last_policy(monkeypatch, max_seconds, updates):
    # the cycle's seconds when update n is checked: the first evaluation's 1, then 4 (loop) + 1 (evaluation) per
    # update, and 1 (save) per update before it: 6 after update 1, 12 after 2, 18 after 3
    h = train(monkeypatch, cfg=dict(max_seconds=max_seconds, total_episodes=40, eval_every=2))
    episode = 4 * updates
    assert [p["update"] for p in h.passes] == list(range(1, updates + 1))
    assert h.run.summary["budget_stop"] == {"step": updates, "episode": episode, "max_seconds": max_seconds}
    assert h.evals == {1: [(0, 0), (1, 4)], 2: [(0, 0), (2, 8)], 3: [(0, 0), (2, 8), (3, 12)]}[updates]
    assert h.watches[0].rows[-1] == (updates, {SIGNAL: 0.5 + updates, "episode": episode})
    assert [(c[0], c[1]) for c in h.savers[0].calls] == [("step", u) for u in range(1, updates)] + [("finish", updates)]
    assert h.savers[0].calls[-1][2].budget_stop == {"step": updates, "episode": episode, "max_seconds": max_seconds}
    assert h.run.summary["validation_reward"]["end"] == 0.5 + updates


def test_the_time_budget_adds_the_last_evaluations_seconds(monkeypatch):
    h = train(monkeypatch, cfg=dict(max_seconds=6, total_episodes=40, eval_every=0))
    assert h.evals == [(0, 0), (1, 4)] and h.run.summary["updates"] == 1
    # evaluation: 1 (first) + 1 (update 1's t5 - t4) + 1 (the budget's evaluation: t5 to the reading after it)
    assert h.run.summary["wall_time_s"] == {"setup": 1.0, "loop": 4.0, "evaluation": 3.0, "save": 1.0, "total": 12.0}


def test_a_resumed_run_continues_after_the_checkpoints_update(monkeypatch):
    committed = []
    resumed = SimpleNamespace(step=1, state={}, commit=lambda: committed.append(True))
    before = Progress(update=1, episode=4, order=[2], first={SIGNAL: 0.25, "episode": 0},
                      last_eval={SIGNAL: 0.75, "episode": 0}, last={"objective/kl": 0.1}, skipped=2,
                      walls={"loop": 3.0, "evaluation": 2.0, "save": 1.0, "setup": 50.0}, generated=4)
    unpacked = []
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: unpacked.append((a, k)) or before)
    h = train(monkeypatch, resumed=resumed)
    assert committed == [True] and unpacked[0][1] == {"trained": None} and unpacked[0][0][1] is h.roles
    assert not [c for c in h.calls if c[0] == "record_start_headroom"]
    assert [r["update"] for r in h.rollouts] == [2, 3] and h.rollouts[0]["batch_ids"][:2] == [2, 2]
    assert h.evals == [(2, 8), (3, 12)] and h.savers[0].args[3] == 1 and h.bars[0].steps == [2, 3]
    end = h.savers[0].calls[-1][2]
    assert (end.update, end.episode, end.skipped, end.generated, end.first) == (3, 12, 2, 12, before.first)
    walls = h.run.summary["wall_time_s"]
    assert (walls["loop"], walls["evaluation"], walls["save"], walls["setup"]) == (11.0, 4.0, 4.0, 1.0)
    assert h.run.summary["validation_reward"]["start"] == 0.25


def test_a_finished_checkpoint_runs_no_update(monkeypatch):
    resumed = SimpleNamespace(step=3, state={}, commit=lambda: None)
    done = Progress(update=3, episode=12, first={SIGNAL: 0.25}, last_eval={SIGNAL: 0.75, "episode": 12},
                    last={"objective/kl": 0.1}, finished=True, generated=12)
    monkeypatch.setattr(loop, "unpack_online", lambda *a, **k: done)
    h = train(monkeypatch, resumed=resumed, cfg=dict(total_episodes=20))
    assert h.rollouts == [] and h.bars[0].steps == [] and h.savers[0].calls[0][:2] == ("finish", 3)
    assert h.run.summary["updates"] == 3 and h.run.summary["final"]["objective/kl"] == 0.1


def test_a_restored_best_policy_gives_the_summarys_end_numbers(monkeypatch):
    best = {"step": 2, SIGNAL: 2.5, "restored": True, "update_row": {"objective/kl": 0.3, "eps": 2.0}}
    h = train(monkeypatch, monitored={"best": best, "stop_reason": None}, cfg=dict(keep_best=True))
    s = h.run.summary
    assert s["validation_reward"] == {"start": 0.5, "end": 2.5} and s["final_is"] == "restored best update"
    assert s["final"]["objective/kl"] == 0.3 and s["best"] == {"step": 2, SIGNAL: 2.5, "restored": True}
    assert s["stop_reason"] is None and h.watches[0].keep_best is True


def test_a_monitor_watching_another_signal_is_refused(monkeypatch):
    cfg = loop_config()
    h = Harness(monkeypatch, cfg, LoopAlgorithm())
    with pytest.raises(ValueError, match=f"^the monitor watches val/pass_rate but this run's held-out signal is "
                                         f"{SIGNAL}$"):
        loop.train_online(cfg, h.algorithm, monitor=SimpleNamespace(signal="val/pass_rate"))
    monitor = SimpleNamespace(signal=SIGNAL)
    loop.train_online(cfg, h.algorithm, monitor=monitor)


@pytest.mark.parametrize("progress, main", [(False, True), (True, False)])
def test_the_progress_bar_shows_on_the_main_process_when_asked(monkeypatch, progress, main):
    monkeypatch.setattr(World, "is_main", main)
    h = train(monkeypatch, cfg=dict(progress=progress))
    assert h.bars[0].shown["disable"] is True


def test_the_prompts_are_drawn_in_shuffled_passes_of_the_train_set(monkeypatch):
    h = train(monkeypatch, LoopAlgorithm(group=1), cfg=dict(total_episodes=12, batch_size=2))
    drawn = [i for r in h.rollouts for i in r["batch_ids"]]
    order = torch.Generator().manual_seed(loop.stream_seed("rlhflab-prompt-order", 3))
    expected = [i for _ in range(4) for i in torch.randperm(3, generator=order).tolist()]
    assert drawn == expected[:12] and len(h.rollouts) == 6 and h.rollouts[0]["group"] == 1
