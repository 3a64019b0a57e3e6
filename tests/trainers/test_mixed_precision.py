"""Mixed precision in the trainers (models/precision.py, trainers/nonfinite.py): bf16 autocast keeps float32
masters and optimiser states and learns like float32; fp16's scaler skips, counts and backs off on an inf
gradient without stopping the run or writing anything of the bad step; impossible requests are refused
before a model is loaded. (The exact first-step ratio / KL under bf16: tests/trainers/test_ppo.py, test_grpo.py.)"""

import copy
import json

import pytest
import torch
from critic_free import digit_share, tiny, update_rows
from online_steps import run_passes
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab import data, models, parallel, tasks
from rlhflab.cli import main
from rlhflab.config import GRPOConfig, PPOConfig, SFTConfig
from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers import grpo, ppo, sft
from rlhflab.trainers.nonfinite import clip_and_step
from rlhflab.trainers.online.setup import build_roles
from rlhflab.trainers.setup import make_optimizer, make_scheduler

BF16 = MixedPrecision("bf16", "cpu")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def write_train_file(path, count: int = 6) -> str:
    items = tasks.sample_items("train", count, seed=3)
    path.write_text("".join(json.dumps({"prompt": i.prompt, "completion": i.reference}) + "\n" for i in items))
    return str(path)


def sft_cfg(policy_dir, tmp_path, **overrides) -> SFTConfig:
    train = write_train_file(tmp_path / "train.jsonl")
    base = dict(model=policy_dir, train_file=train, validation_file=train, output_dir=str(tmp_path / "run"),
                max_steps=60, batch_size=6, learning_rate=1e-2, warmup_steps=5, eval_every=0, log_every=1,
                progress=False, threads=1)
    return SFTConfig(**{**base, **overrides})


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def optimiser_dtypes(optimizer) -> set:
    return {t.dtype for state in optimizer.state.values() for t in state.values() if t.dim() > 0}


# --- bf16: float32 masters, learning like float32 ------------------------------------------------------------


def test_a_bf16_sft_step_moves_float32_weights_with_float32_adamw_states(policy_dir):
    model = models.load_causal_lm(policy_dir)
    tokenizer = models.load_tokenizer(policy_dir)
    examples = data.tokenize_sft([data.SFTExample(i.prompt, i.reference, i.family, None)
                                  for i in tasks.sample_items("train", 4, seed=1)], tokenizer, 160)
    cfg = SFTConfig(learning_rate=1e-3, warmup_steps=0)
    optimizer = make_optimizer(model.parameters(), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = sft.train_step(parallel.wrap_model(model, parallel.SINGLE), optimizer, make_scheduler(optimizer, cfg, 5),
                           examples, tokenizer.pad_token_id, cfg, precision=BF16)
    assert stats["grad_norm"] > 0 and not stats["skipped"] and "amp/scale" not in stats  # no scaler in bf16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert optimiser_dtypes(optimizer) == {torch.float32}
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


def test_a_bf16_ppo_update_keeps_policy_value_head_and_adamw_in_float32(policy_dir):
    cfg = tiny(PPOConfig, policy_dir, mixed_precision="bf16", num_mini_batches=2, value_warmup_rollouts=0)
    roles, tokenizer = build_roles(cfg)
    assert roles.precision.mode == "bf16"
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    from rlhflab.rollout import GenerationSettings
    from rlhflab.rollout.rollout import collect_rollout
    rollout = collect_rollout(roles, data.encode_prompts(tokenizer, [i.prompt for i in items]),
                              pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                              settings=GenerationSettings(6, True, 0.9), generator=torch.Generator().manual_seed(0))
    assert rollout.logprobs.dtype == rollout.ref_logprobs.dtype == rollout.values.dtype == torch.float32
    optimizer = torch.optim.AdamW(roles.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    before = [p.detach().clone() for p in roles.trainable_parameters()]
    mask = rollout.response_mask
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=gen).masked_fill(~mask, 0)
    run_passes(ppo.PPO(cfg), roles, optimizer, scheduler, rollout, advantages, advantages.clone(), cfg,
               torch.Generator().manual_seed(0))
    assert {p.dtype for p in roles.trainable_parameters()} == {torch.float32}
    assert optimiser_dtypes(optimizer) == {torch.float32}
    assert all(not torch.equal(p, b) for p, b in zip(roles.trainable_parameters(), before))


def test_a_short_bf16_sft_run_learns_like_float32(policy_dir, tmp_path):
    """60 steps on 6 examples (every step the whole set, so no seed changes the run). Measured: the loss falls
    5.55 -> 0.272 in float32 and 5.55 -> 0.269 under bf16 autocast (1 % apart); asserted: > 10x in both, bf16's
    last loss within 10 % of float32's."""
    final = {}
    for precision in ("no", "bf16"):
        (tmp_path / precision).mkdir()
        result = sft.train(sft_cfg(policy_dir, tmp_path / precision, mixed_precision=precision))
        losses = [r["loss/sft"] for r in metric_rows(result.run_dir) if "loss/sft" in r]
        summary = json.loads((result.run_dir / "summary.json").read_text())
        assert summary["precision"]["mixed_precision"] == precision
        assert losses[-1] < 0.1 * losses[0], (precision, losses[0], losses[-1])
        final[precision] = losses[-1]
        saved = load_file(str(result.model_dir / "model.safetensors"))
        assert {t.dtype for t in saved.values()} == {torch.float32}  # masters are what is saved
    assert final["bf16"] == pytest.approx(final["no"], rel=0.1), final


def test_a_short_bf16_grpo_run_raises_an_easy_reward_like_float32(policy_dir, tmp_path):
    """test_grpo's easy-reward run in both precisions. Measured over seeds 0-3 (end = mean score of the last 3
    updates): float32 0.92 / 0.97 / 0.83 / 0.99, bf16 0.97 / 0.97 / 0.94 / 0.99; start 0.03-0.05."""
    ends = {}
    for precision in ("no", "bf16"):
        cfg = tiny(GRPOConfig, policy_dir, num_generations=4, beta=0.0, batch_size=16, total_episodes=16 * 20,
                   learning_rate=3e-2, missing_eos_penalty=0.0, output_dir=str(tmp_path / precision),
                   mixed_precision=precision)
        scores = [r["objective/scores"] for r in update_rows(grpo.train(cfg, reward_fn=digit_share).run_dir)]
        start, ends[precision] = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
        assert ends[precision] > start + 0.5, (precision, start, ends[precision])
    assert abs(ends["bf16"] - ends["no"]) < 0.2, ends


# --- fp16: the scaler in clip_and_step (fp16 autocast is refused on a CPU, so the scaler is driven directly) ------


def linear_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def backward(model, precision: MixedPrecision | None) -> float:
    loss = model(torch.arange(8.0).view(2, 4) / 8).pow(2).mean()
    (precision.scale(loss) if precision is not None else loss).backward()
    return loss.item()


def test_fp16_scaler_unscales_before_clipping_so_a_good_step_is_the_float32_step():
    plain, plain_opt, plain_sched = linear_setup()
    scaled, scaled_opt, scaled_sched = linear_setup()
    precision = MixedPrecision("fp16", "cpu")
    want = clip_and_step(plain_opt, plain_sched, plain.parameters(), 0.1, backward(plain, None), "stop", "test")
    got = clip_and_step(scaled_opt, scaled_sched, scaled.parameters(), 0.1, backward(scaled, precision), "stop",
                        "test", precision=precision)
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and not precision.overflowed
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # scaling by 2**16 and back is exact
    assert precision.metrics() == {"amp/scale": 2.0**16, "amp/skipped_steps": 0}


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_an_inf_gradient_under_fp16_is_skipped_counted_and_lowers_the_scale_in_either_mode(mode):
    model, optimizer, scheduler = linear_setup()
    precision = MixedPrecision("fp16", "cpu")
    clip_and_step(optimizer, scheduler, model.parameters(), 1.0, backward(model, precision), mode, "test",
                  precision=precision)  # a good step first: AdamW has moments to compare
    weights, moments = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    lr, scale = scheduler.get_last_lr(), precision.scaler.get_scale()
    loss = backward(model, precision)
    model.weight.grad[0, 0] = float("inf")  # an fp16 overflow in the backward
    assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, loss, mode, "test",
                         precision=precision) is None  # no FloatingPointError: an overflow is expected
    assert precision.overflowed and precision.metrics() == {"amp/scale": scale / 2, "amp/skipped_steps": 1}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert str(optimizer.state_dict()) == str(moments) and scheduler.get_last_lr() == lr  # no AdamW, no LR step
    assert all(p.grad is None for p in model.parameters())
    # the next good step applies at the lowered scale
    assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, backward(model, precision), mode, "test",
                         precision=precision) is not None
    assert not precision.overflowed and not torch.equal(model.weight, weights["weight"])


def test_an_inf_gradient_at_a_scale_below_one_is_no_overflow_and_stops_the_run():
    model, optimizer, scheduler = linear_setup()
    precision = MixedPrecision("fp16", "cpu")
    loss = backward(model, precision)
    precision.scaler.update(0.5)  # as after 17 overflows in a row
    model.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite test gradient norm"):
        clip_and_step(optimizer, scheduler, model.parameters(), 1.0, loss, "stop", "test", precision=precision)
    assert precision.skipped_steps == 0


def test_real_non_finite_gradients_skipped_twice_under_fp16_keep_the_scaler_usable():
    """--nonfinite skip at a scale below 1: each bad step is dropped (not an overflow) and the next one still
    unscales and steps (a scaler left 'unscaled' would raise on the second)."""
    model, optimizer, scheduler = linear_setup()
    precision = MixedPrecision("fp16", "cpu")
    backward(model, precision)  # the scaler's scale exists from its first scale()
    optimizer.zero_grad(set_to_none=True)
    precision.scaler.update(0.5)  # as after 17 overflows in a row
    weights = copy.deepcopy(model.state_dict())
    for _ in range(2):
        loss = backward(model, precision)
        model.weight.grad[0, 0] = float("nan")
        assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, loss, "skip", "test",
                             precision=precision) is None
        assert precision.scaler.get_scale() == 0.5 and precision.skipped_steps == 0 and not precision.overflowed
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, backward(model, precision), "skip", "test",
                         precision=precision) is not None
    assert not torch.equal(model.weight, weights["weight"])


def test_a_non_finite_loss_under_fp16_is_no_overflow_and_still_stops_the_run():
    model, optimizer, scheduler = linear_setup()
    precision = MixedPrecision("fp16", "cpu")
    backward(model, precision)
    with pytest.raises(FloatingPointError, match="non-finite test loss"):
        clip_and_step(optimizer, scheduler, model.parameters(), 1.0, float("nan"), "stop", "test", precision=precision)
    assert precision.skipped_steps == 0


def test_an_fp16_sft_run_skips_the_overflow_step_and_writes_nothing_of_it(policy_dir, tmp_path, monkeypatch):
    """SFT with the fp16 scaler (autocast forced on, as on a GPU) and an inf gradient injected into step 2 of 3:
    nonfinite=stop does not stop; step 2 is counted in amp/skipped_steps with the scale halved; the checkpoint
    after it holds step 1's weights exactly; step 3 trains again."""
    monkeypatch.setattr(sft, "precision_from_config", lambda cfg, device, strategy: MixedPrecision("fp16", "cpu"))
    steps = []

    def poisoned(optimizer, scheduler, params, *args, **kwargs):  # step 2's backward overflowed
        params = list(params)
        steps.append(1)
        if len(steps) == 2:
            params[0].grad.view(-1)[0] = float("inf")
        return clip_and_step(optimizer, scheduler, params, *args, **kwargs)

    monkeypatch.setattr(sft, "clip_and_step", poisoned)
    result = sft.train(sft_cfg(policy_dir, tmp_path, max_steps=3, save_every=1, keep_last_n=3, warmup_steps=0,
                               lr_schedule="constant"))
    rows = [r for r in metric_rows(result.run_dir) if "loss/sft" in r]
    assert [r["amp/skipped_steps"] for r in rows] == [0, 1, 1]
    assert rows[1]["amp/scale"] == rows[0]["amp/scale"] / 2 and rows[1]["grad_norm"] == "nan"  # not applied
    assert all(r["loss/sft"] == r["loss/sft"] for r in rows) and [r["lr"] for r in rows] == [1e-2] * 3
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["nonfinite"]["skipped_updates"] == 0 and summary["precision"]["skipped_steps"] == 1
    step = lambda n: load_file(str(result.run_dir / "checkpoints" / f"step-{n}" / "model.safetensors"))  # noqa: E731
    one, two, three = step(1), step(2), step(3)
    assert all(torch.equal(one[k], two[k]) for k in one)  # nothing of the skipped step was written
    assert any(not torch.equal(two[k], three[k]) for k in two)


# --- refusals before any model is loaded ----------------------------------------------------------------------


@pytest.mark.parametrize("stage,flags,named", [
    ("sft", ["--fp16"], "--fp16"),
    ("rm", ["--mixed_precision", "fp16"], "--mixed_precision fp16"),
    ("dpo", ["--bf16", "--fp16"], "--bf16 / --fp16"),
    ("grpo", ["--bf16", "--mixed_precision", "no"], "--bf16 / --mixed_precision"),
    ("ppo", ["--fp16"], "--fp16"),
])
def test_an_impossible_precision_is_refused_before_the_model_is_read(tmp_path, capsys, stage, flags, named):
    missing = str(tmp_path / "no-such-model")
    code = main([stage, "--model", missing, "--output_dir", str(tmp_path / "run"), *flags, "--progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "no-such-model" not in err, err
    assert not (tmp_path / "run").exists()
