"""`reward.train` with stand-ins for the backbone, the pairs and the held-out scoring (issue 36's mutation run of
trainers/reward.py): the epochs' shuffled batches, what is logged and checkpointed, weight averaging, the summary,
a resume that ends where the uninterrupted run ends, and the settings it refuses."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

from rlhflab.config import RMConfig
from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers import reward
from stage_stubs import recorded_run_setup

PAD = 0
# five pairs: the score of a sequence is the sum of its tokens' weights (vocabulary of 6)
PAIRS = [reward.TokenizedPair([1, 2], [1, 3], "f", "v"), reward.TokenizedPair([2, 4], [2, 5], "f", "v"),
         reward.TokenizedPair([3], [4, 4], "g", "w"), reward.TokenizedPair([5, 1], [5], "g", "w"),
         reward.TokenizedPair([4, 2], [1, 1], "f", "v")]
HELD_OUT = {"train": {"accuracy": 0.8, "margin": 0.5}, "validation": {"accuracy": 0.6, "margin": 0.25}}


class Scorer(torch.nn.Module):
    """A reward model stand-in: one weight per token, read by `linear_pair_scores`."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 6))
        self.config = PretrainedConfig()


def linear_pair_scores(model, batch, pad_id, chunks, shared_prefix):
    chosen = torch.stack([model.weights[p.chosen].sum() for p in batch])
    rejected = torch.stack([model.weights[p.rejected].sum() for p in batch])
    return chosen, rejected


def stand_in_run(monkeypatch, tmp_path, folder="run", **fields):
    calls, tokenizer, ticks = [], SimpleNamespace(pad_token_id=PAD), iter(range(40, 10_000))
    model = Scorer()
    recorded_run_setup(monkeypatch, reward, calls, tokenizer, clock=lambda: 0.5 * next(ticks))  # 0.5 s a reading
    monkeypatch.setattr(reward.models, "build_reward_model", lambda *a, **k: calls.append(("build", a, k)) or model)
    monkeypatch.setattr(reward, "load_pairs", lambda *a: calls.append(("pairs", *a)) or
                        {"train": list(PAIRS), "validation": PAIRS[:2]})
    monkeypatch.setattr(reward, "pair_scores", linear_pair_scores)
    monkeypatch.setattr(reward, "held_out_and_save", lambda *a: calls.append(("held_out", *a)) or HELD_OUT)
    step = reward.train_step
    monkeypatch.setattr(reward, "train_step", lambda *a: calls.append(("step", a[3], model.weights.detach().clone()))
                        or step(*a))
    cfg = RMConfig(**{"model": "rm-backbone", "output_dir": str(tmp_path / folder), "batch_size": 2, "num_epochs": 2,
                      "learning_rate": 0.1, "warmup_steps": 0, "lr_schedule": "linear", "log_every": 2,
                      "save_every": 3, "threads": 1, "seed": 5, "progress": False, "device": "cpu",
                      "center_rewards_coef": 0.0, **fields})
    return cfg, calls, model


def shuffled_batches(seed: int, epochs: int, batch_size: int) -> list[list[int]]:
    """The run's batches, naively: one shuffle of the pairs per epoch from random.Random(seed), cut in order."""
    rng, batches = random.Random(seed), []
    for _ in range(epochs):
        order = list(range(len(PAIRS)))
        rng.shuffle(order)
        batches += [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    return batches


def test_a_reward_model_run_steps_on_each_epoch_s_shuffle_logs_checkpoints_and_summarises(monkeypatch, tmp_path):
    cfg, calls, model = stand_in_run(monkeypatch, tmp_path)
    result = reward.train(cfg)
    steps = [c for c in calls if c[0] == "step"]
    assert [c[1] for c in steps] == [[PAIRS[i] for i in ids] for ids in shuffled_batches(5, 2, 2)]  # 3 steps an epoch
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss/rm" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]  # every log_every and the last
    assert [r["lr"] for r in logged] == pytest.approx([0.1 * 4 / 6, 0.1 * 2 / 6, 0.0])  # linear decay over 6 steps
    assert rows[-1] == {**rows[-1], "step": 6, "train/accuracy": 0.8, "train/margin": 0.5,
                        "validation/accuracy": 0.6, "validation/margin": 0.25}
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step-3", "step-6"]
    assert not torch.equal(steps[0][2], model.weights.detach())
    assert model.config.pad_token_id == PAD
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert result.summary == summary and result.model_dir == tmp_path / "run" / "model"
    assert {k: summary[k] for k in ("stage", "steps", "pairs", "train_pairs", "averaged_steps", "shared_prefix",
                                    "wall_time_s", "model_dir", "nonfinite")} == {
        "stage": "rm", "steps": 6, "pairs": HELD_OUT, "train_pairs": 5, "averaged_steps": 0, "shared_prefix": False,
        "wall_time_s": {"rm": 0.5}, "model_dir": str(result.model_dir), "nonfinite": {"mode": "stop",
                                                                                      "skipped_updates": 0}}
    assert summary["parallel"]["world_size"] == 1 and summary["precision"] == MixedPrecision().describe()
    tokenizer = steps and next(c for c in calls if c[0] == "tokenizer")
    assert tokenizer == ("tokenizer", ("rm-backbone",), {"trust_remote_code": False})
    build = next(c for c in calls if c[0] == "build")
    assert build[1][0] == "rm-backbone" and build[2] == {"dtype": cfg.dtype, "trust_remote_code": False}
    pairs_call = next(c for c in calls if c[0] == "pairs")
    assert pairs_call[1] is cfg and pairs_call[2].pad_token_id == PAD and pairs_call[3] is False
    held_out = next(c for c in calls if c[0] == "held_out")
    assert held_out[1] is model and held_out[3] == {"train": PAIRS, "validation": PAIRS[:2]} and held_out[4] is cfg
    assert held_out[5] == result.model_dir
    assert [c for c in calls if c[0] in ("threads", "seed")] == [("threads", 1), ("seed", 5, False)]


def test_averaged_weights_are_the_mean_over_the_last_fraction_of_the_steps(monkeypatch, tmp_path):
    cfg, calls, model = stand_in_run(monkeypatch, tmp_path, average_weights=0.5, save_every=0)
    after = []
    step = reward.train_step
    monkeypatch.setattr(reward, "train_step", lambda *a: (step(*a), after.append(model.weights.detach().clone()))[0])
    result = reward.train(cfg)
    assert len(after) == 6 and result.summary["averaged_steps"] == 3
    assert torch.allclose(model.weights.detach(), torch.stack(after[3:]).mean(0), atol=1e-7)  # steps 4-6


def test_a_resumed_reward_model_run_ends_where_the_uninterrupted_one_ends(monkeypatch, tmp_path):
    cfg, _, _ = stand_in_run(monkeypatch, tmp_path, num_epochs=1, lr_schedule="constant", save_every=0)
    reward.train(cfg)  # 3 steps, checkpointed at the end
    cfg, calls, resumed_model = stand_in_run(monkeypatch, tmp_path, resume="latest", allow_config_change=True,
                                             lr_schedule="constant", save_every=0)
    resumed = reward.train(cfg)
    resumed_batches = [c[1] for c in calls if c[0] == "step"]
    monkeypatch.undo()
    cfg, _, whole_model = stand_in_run(monkeypatch, tmp_path, folder="whole", lr_schedule="constant", save_every=0)
    whole = reward.train(cfg)
    assert torch.equal(resumed_model.weights, whole_model.weights)
    assert resumed_batches == [[PAIRS[i] for i in ids] for ids in shuffled_batches(5, 2, 2)[3:]]  # epoch 2's
    assert resumed.summary["steps"] == whole.summary["steps"] == 6


def test_steps_dropped_as_non_finite_are_counted(monkeypatch, tmp_path):
    cfg, _, model = stand_in_run(monkeypatch, tmp_path, nonfinite="skip", num_epochs=1, save_every=0)
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: None)
    start = model.weights.detach().clone()
    summary = reward.train(cfg).summary
    assert summary["nonfinite"] == {"mode": "skip", "skipped_updates": 3}
    assert torch.equal(model.weights.detach(), start)


@pytest.mark.parametrize("field, value", [("num_epochs", 0), ("batch_size", 0), ("length_chunks", -1),
                                          ("extra_layers", -1), ("frozen_layers", -1), ("prompt_rows_together", -1),
                                          ("gradient_accumulation_steps", 2), ("average_weights", 1.5),
                                          ("average_weights", -0.1)])
def test_a_bad_setting_is_refused_before_anything_loads_or_is_written(monkeypatch, tmp_path, field, value):
    cfg, calls, _ = stand_in_run(monkeypatch, tmp_path, **{field: value})
    with pytest.raises(UserInputError, match=field):
        reward.train(cfg)
    assert calls == [] and not (tmp_path / "run").exists()


def test_a_run_without_a_backbone_is_refused(monkeypatch, tmp_path):
    cfg, calls, _ = stand_in_run(monkeypatch, tmp_path, model="")
    with pytest.raises(UserInputError, match="no backbone"):
        reward.train(cfg)
    assert calls == []


def test_the_smallest_allowed_settings_run(monkeypatch, tmp_path):
    cfg, calls, _ = stand_in_run(monkeypatch, tmp_path, num_epochs=1, batch_size=5, length_chunks=0, average_weights=1.0,
                                 save_every=0)
    summary = reward.train(cfg).summary
    assert summary["steps"] == 1 and summary["averaged_steps"] == 1 and not math.isnan(summary["pairs"]["train"]["accuracy"])


def refusal(monkeypatch, tmp_path, **fields) -> tuple[str, str, str]:
    cfg, calls, _ = stand_in_run(monkeypatch, tmp_path, **fields)
    with pytest.raises(UserInputError) as refused:
        reward.train(cfg)
    assert calls == [] and not (tmp_path / "run").exists()
    return refused.value.what, refused.value.where, refused.value.fix


def test_each_refusal_names_what_where_and_what_to_do(monkeypatch, tmp_path):
    assert refusal(monkeypatch, tmp_path, model="") == (
        "no backbone given", "--model", "pass the SFT model folder (or any HF causal LM, or an encoder such as BERT)")
    assert refusal(monkeypatch, tmp_path, frozen_layers=-2) == (
        "frozen_layers must be >= 0, not -2", "rm config, --frozen_layers", "use 0 or more")
    assert refusal(monkeypatch, tmp_path, num_epochs=0) == ("num_epochs must be >= 1, not 0", "rm config, --num_epochs",
                                                            "use 1 or more")
    assert refusal(monkeypatch, tmp_path, gradient_accumulation_steps=3) == (
        "rlhflab rm has no gradient accumulation (gradient_accumulation_steps 3)", "--gradient_accumulation_steps",
        "leave it at 1: each step scores its pairs in --length_chunks forward passes over length-sorted pairs with "
        "--shared_prefix false (the same gradient, less memory), or lower --batch_size")
    assert refusal(monkeypatch, tmp_path, average_weights=2.0) == (
        "average_weights must be a fraction of the steps in [0, 1], not 2.0", "--average_weights",
        "use e.g. 0.4 (the last 40 % of the steps) or 0 (off)")


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_weight_averaging_is_refused_where_the_weights_are_sharded(monkeypatch, tmp_path, strategy):
    monkeypatch.setattr(reward.parallel, "resolve_strategy", lambda asked, world: strategy)
    assert refusal(monkeypatch, tmp_path, average_weights=0.5, parallel_strategy=strategy) == (
        "weight averaging keeps whole weights, which FSDP2 / DeepSpeed shard", "--average_weights",
        "use --parallel_strategy ddp, or --average_weights 0")


def test_a_batch_of_one_pair_and_every_smallest_size_run_and_the_run_reads_its_strategy(monkeypatch, tmp_path):
    cfg, calls, model = stand_in_run(monkeypatch, tmp_path, num_epochs=1, batch_size=1, save_every=0,
                                     average_weights=0.2)
    asked = []
    real = reward.precision_from_config
    monkeypatch.setattr(reward, "precision_from_config", lambda *a: asked.append(a) or real(*a))
    monkeypatch.setattr(reward.parallel, "resolve_strategy", lambda wanted, world: asked.append(wanted) or "ddp")
    summary = reward.train(cfg).summary
    assert summary["steps"] == 5 and summary["averaged_steps"] == 1  # ddp keeps whole weights: averaging allowed
    assert asked[0] == cfg.parallel_strategy and asked[2][2] == "ddp" and asked[2][0] is cfg
    build = next(c for c in calls if c[0] == "build")
    assert build[1][1].pad_token_id == PAD  # the tokenizer, for the pad id of the score head


def test_a_run_hands_its_model_world_and_settings_on(monkeypatch, tmp_path):
    from rlhflab import parallel
    from rlhflab.callbacks import Callback
    from rlhflab.tracking import RunDir
    from rlhflab.trainers.given import Given

    cfg, calls, model = stand_in_run(monkeypatch, tmp_path, gradient_checkpointing=True, num_epochs=1, save_every=0)
    spied = []
    for owner, name in ((reward, "open_run"), (reward, "make_optimizer"), (reward.models, "is_encoder_reward_model"),
                        (parallel, "wrap_model"), (parallel.World, "check_same"), (parallel.Wrapped, "prepare")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _n=name, _f=real, **k: spied.append((_n, a, k)) or _f(*a, **k))
    callbacks = (Callback(),)
    reward.train(cfg, given=Given(callbacks=callbacks))
    seen = {name: (a, k) for name, a, k in spied}
    world, wrapped = seen["check_same"][0][0], seen["prepare"][0][0]
    assert ("checkpointing", model, "reward model") in calls
    assert seen["is_encoder_reward_model"] == ((model,), {})
    assert next(c for c in calls if c[0] == "pairs")[4] is world
    assert seen["check_same"] == ((world, list(PAIRS), "the tokenised training pairs"), {})
    assert seen["wrap_model"] == ((model, world, cfg.parallel_strategy), {})
    assert seen["open_run"] == ((cfg, "rm", wrapped.layout, callbacks), {})
    assert seen["make_optimizer"][1] == {"fused": True} and seen["prepare"][0][2] == cfg.max_grad_norm
    given = RunDir(tmp_path / "given")
    spied.clear()
    assert reward.train(stand_in_run(monkeypatch, tmp_path, num_epochs=1)[0], given).run_dir == given.path
    assert "open_run" not in {name for name, *_ in spied}


@pytest.mark.parametrize("shared, together", [(True, 2), (False, 2), (True, 0)])
def test_a_prompt_s_rows_go_side_by_side_only_with_the_grouped_scorer(monkeypatch, tmp_path, caplog, shared, together):
    cfg, _, _ = stand_in_run(monkeypatch, tmp_path, num_epochs=1, save_every=0, prompt_rows_together=together)
    monkeypatch.setattr(reward, "use_shared_prefix", lambda cfg, model: shared)
    majors = []
    real = reward.prompt_major
    monkeypatch.setattr(reward, "prompt_major", lambda *a, **k: majors.append((a[2:], k)) or real(*a, **k))
    with caplog.at_level("INFO", logger="rlhflab"):
        summary = reward.train(cfg).summary
    assert majors == ([((2, ), {"apart": reward.POLICY_ROWS})] if shared and together else [])
    said = "reward model: prompt_rows_together needs the grouped scorer (shared_prefix), which this model does not " \
           "run; rows are shuffled one by one"
    assert (said in caplog.messages) is (together > 0 and not shared)
    assert summary["shared_prefix"] is shared


def test_a_resume_carries_the_dropped_step_count_the_weight_average_and_the_loss_scale_on(monkeypatch, tmp_path):
    from rlhflab.models.precision import MixedPrecision

    fields = dict(nonfinite="skip", average_weights=1.0, lr_schedule="constant", save_every=0)
    cfg, _, _ = stand_in_run(monkeypatch, tmp_path, num_epochs=1, **fields)
    monkeypatch.setattr(MixedPrecision, "state_dict", lambda self: {"scale": 7.0})  # as fp16's scaler would keep
    drop = iter([None, torch.tensor(1.0), torch.tensor(1.0)] + [torch.tensor(1.0)] * 3)
    real_step = reward.clip_and_step
    monkeypatch.setattr(reward, "clip_and_step", lambda *a, **k: next(drop) and real_step(*a, **k))
    reward.train(cfg)  # step 1 dropped
    cfg, _, resumed_model = stand_in_run(monkeypatch, tmp_path, resume="latest", allow_config_change=True, **fields)
    loaded = []
    monkeypatch.setattr(MixedPrecision, "load_state_dict", lambda self, state: loaded.append(state))
    summary = reward.train(cfg).summary
    assert loaded == [{"scale": 7.0}] and summary["nonfinite"]["skipped_updates"] == 1
    assert summary["averaged_steps"] == 6  # the first run's 3 steps and this one's


class RecordingTotalBar:
    """What `tqdm(total=..., **shown)` is handed, its updates and postfixes."""

    def __init__(self, **shown):
        self.shown, self.updates, self.postfixes, self.closed = shown, 0, [], False

    def update(self, n):
        self.updates += n

    def set_postfix(self, **fields):
        self.postfixes.append(fields)

    def close(self):
        self.closed = True


def test_the_progress_bar_counts_steps_from_a_resume_on_and_shows_only_when_asked(monkeypatch, tmp_path):
    bars = []
    monkeypatch.setattr(reward, "tqdm", lambda **shown: bars.append(RecordingTotalBar(**shown)) or bars[-1])
    for progress in (True, False):
        cfg, *_ = stand_in_run(monkeypatch, tmp_path, folder=f"run-{progress}", progress=progress, num_epochs=1,
                               save_every=0)
        reward.train(cfg)
    cfg, *_ = stand_in_run(monkeypatch, tmp_path, folder="run-True", progress=True, resume="latest",
                           allow_config_change=True)
    reward.train(cfg)
    assert [bar.shown for bar in bars] == [dict(total=3, initial=0, desc="rm", unit="step", disable=False),
                                           dict(total=3, initial=0, desc="rm", unit="step", disable=True),
                                           dict(total=6, initial=3, desc="rm", unit="step", disable=False)]
    assert [bar.updates for bar in bars] == [3, 3, 3] and all(bar.closed for bar in bars)
    assert len(bars[0].postfixes) == 2 and set(bars[0].postfixes[0]) == {"loss", "acc"}
