"""DPO's pieces that need no model (trainers/dpo.py): each loss type's number on hand-made summed log-probs (which
ones read means, which read the reference), the run's length in steps and pairs, and the refusals (issue 36)."""

import json
import math
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from stage_stubs import PAD, RecordingWrapped, captured_step, recorded_run_setup, recording_bars, tiny_llama

from rlhflab import parallel
from rlhflab.callbacks import Callback
from rlhflab.checkpoint.folder import load_checkpoint
from rlhflab.config import DPOConfig
from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision
from rlhflab.tracking import RunDir
from rlhflab.trainers import dpo
from rlhflab.trainers.dpo_data import DPOData, PreferencePair
from rlhflab.trainers.dpo_logps import SequenceLogps, pair_batch, precompute_logps, sequence_logps
from rlhflab.trainers.given import Given


def dpo_cfg(**fields) -> DPOConfig:
    return DPOConfig(**{"model": "unused", **fields})


# two pairs: summed log-probs over (chosen, rejected) lengths (2, 4) and (1, 1)
POLICY = SequenceLogps(torch.tensor([-2.0, -1.0]), torch.tensor([-8.0, -3.0]), torch.tensor([2.0, 1.0]),
                       torch.tensor([4.0, 1.0]))
REFERENCE = SequenceLogps(torch.tensor([-3.0, -1.5]), torch.tensor([-6.0, -2.0]), torch.tensor([2.0, 1.0]),
                          torch.tensor([4.0, 1.0]))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_reads_summed_log_probs_against_the_reference_with_label_smoothing():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="sigmoid", beta=0.5, label_smoothing=0.2), POLICY, REFERENCE)
    # h = beta ((pc - rc) - (pr - rr)): pair 1: 0.5 (1 - (-2)) = 1.5; pair 2: 0.5 (0.5 - (-1)) = 0.75
    expected = sum(-0.8 * log_sigmoid(h) - 0.2 * log_sigmoid(-h) for h in (1.5, 0.75)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6) and stats["loss"] == pytest.approx(expected, abs=1e-6)
    assert stats["rewards/chosen"] == pytest.approx(0.5 * (1.0 + 0.5) / 2)
    assert stats["rewards/rejected"] == pytest.approx(0.5 * (-2.0 - 1.0) / 2)
    assert stats["rewards/accuracies"] == 1.0 and stats["rewards/margins"] == pytest.approx((1.5 + 0.75) / 2)
    assert stats["logps/chosen"] == -1.5 and stats["logps/rejected"] == -5.5  # summed, as the loss read them


def test_ipo_reads_means_per_token_against_the_reference():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="ipo", beta=0.25), POLICY, REFERENCE)
    # per-token means: pair 1: chosen -1 vs ref -1.5, rejected -2 vs ref -1.5: h = 0.5 - (-0.5) = 1.0
    # pair 2: chosen -1 vs -1.5, rejected -3 vs -2: h = 0.5 + 1 = 1.5; 1 / (2 beta) = 2
    assert loss.item() == pytest.approx(((1.0 - 2) ** 2 + (1.5 - 2) ** 2) / 2, abs=1e-6)
    assert stats["logps/chosen"] == -1.0 and stats["logps/rejected"] == -2.5  # the means the loss read


def test_simpo_reads_means_and_no_reference():
    loss, stats = dpo.preference_loss(dpo_cfg(loss_type="simpo", beta=2.0, simpo_gamma=0.5), POLICY, None)
    # -log sigma(beta (mean_c - mean_r) - gamma): pair 1: 2 (-1 + 2) - 0.5 = 1.5; pair 2: 2 (-1 + 3) - 0.5 = 3.5
    assert loss.item() == pytest.approx(-(log_sigmoid(1.5) + log_sigmoid(3.5)) / 2, abs=1e-6)
    assert dpo.LOSS_TYPES["simpo"].reference is False and dpo.LOSS_TYPES["sigmoid"].reference is True
    assert dpo.LOSS_TYPES["ipo"].averaged and dpo.LOSS_TYPES["simpo"].averaged and not dpo.LOSS_TYPES["sigmoid"].averaged
    assert stats["logps/rejected"] == -2.5


@pytest.mark.parametrize("fields, pairs, expected", [
    ({"num_epochs": 2, "batch_size": 4}, 10, (5, 20)),  # 2 epochs of 10 pairs in steps of 4
    ({"num_epochs": 2, "batch_size": 4, "max_pairs": 7}, 10, (2, 7)),  # the pair budget ends inside step 2
    ({"num_epochs": 2, "batch_size": 4, "max_steps": 3}, 10, (3, 12)),  # max_steps set: epochs not read
    ({"num_epochs": 0, "batch_size": 4, "max_steps": 3, "max_pairs": 6}, 10, (2, 6)),
    ({"num_epochs": 0, "batch_size": 4, "max_steps": 2, "max_pairs": 50}, 10, (2, 8)),
    ({"num_epochs": 1, "batch_size": 3}, 10, (4, 10)),  # the last step takes what is left
    ({"num_epochs": 2, "batch_size": 4, "max_pairs": 1}, 10, (1, 1)),
    ({"num_epochs": 1, "batch_size": 4, "max_steps": 1}, 2, (1, 4)),  # max_steps set: the one epoch is not read
    ({"num_epochs": 1, "batch_size": 4, "max_steps": 3}, 2, (3, 12)),
    ({"num_epochs": 0, "batch_size": 4, "max_pairs": 6}, 10, (2, 6)),
    ({"num_epochs": 0, "batch_size": 4, "max_pairs": 8, "max_steps": 1}, 10, (1, 4)),
])
def test_planned_pairs_is_the_smallest_of_steps_epochs_and_pairs(fields, pairs, expected):
    assert dpo.planned_pairs(dpo_cfg(**fields), pairs) == expected


NO_LENGTH = ("no length given: max_steps, num_epochs and max_pairs are all 0", "--num_epochs",
             "set --num_epochs 1 (or --max_steps / --max_pairs)")


@pytest.mark.parametrize("fields, what, where, fix", [
    ({"model": ""}, "no policy given", "--model", "pass the SFT model folder, e.g. runs/demo-.../sft/model"),
    ({"batch_size": 0}, "batch_size must be > 0, got 0", "--batch_size", None),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be > 0, got 0",
     "--gradient_accumulation_steps", None),
    ({"beta": 0.0}, "beta must be > 0, got 0.0", "--beta", None),
    ({"max_steps": 0, "num_epochs": 0, "max_pairs": 0}, *NO_LENGTH),
    ({"batch_size": 4, "gradient_accumulation_steps": 5}, "gradient_accumulation_steps 5 > 4 pairs per process "
     "(batch_size 4): empty micro-batches", "--gradient_accumulation_steps", None),
    ({"label_smoothing": 0.5}, "label_smoothing must be in [0, 0.5), got 0.5", "--label_smoothing", None),
    ({"label_smoothing": -0.1}, "label_smoothing must be in [0, 0.5), got -0.1", "--label_smoothing", None),
    ({"label_smoothing": 0.1, "loss_type": "ipo"}, "label_smoothing is conservative DPO's: loss_type ipo has none",
     "--label_smoothing", "use --loss_type sigmoid, or drop --label_smoothing"),
])
def test_what_dpo_refuses_names_the_flag_and_the_fix(fields, what, where, fix):
    with pytest.raises(UserInputError) as refused:
        dpo.check_dpo_config(dpo_cfg(**fields))
    assert (refused.value.what, refused.value.where, refused.value.fix) == (what, where, fix)


def test_a_negative_reward_timeout_or_an_unknown_error_mode_of_the_verifier_is_refused():
    with pytest.raises(UserInputError, match="reward_timeout"):
        dpo.check_dpo_config(dpo_cfg(reward_timeout=-1.0))
    with pytest.raises(UserInputError, match="reward_errors"):
        dpo.check_dpo_config(dpo_cfg(reward_errors="ignore"))


def test_the_accumulation_bound_is_each_process_s_share_of_the_batch():
    two = SimpleNamespace(world_size=2, rank=0, distributed=True)
    with pytest.raises(UserInputError, match="gradient_accumulation_steps 3 > 2 pairs per process"):
        dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=3), two)
    dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=3))


def test_what_dpo_accepts_at_the_edges(caplog):
    dpo.check_dpo_config(dpo_cfg(batch_size=4, gradient_accumulation_steps=4, label_smoothing=0.0, num_epochs=0,
                                 max_pairs=1))
    dpo.check_dpo_config(dpo_cfg(label_smoothing=0.49, num_epochs=0, max_steps=1))
    dpo.check_dpo_config(dpo_cfg(num_epochs=1, max_steps=0, max_pairs=0))
    dpo.check_dpo_config(dpo_cfg(num_epochs=0, max_steps=0, max_pairs=1))
    with caplog.at_level("WARNING", logger="rlhflab"):
        dpo.check_dpo_config(dpo_cfg(loss_type="simpo", reference="ref-folder"))
    assert [r.getMessage() for r in caplog.records] == ["loss_type simpo needs no reference: --reference ref-folder is "
                                                        "not used"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhflab"):
        dpo.check_dpo_config(dpo_cfg(loss_type="ipo", reference="ref-folder"))
    assert caplog.text == ""


# --- train_step, evaluate, the reference log-probs: a 1-layer Llama over 6 tokens and stand-ins ----------------

# (chosen, rejected) lengths (8, 8) sharing 7 tokens, (4, 4) sharing 2, (6, 6) sharing 1: padded rows are 8, 4, 6
# tokens long, packed rows 9, 6, 11, so the two length orders differ
P_Y = PreferencePair([5, 3, 4, 2, 3, 4, 2, 1], [5, 3, 4, 2, 3, 4, 2, 4], 2, 2)
P_Z = PreferencePair([5, 3, 4, 1], [5, 3, 2, 1], 2, 2)
P_X = PreferencePair([5, 1, 2, 3, 4, 1], [5, 4, 3, 2, 1, 1], 1, 1)
BATCH = [P_Y, P_Z, P_X]
# a stored reference of BATCH, one distinct number per pair and side
BATCH_REFERENCE = SequenceLogps(torch.tensor([-9.0, -3.0, -6.5]), torch.tensor([-8.0, -4.5, -7.0]),
                                torch.tensor([6.0, 2.0, 5.0]), torch.tensor([6.0, 2.0, 5.0]))


def naive_gradient(model, cfg, pairs, reference, weight=1.0):
    """The loss of `pairs` in one padded forward, and the gradient of `weight` times it."""
    model.zero_grad()
    loss, stats = dpo.preference_loss(cfg, sequence_logps(model, pair_batch(pairs, PAD, False)), reference)
    (weight * loss).backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad()
    return stats, grads


def test_train_step_gives_the_whole_batch_gradient_from_length_sorted_micro_batches(monkeypatch):
    model = tiny_llama()
    cfg = dpo_cfg(beta=0.5, gradient_accumulation_steps=2, max_grad_norm=0.7, nonfinite="skip")
    expected_stats, expected_grads = naive_gradient(model, cfg, BATCH, BATCH_REFERENCE)
    calls = captured_step(monkeypatch, dpo, torch.tensor(2.5))
    wrapped, optimizer, scheduler, precision = RecordingWrapped(model), object(), object(), MixedPrecision()
    stats = dpo.train_step(wrapped, optimizer, scheduler, BATCH, BATCH_REFERENCE,
                           parallel.share_of(3, parallel.SINGLE), cfg, True, PAD, precision)
    # packed rows 9, 6, 11 tokens: micro-batches (Z, Y) then (X), one forward each, gradients synced after the last
    assert [(fn, pairs, pad, packed, chunks) for fn, pairs, pad, packed, chunks in wrapped.forwards] == [
        (dpo.chunked_logps, [P_Z, P_Y], PAD, True, 1), (dpo.chunked_logps, [P_X], PAD, True, 1)]
    assert wrapped.syncs == [False, True]
    (call,) = calls
    assert call["optimizer"] is optimizer and call["scheduler"] is scheduler and call["engine"] is wrapped
    assert call["precision"] is precision and call["params"] == list(model.parameters())
    assert (call["max_grad_norm"], call["mode"], call["stage"]) == (0.7, "skip", "DPO")
    assert call["loss"] == pytest.approx(expected_stats["loss"], abs=1e-6)
    for got, want in zip(call["grads"], expected_grads):
        assert torch.allclose(got, want, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in expected_grads)
    assert stats.pop("grad_norm") == 2.5 and stats.pop("skipped") is False
    assert stats == pytest.approx(expected_stats, abs=1e-6)


def test_train_step_reads_padded_lengths_and_no_reference_for_simpo(monkeypatch):
    model = tiny_llama()
    cfg = dpo_cfg(loss_type="simpo", beta=2.0, simpo_gamma=0.5)
    expected_stats, expected_grads = naive_gradient(model, cfg, BATCH, None)
    calls = captured_step(monkeypatch, dpo, None)  # a dropped step
    wrapped = RecordingWrapped(model)
    stats = dpo.train_step(wrapped, None, None, BATCH, None, parallel.share_of(3, parallel.SINGLE), cfg, False, PAD)
    # padded rows 8, 4, 6 tokens: one micro-batch sorted Z, X, Y; stats in batch order
    assert [args[1] for args in wrapped.forwards] == [[P_Z, P_X, P_Y]] and wrapped.syncs == [True]
    for got, want in zip(calls[0]["grads"], expected_grads):
        assert torch.allclose(got, want, atol=1e-6)
    assert math.isnan(stats.pop("grad_norm")) and stats.pop("skipped") is True
    assert stats == pytest.approx(expected_stats, abs=1e-6)
    overflowed = MixedPrecision()
    overflowed.overflowed = True  # fp16's scaler skipped it: not counted as a dropped step
    monkeypatch.setattr(dpo, "clip_and_step", lambda *a, **k: None)
    assert dpo.train_step(wrapped, None, None, BATCH, None, parallel.share_of(3, parallel.SINGLE), cfg, False, PAD,
                          overflowed)["skipped"] is False


@pytest.mark.parametrize("accumulation", [1, 2])
def test_padding_rows_of_a_share_run_forward_with_no_weight(monkeypatch, accumulation):
    """This rank's share of a global batch of 2: Z real, then Y as padding; Z's loss weighs 1/2 of the batch."""
    model = tiny_llama()
    cfg = dpo_cfg(beta=0.5, gradient_accumulation_steps=accumulation)
    reference = SequenceLogps(*(t[:2] for t in BATCH_REFERENCE))
    _, expected_grads = naive_gradient(model, cfg, [P_Z], SequenceLogps(*(t[1:2] for t in reference)), weight=0.5)
    calls = captured_step(monkeypatch, dpo, torch.tensor(1.0))
    wrapped = RecordingWrapped(model)
    dpo.train_step(wrapped, None, None, [P_Y, P_Z], reference, parallel.Share([1, 0], 1, 2), cfg, True, PAD)
    assert [args[1] for args in wrapped.forwards] == ([[P_Z, P_Y]] if accumulation == 1 else [[P_Z], [P_Y]])
    for got, want in zip(calls[0]["grads"], expected_grads):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("length_chunks, pairs, expected", [(0, 40, 2), (0, 8, 1), (3, 8, 3)])
def test_a_micro_batch_runs_in_one_forward_per_16_pairs_unless_length_chunks_says(monkeypatch, length_chunks, pairs,
                                                                                   expected):
    captured_step(monkeypatch, dpo, torch.tensor(1.0))
    wrapped = RecordingWrapped(tiny_llama())
    batch = [BATCH[i % 3] for i in range(pairs)]
    dpo.train_step(wrapped, None, None, batch, None, parallel.share_of(pairs, parallel.SINGLE),
                   dpo_cfg(loss_type="simpo", length_chunks=length_chunks), False, PAD)
    chunks = wrapped.forwards[0][-1]
    assert chunks == expected and type(chunks) is int


def RecordingRun():  # noqa: N802 - a stand-in RunDir that keeps what is logged
    logged = []
    return SimpleNamespace(logged=logged, log=lambda metrics, step: logged.append((dict(metrics), step)))


def dpo_data(train=(), validation=(), rows=(), verifier=None) -> DPOData:
    return DPOData(list(train), list(validation), list(rows), verifier, "built-in suite")


def test_evaluate_gives_the_validation_pairs_metrics_and_the_verifier_s_pass_rate(monkeypatch):
    precomputed, validated = [], []
    monkeypatch.setattr(dpo, "precompute_logps", lambda *a: precomputed.append(a) or POLICY)
    monkeypatch.setattr(dpo, "validate_pass_rate",
                        lambda *a, **k: validated.append((a, k)) or {"overall": 0.375, "by_family": {}})
    policy, tokenizer, run = tiny_llama(), SimpleNamespace(pad_token_id=PAD), RecordingRun()
    cfg, verifier = dpo_cfg(loss_type="sigmoid", beta=0.5), object()
    data = dpo_data(validation=BATCH[:2], rows=["row"], verifier=verifier)
    metrics = dpo.evaluate(policy, tokenizer, data, REFERENCE, cfg, 7, run, True)
    _, stats = dpo.preference_loss(cfg, POLICY, REFERENCE)
    assert metrics == {**{f"val/{k}": v for k, v in stats.items()}, "val/pass_rate": 0.375}
    assert run.logged == [(metrics, 7)] and policy.training
    assert precomputed == [(policy, BATCH[:2], PAD, True)]
    assert validated == [((policy, tokenizer, ["row"], verifier, cfg, 7, run), {"sample_count": dpo.SAMPLE_ANSWERS})]


def test_evaluate_has_no_pass_rate_without_a_verifier_or_its_rows_and_logs_nothing_empty(monkeypatch):
    monkeypatch.setattr(dpo, "validate_pass_rate", lambda *a, **k: pytest.fail("no verifier: no answers"))
    policy, run, tokenizer = tiny_llama(), RecordingRun(), SimpleNamespace(pad_token_id=PAD)
    assert dpo.evaluate(policy, tokenizer, dpo_data(rows=["row"]), None, dpo_cfg(), 3, run, False) == {}
    assert dpo.evaluate(policy, tokenizer, dpo_data(verifier=object()), None, dpo_cfg(), 3, run, False) == {}
    assert run.logged == [] and policy.training
    policy.eval()  # the model is put back in training mode even when it came in eval mode
    metrics = dpo.evaluate(policy, tokenizer, dpo_data(validation=[P_Z]), None, dpo_cfg(loss_type="simpo"), 4, run, False)
    expected = dpo.preference_loss(dpo_cfg(loss_type="simpo"), precompute_logps(policy, [P_Z], PAD, False), None)[1]
    assert metrics == pytest.approx({f"val/{k}": v for k, v in expected.items()}) and policy.training


class GatheringWrapped:
    def __init__(self, model):
        self.model, self.world = model, parallel.SINGLE

    @contextmanager
    def gathered(self):
        yield self.model


@pytest.mark.parametrize("shared_prefix, packs, packed", [(True, True, True), (True, False, False), (False, True, False)])
def test_evaluate_on_main_evaluates_the_whole_model_packed_where_it_can(monkeypatch, shared_prefix, packs, packed):
    calls, asked = [], []
    monkeypatch.setattr(dpo, "evaluate", lambda *a: calls.append(a) or {"val/loss": 0.5})
    monkeypatch.setattr(dpo, "can_pack", lambda model: asked.append(model) or packs)
    whole, tokenizer, data, run, cfg = object(), object(), dpo_data(), object(), dpo_cfg(shared_prefix=shared_prefix)
    assert dpo.evaluate_on_main(GatheringWrapped(whole), tokenizer, data, REFERENCE, cfg, 5, run) == {"val/loss": 0.5}
    assert calls == [(whole, tokenizer, data, REFERENCE, cfg, 5, run, packed)]
    assert asked == ([whole] if shared_prefix else [])


def test_reference_logps_are_the_starting_policy_s_for_each_split_or_none(monkeypatch):
    computed = []
    monkeypatch.setattr(dpo, "shared_precompute", lambda *a: computed.append(a) or len(computed))
    monkeypatch.setattr(dpo, "can_pack", lambda model: True)
    policy, world = tiny_llama(), SimpleNamespace(device="cpu")
    data = dpo_data(train=BATCH, validation=[P_Z])
    assert dpo.reference_logps(dpo_cfg(loss_type="simpo"), policy, data, PAD, world) == {"train": None,
                                                                                         "validation": None}
    assert computed == []
    assert dpo.reference_logps(dpo_cfg(shared_prefix=True), policy, data, PAD, world) == {"train": 1, "validation": 2}
    assert computed == [(policy, BATCH, PAD, True, world), (policy, [P_Z], PAD, True, world)]
    computed.clear()
    assert dpo.reference_logps(dpo_cfg(shared_prefix=False), policy, dpo_data(train=BATCH), PAD, world) == {
        "train": 1, "validation": None}
    assert computed == [(policy, BATCH, PAD, False, world)]


def test_another_reference_is_loaded_like_the_policy_in_its_dtype_without_dropout(monkeypatch):
    loaded, dropped, packs = [], [], []

    class Reference:
        def to(self, dtype):
            loaded.append(("to", dtype))
            return self

    reference = Reference()
    monkeypatch.setattr(dpo.models, "load_causal_lm", lambda *a, **k: loaded.append((a, k)) or reference)
    monkeypatch.setattr(dpo.models, "disable_dropout", dropped.append)
    monkeypatch.setattr(dpo, "can_pack", lambda model: packs.append(model) or False)
    monkeypatch.setattr(dpo, "shared_precompute", lambda *a: a)
    policy, world = tiny_llama().to(torch.float64), SimpleNamespace(device="meta")
    # trust_remote_code asked for, as a user would: it must reach the (stand-in) loaders; its default stays False
    cfg = dpo_cfg(reference="ref-folder", dtype="bfloat16", trust_remote_code=True, shared_prefix=True)
    out = dpo.reference_logps(cfg, policy, dpo_data(train=[P_Z]), PAD, world)
    assert loaded == [(("ref-folder",), {"dtype": "bfloat16", "trust_remote_code": True, "device": "meta"}),
                      ("to", torch.float64)]
    assert dropped == [reference] and packs == [reference]
    assert out == {"train": (reference, [P_Z], PAD, False, world), "validation": None}


def test_shared_precompute_computes_this_rank_s_block_only():
    model = tiny_llama()
    whole = dpo.shared_precompute(model, BATCH, PAD, True, parallel.SINGLE)
    expected = precompute_logps(model, BATCH, PAD, True)
    for got, want in zip(whole, expected):
        assert torch.equal(got, want)
    second = SimpleNamespace(world_size=2, rank=1, distributed=False)  # its block: pair 2 (and a padding repeat)
    mine = dpo.shared_precompute(model, BATCH, PAD, False, second)
    for got, want in zip(mine, precompute_logps(model, [P_X], PAD, False)):
        assert torch.equal(got, want)
    none = dpo.shared_precompute(model, [P_X], PAD, False, second)  # 1 pair over 2 ranks: none here
    assert isinstance(none, SequenceLogps) and [t.shape for t in none] == [(0,)] * 4


@pytest.mark.parametrize("lora_r, tokenizer, device", [(0, "", None), (8, "tok-folder", "meta"), (1, "", "cpu")])
def test_build_policy_loads_the_model_in_float32_unless_lora_trains_it(monkeypatch, lora_r, tokenizer, device):
    calls = []
    monkeypatch.setattr(dpo.models, "load_tokenizer", lambda *a, **k: calls.append(("tokenizer", a, k)) or "TOK")
    monkeypatch.setattr(dpo.models, "load_causal_lm", lambda *a, **k: calls.append(("model", a, k)) or "LOADED")
    monkeypatch.setattr(dpo, "float32_for_training", lambda m, what: calls.append(("float32", m, what)) or "FLOAT32")
    monkeypatch.setattr(dpo.models, "disable_dropout", lambda m: calls.append(("dropout", m)))
    monkeypatch.setattr(dpo, "resolve_device", lambda name: calls.append(("device", name)) or "RESOLVED")
    cfg = dpo_cfg(model="policy-folder", tokenizer=tokenizer, lora_r=lora_r, dtype="float16", trust_remote_code=True,
                  device="cpu")
    policy, tok = dpo.build_policy(cfg, device)
    kept = "LOADED" if lora_r else "FLOAT32"
    assert (policy, tok) == (kept, "TOK")
    assert calls == [("tokenizer", (tokenizer or "policy-folder",), {"trust_remote_code": True}),
                     *([] if device else [("device", "cpu")]),
                     ("model", ("policy-folder",), {"dtype": "float16", "trust_remote_code": True,
                                                    "device": device or "RESOLVED"}),
                     *([] if lora_r else [("float32", "LOADED", "policy policy-folder")]), ("dropout", kept)]


def test_summary_fields_hold_the_run_s_length_held_out_numbers_and_times(monkeypatch):
    monkeypatch.setattr(dpo.time, "time", lambda: 1012.34567)
    verifier = SimpleNamespace(name="checker")
    data = dpo_data(train=BATCH, validation=[P_Z], verifier=verifier)
    data = DPOData(data.train, data.validation, [], verifier, "prefs.jsonl")
    first = {"val/pass_rate": 0.25, "val/rewards/accuracies": 0.5, "val/rewards/margins": 0.0}
    last_eval = {"val/pass_rate": 0.75, "val/rewards/accuracies": 1.0, "val/rewards/margins": 2.5}
    progress = {"step": 6, "pairs_seen": 24, "first": first, "last_eval": last_eval, "last": {"loss": 0.3},
                "skipped": 1, "budget_stop": {"max_seconds": 9.0}}
    walls = {"setup": 1.23456, "loop": 4.0, "evaluation": 0.5, "save": 0.25}
    fields = dpo.summary_fields(dpo_cfg(loss_type="ipo", beta=0.25, nonfinite="skip"), data, progress, walls, 1000.0, 4)
    assert fields == {
        "stage": "dpo", "loss_type": "ipo", "beta": 0.25, "prompts": "prefs.jsonl", "train_pairs": 3,
        "validation_pairs": 1, "verifier": "checker", "steps": 6, "pairs_seen": 24, "episodes": 24,
        "validation_pass_rate": {"start": 0.25, "end": 0.75}, "validation_accuracy": {"start": 0.5, "end": 1.0},
        "validation_margin": {"start": 0.0, "end": 2.5}, "final": {"loss": 0.3}, "stopped": None,
        "budget_stop": {"max_seconds": 9.0}, "pairs_per_s": 5.0,  # 20 pairs this session in 4 s of loop
        "wall_time_s": {"setup": 1.235, "loop": 4.0, "evaluation": 0.5, "save": 0.25, "total": 12.346},
        "nonfinite": {"mode": "skip", "skipped_updates": 1}}


def test_summary_fields_without_a_verifier_name_or_any_loop_time(monkeypatch):
    class Checker:  # no `name`: its class name
        pass

    progress = {"step": 0, "pairs_seen": 3, "first": {}, "last_eval": {}, "last": {}, "skipped": 0, "budget_stop": None}
    walls = {"setup": 0.0, "loop": 0.0, "evaluation": 0.0, "save": 0.0}
    named = dpo.summary_fields(dpo_cfg(), dpo_data(verifier=Checker()), progress, walls, 0.0, 0)
    assert named["verifier"] == "Checker" and named["validation_accuracy"] == {"start": None, "end": None}
    assert named["pairs_per_s"] == 3e9  # 3 pairs over the 1e-9 s floor
    assert dpo.summary_fields(dpo_cfg(), dpo_data(), progress, walls, 0.0, 0)["verifier"] is None


# --- the run: a stand-in tokenizer and data, the 6-token Llama, a clock that ticks 1 s per reading ----------------

TRAIN_PAIRS = [P_Y, P_Z, P_X, P_Z, P_Y]


def stand_in_run(monkeypatch, tmp_path, **fields):
    """dpo.train's loading, global settings and final save replaced; every call recorded in the returned list."""
    calls, tokenizer, ticks = [], SimpleNamespace(pad_token_id=PAD), iter(range(100, 10_000))
    data = DPOData(TRAIN_PAIRS, [P_X, P_Z], [], None, "hand-made pairs")
    policy = tiny_llama()
    recorded_run_setup(monkeypatch, dpo, calls, tokenizer, clock=lambda: float(next(ticks)))
    monkeypatch.setattr(dpo, "load_dpo_data", lambda *a: calls.append(("data", *a)) or data)
    monkeypatch.setattr(dpo, "build_policy", lambda *a: calls.append(("policy", *a)) or (policy, tokenizer))
    monkeypatch.setattr(dpo, "save_policy_folder",
                        lambda *a: calls.append(("save", *a)) or tmp_path / "run" / "model")
    monkeypatch.setattr(dpo, "add_lora", lambda *a: calls.append(("lora", *a)) or a[0])
    step, evaluate = dpo.train_step, dpo.evaluate_on_main  # run, their arguments recorded
    monkeypatch.setattr(dpo, "train_step", lambda *a: calls.append(("step", *a)) or step(*a))
    monkeypatch.setattr(dpo, "evaluate_on_main", lambda *a: calls.append(("evaluate", *a)) or evaluate(*a))
    cfg = dpo_cfg(model="policy-folder", tokenizer="tok-folder", trust_remote_code=True, output_dir=str(tmp_path / "run"),
                  batch_size=2, num_epochs=1, beta=0.5, learning_rate=0.05, warmup_steps=0, lr_schedule="linear",
                  log_every=1, eval_every=2, save_every=2, threads=1, logits_chunk_mib=7, seed=3,
                  device="cpu", **{"progress": False, **fields})
    return cfg, calls, data, policy, tokenizer


def test_a_run_steps_logs_evaluates_and_summarises_its_pairs(monkeypatch, tmp_path):
    cfg, calls, data, policy, tokenizer = stand_in_run(monkeypatch, tmp_path)
    start = [p.detach().clone() for p in policy.parameters()]
    result = dpo.train(cfg)
    # 5 pairs, batches of 2, one epoch: 3 steps, the last of 1 pair
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val/rewards/margins"]) for r in rows if "val/loss" in r]
    steps = [r for r in rows if "loss" in r]
    assert [e[0] for e in evals] == [0, 2, 3] and evals[0][1] == 0.0 and evals[-1][1] > 0.0
    assert [(r["step"], r["pairs_seen"], r["epoch"], r["elapsed_s"]) for r in steps] == [
        (1, 2, 0.4, 5.0), (2, 4, 0.8, 10.0), (3, 5, 1.0, 15.0)]  # the clock: 5 readings a step
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its own reference at step 1
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and steps[-1]["loss"] < math.log(2)
    assert [r["lr"] for r in steps] == pytest.approx([0.05 * 2 / 3, 0.05 / 3, 0.0])  # linear decay over 3 steps
    assert all(math.isfinite(r["grad_norm"]) for r in steps)
    assert all(not torch.equal(a, b) for a, b in zip(start, policy.parameters()))
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step-2", "step-3"]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert result.summary == summary and result.model_dir == tmp_path / "run" / "model"
    assert {k: summary[k] for k in ("stage", "steps", "pairs_seen", "train_pairs", "validation_pairs", "prompts",
                                    "budget_stop", "pairs_per_s", "wall_time_s", "model_dir")} == {
        "stage": "dpo", "steps": 3, "pairs_seen": 5, "train_pairs": 5, "validation_pairs": 2,
        "prompts": "hand-made pairs", "budget_stop": None, "pairs_per_s": 1.7, "model_dir": str(result.model_dir),
        # setup 1 s, the first evaluation 1 s; each step: 1 s of step, 2 s of logging / evaluation, 1 s of saving
        "wall_time_s": {"setup": 1.0, "loop": 3.0, "evaluation": 7.0, "save": 4.0, "total": 20.0}}
    assert {**summary["final"], "step": 3} == steps[-1] and summary["validation_margin"]["end"] == evals[-1][1]
    assert summary["precision"] == MixedPrecision().describe()
    assert summary["parallel"] == {"strategy": "none", "world_size": 1, "sharded_state": False, "backend": None,
                                   "device": "cpu"}
    world = calls[4][3]
    steps_and_evaluations = [c for c in calls if c[0] in ("step", "evaluate")]
    assert [c[0] for c in steps_and_evaluations] == ["evaluate", "step", "step", "evaluate", "step", "evaluate"]
    precision = steps_and_evaluations[0][-1]
    assert isinstance(precision, MixedPrecision) and all(c[-1] is precision for c in steps_and_evaluations)
    assert all(c[8] is True for c in steps_and_evaluations if c[0] == "step")  # shared-prefix rows: packed
    assert calls == [("threads", 1), ("logits_chunks", 7), ("seed", 3, False),
                     ("tokenizer", ("tok-folder",), {"trust_remote_code": True}), ("data", cfg, tokenizer, world, None),
                     ("policy", cfg, world.device), *steps_and_evaluations,
                     ("save", policy, tokenizer, result.run_dir, False)]


def test_a_run_stopped_by_its_time_budget_resumes_to_the_uninterrupted_run_s_numbers(monkeypatch, tmp_path):
    # each step reads 3 s of loop time (1 s of step, 2 s of logging): the budget of 4 s runs out in step 2
    cfg, _, _, stopped_policy, _ = stand_in_run(monkeypatch, tmp_path, max_seconds=4.0)
    monkeypatch.setattr(MixedPrecision, "state_dict", lambda self: {"scale": 7.0})  # as fp16's scaler would keep
    stopped = dpo.train(cfg)
    assert stopped.summary["steps"] == 2 and stopped.summary["pairs_seen"] == 4
    assert stopped.summary["budget_stop"] == {"max_seconds": 4.0, "step": 2, "episode": 4}
    assert stopped.summary["nonfinite"] == {"mode": "stop", "skipped_updates": 0}
    assert sorted(p.name for p in (stopped.run_dir / "checkpoints").iterdir()) == ["step-2"]
    saved = load_checkpoint(stopped.run_dir / "checkpoints" / "step-2")[2]["progress"]
    assert (saved["loop_seconds"], saved["amp"], saved["skipped"]) == (6.0, {"scale": 7.0}, 0)
    cfg, _, _, resumed_policy, _ = stand_in_run(monkeypatch, tmp_path, resume="latest", allow_config_change=True)
    loaded, savers, checkpointer = [], [], dpo.checkpointer
    monkeypatch.setattr(MixedPrecision, "load_state_dict", lambda self, state: loaded.append(state))
    monkeypatch.setattr(dpo, "checkpointer", lambda *a: savers.append(a) or checkpointer(*a))
    resumed = dpo.train(cfg)
    assert loaded == [{"scale": 7.0}] and savers[0][2].step == 2 and isinstance(savers[0][4], torch.optim.AdamW)
    # setup 1 s; step 3: 1 s of step, 2 s of logging and the last evaluation, 1 s of saving, 1 s of the last save
    assert resumed.summary["wall_time_s"] == {"setup": 1.0, "loop": 1.0, "evaluation": 2.0, "save": 2.0, "total": 9.0}
    cfg, _, _, whole_policy, _ = stand_in_run(monkeypatch, tmp_path / "whole")
    whole = dpo.train(cfg)
    for a, b in zip(resumed_policy.parameters(), whole_policy.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(stopped_policy.parameters()), next(whole_policy.parameters()))
    lines = [(result.run_dir / "metrics.jsonl").read_text().splitlines() for result in (resumed, whole)]
    rows = [[{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in run] for run in lines]
    assert rows[0] == rows[1] and len(rows[0]) == 6  # 3 evaluations, 3 steps
    assert resumed.summary["steps"] == 3 and resumed.summary["pairs_seen"] == 5
    assert resumed.summary["pairs_per_s"] == 1.0  # 1 pair in this session's 1 s of loop
    assert resumed.summary["validation_margin"] == whole.summary["validation_margin"]


def test_lora_adapters_and_gradient_checkpointing_come_after_the_reference_and_padded_rows_without_shared_prefix(
        monkeypatch, tmp_path):
    cfg, calls, _, policy, tokenizer = stand_in_run(monkeypatch, tmp_path, lora_r=1, gradient_checkpointing=True,
                                                    shared_prefix=False, max_steps=1)
    result = dpo.train(cfg)
    names = [c[0] for c in calls]
    assert names[names.index("policy") + 1 :] == ["lora", "checkpointing", "evaluate", "step", "evaluate", "save"]
    assert calls[names.index("lora")] == ("lora", policy, cfg, "policy policy-folder")
    assert calls[names.index("checkpointing")] == ("checkpointing", policy, "DPO policy")
    assert calls[names.index("step")][8] is False  # padded rows
    assert calls[-1] == ("save", policy, tokenizer, result.run_dir, True)  # the LoRA adapters merged


def test_shared_precompute_passes_the_row_layout_on(monkeypatch):
    seen = []
    monkeypatch.setattr(dpo, "precompute_logps", lambda *a: seen.append(a) or POLICY)
    model = object()
    assert dpo.shared_precompute(model, BATCH[:2], PAD, True, parallel.SINGLE) == POLICY
    assert seen == [(model, BATCH[:2], PAD, True)]


def test_summary_pairs_per_second_is_rounded_to_one_decimal():
    progress = {"step": 3, "pairs_seen": 24, "first": {}, "last_eval": {}, "last": {}, "skipped": 0, "budget_stop": None}
    walls = {"setup": 0.0, "loop": 3.0, "evaluation": 0.0, "save": 0.0}
    assert dpo.summary_fields(dpo_cfg(), dpo_data(), progress, walls, 0.0, 4)["pairs_per_s"] == 6.7  # 20 / 3


def test_the_run_hands_its_world_settings_callbacks_and_verifier_on_or_writes_to_a_given_folder(monkeypatch, tmp_path):
    cfg, calls, *_ = stand_in_run(monkeypatch, tmp_path, max_steps=1)
    spied = []
    for owner, name in ((dpo, "check_dpo_config"), (dpo, "precision_from_config"), (dpo, "reference_logps"),
                        (dpo, "open_run"), (dpo, "make_optimizer"), (parallel, "wrap_model"),
                        (parallel.World, "check_same"), (parallel.Wrapped, "prepare")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _n=name, _f=real, **k: spied.append((_n, a, k)) or _f(*a, **k))
    callbacks, verifier = (Callback(),), object()
    dpo.train(cfg, given=Given(verifier=verifier, callbacks=callbacks))
    seen = {name: (a, k) for name, a, k in spied}
    world, wrapped = seen["check_dpo_config"][0][1], seen["prepare"][0][0]
    assert seen["check_dpo_config"] == ((cfg, world), {}) and calls[4][3:] == (world, verifier)
    assert seen["precision_from_config"] == ((cfg, world.device, "none"), {})
    assert seen["check_same"] == ((world, TRAIN_PAIRS, "the tokenised training pairs"), {})
    assert seen["reference_logps"][0][4] is world and seen["wrap_model"][0][1:] == (world, cfg.parallel_strategy)
    assert seen["open_run"] == ((cfg, "dpo", wrapped.layout, callbacks), {})
    assert seen["make_optimizer"][1] == {"fused": True} and seen["prepare"][0][2] == cfg.max_grad_norm
    # SimPO (no reference) into a given folder, its one step dropped as non-finite, a time budget under 1 s
    given, simpo = RunDir(tmp_path / "given"), replace(cfg, loss_type="simpo", nonfinite="skip", max_seconds=0.5)
    spied.clear()
    monkeypatch.setattr(dpo, "clip_and_step", lambda *a, **k: None)
    summary = dpo.train(simpo, given).summary
    assert "open_run" not in {name for name, *_ in spied} and summary["nonfinite"] == {"mode": "skip",
                                                                                       "skipped_updates": 1}
    rows = [json.loads(line) for line in (given.path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[1]["nonfinite/skipped_updates"] == 1  # start, step 1, its evaluation
    assert summary["budget_stop"] == {"max_seconds": 0.5, "step": 1, "episode": 2}


def test_the_progress_bar_counts_the_steps_shows_only_when_asked_and_carries_the_logged_numbers(monkeypatch, tmp_path):
    bars = recording_bars(monkeypatch, dpo)
    for progress in (True, False):
        cfg, *_ = stand_in_run(monkeypatch, tmp_path / str(progress), progress=progress)
        dpo.train(cfg)
    shown = dict(desc=f"dpo ({cfg.loss_type})", unit="step")
    assert [(bar.steps, bar.shown) for bar in bars] == [([1, 2, 3], {**shown, "disable": False}),
                                                         ([1, 2, 3], {**shown, "disable": True})]
    rows = [json.loads(line) for line in (tmp_path / "True" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert bars[0].postfixes == [dict(loss=f"{r['loss']:.3f}", acc=f"{r['rewards/accuracies']:.2f}")
                                 for r in rows if "loss" in r] and len(bars[0].postfixes) == 3
    assert not bars[0].closed  # closed early only when the time budget ends the run
