"""SFT's pieces on a 1-layer Llama over 6 tokens and stand-ins (trainers/sft.py): the completion loss against a naive
per-sequence sum, micro-batches, one step's gradient, the held-out slice, the batch order, the data sources (issue 36)."""

import json
import math
import random
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from stage_stubs import PAD, RecordingWrapped, captured_step, recorded_run_setup, recording_bars, tiny_llama
from tinyhf import build

from rlhflab import data, parallel
from rlhflab.callbacks import Callback
from rlhflab.config import SFTConfig
from rlhflab.models.precision import MixedPrecision
from rlhflab.tracking import RunDir
from rlhflab.trainers import sft
from rlhflab.trainers.given import Given

# prompt + completion of 5, 2 + 3, 4 + 1 and 3 + 2 tokens (the completions end with EOS 1)
EXAMPLES = [data.TokenizedSFT([5, 3], [4, 2, 1]), data.TokenizedSFT([5, 4, 2, 3], [1]),
            data.TokenizedSFT([5], [3, 4, 2, 2, 1]), data.TokenizedSFT([5, 2, 3], [4, 1])]
LENGTHS = [5, 5, 6, 5]


def naive_loss_sum(model, examples) -> torch.Tensor:
    """Each sequence alone through the HF forward: minus the summed log-probs of its completion tokens."""
    total = torch.zeros(())
    for e in examples:
        ids = e.prompt_ids + e.completion_ids
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        picked = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        total = total - picked[len(e.prompt_ids) - 1 :].sum()
    return total


def test_the_completion_loss_padded_or_packed_is_the_naive_per_sequence_sum():
    model = tiny_llama()
    expected = naive_loss_sum(model, EXAMPLES)
    padded = sft.completion_loss_sum(model, data.collate_sft(EXAMPLES, PAD))
    (packed,) = sft.micro_batches(EXAMPLES, PAD, 1, packing=True)
    assert padded.item() == pytest.approx(expected.item(), abs=1e-5)
    assert sft.packed_loss_sum(model, packed).item() == pytest.approx(expected.item(), abs=1e-5)
    assert packed.num_label_tokens == 11


def test_padded_micro_batches_are_cut_from_the_examples_sorted_by_length():
    batches = sft.micro_batches(EXAMPLES, PAD, 3, packing=False)  # 4 examples in 3 parts: 2 per micro-batch
    assert [b.input_ids.tolist() for b in batches] == [
        [[5, 3, 4, 2, 1], [5, 4, 2, 3, 1]], [[5, 2, 3, 4, 1, PAD], [5, 3, 4, 2, 2, 1]]]
    assert [b.num_label_tokens for b in batches] == [4, 7]


def test_packed_micro_batches_hold_whole_rows_no_longer_than_the_longest_sequence():
    # rows of at most 6 tokens hold one sequence each (5 + 5 > 6), longest first; 4 rows in 2 parts
    batches = sft.micro_batches(EXAMPLES, PAD, 2, packing=True)
    assert [b.input_ids.tolist() for b in batches] == [[[5, 3, 4, 2, 2, 1], [5, 3, 4, 2, 1, PAD]],
                                                       [[5, 4, 2, 3, 1], [5, 2, 3, 4, 1]]]
    assert [b.num_label_tokens for b in batches] == [8, 3]
    assert [b.input_ids.tolist() for b in sft.micro_batches(EXAMPLES, PAD, 4, packing=True)] == [
        [[5, 3, 4, 2, 2, 1]], [[5, 3, 4, 2, 1]], [[5, 4, 2, 3, 1]], [[5, 2, 3, 4, 1]]]


@pytest.mark.parametrize("packing", [False, True])
def test_a_step_s_gradient_is_the_summed_completion_loss_over_the_step_s_tokens(monkeypatch, packing):
    model = tiny_llama()
    (naive_loss_sum(model, EXAMPLES) / 11).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    calls = captured_step(monkeypatch, sft, torch.tensor(1.5))
    wrapped, optimizer, scheduler, precision = RecordingWrapped(model), object(), object(), MixedPrecision()
    cfg = SFTConfig(gradient_accumulation_steps=2, max_grad_norm=0.3, nonfinite="skip")
    stats = sft.train_step(wrapped, optimizer, scheduler, EXAMPLES, PAD, cfg, packing, precision)
    (call,) = calls
    assert wrapped.syncs == [False, True]  # gradients cross ranks after the last micro-batch only
    assert call["optimizer"] is optimizer and call["scheduler"] is scheduler and call["engine"] is wrapped
    assert call["precision"] is precision and call["params"] == list(model.parameters())
    assert (call["max_grad_norm"], call["mode"], call["stage"]) == (0.3, "skip", "SFT")
    for got, want in zip(call["grads"], expected):
        assert torch.allclose(got, want, atol=1e-6)
    naive = naive_loss_sum(model, EXAMPLES).item() / 11
    assert call["loss"] == pytest.approx(naive, abs=1e-6)
    assert stats == pytest.approx({"loss/sft": naive, "grad_norm": 1.5, "tokens": 11, "skipped": False}, abs=1e-6)


def test_a_dropped_step_says_so_unless_fp16_s_scaler_skipped_it(monkeypatch):
    captured_step(monkeypatch, sft, None)
    layouts, micro_batches = [], sft.micro_batches
    monkeypatch.setattr(sft, "micro_batches", lambda *a: layouts.append(a[3]) or micro_batches(*a))
    wrapped = RecordingWrapped(tiny_llama())
    stats = sft.train_step(wrapped, None, None, EXAMPLES[:1], PAD, SFTConfig())
    assert layouts == [False]  # padded unless told
    assert math.isnan(stats.pop("grad_norm")) and stats["skipped"] is True and wrapped.syncs == [True]
    overflowed = MixedPrecision()
    overflowed.overflowed = True
    assert sft.train_step(wrapped, None, None, EXAMPLES[:1], PAD, SFTConfig(), False, overflowed)["skipped"] is False


def test_the_validation_loss_is_per_completion_token_over_batches_and_leaves_training_mode():
    model = tiny_llama()
    with torch.no_grad():
        expected = naive_loss_sum(model, EXAMPLES).item() / 11
    assert sft.validation_loss(model, EXAMPLES, PAD, batch_size=3) == pytest.approx(expected, abs=1e-6)
    assert model.training
    assert sft.validation_loss(model, [], PAD) == 0.0


def test_packing_is_used_where_asked_and_the_model_allows_it(caplog):
    llama, gpt2 = tiny_llama(), build("gpt2")
    caplog.clear()
    with caplog.at_level("INFO", logger="rlhflab"):
        assert sft.use_packing(SFTConfig(packing=True), llama) is True
        assert sft.use_packing(SFTConfig(packing=False), llama) is False
        assert caplog.records == []
        assert sft.use_packing(SFTConfig(packing=True), llama, same_passes=True) is False
        assert sft.use_packing(SFTConfig(packing=True), gpt2) is False
    assert [r.getMessage() for r in caplog.records] == [
        "SFT: every backward is a collective (FSDP2 / DeepSpeed); sequences are padded, not packed",
        "SFT: GPT2LMHeadModel is not a Llama / Qwen2 layout without dropout; sequences are padded, not packed"]


@pytest.mark.parametrize("rows, held", [(19, 0), (20, 1), (45, 2), (100, 5)])
def test_a_seeded_twentieth_of_a_user_s_train_file_is_held_out_at_least_one_row(caplog, rows, held):
    examples = [f"row {i}" for i in range(rows)]
    with caplog.at_level("INFO", logger="rlhflab"):
        train, validation = sft.held_out_examples(examples, seed=4)
    order = list(range(rows))
    random.Random(4).shuffle(order)
    kept_out = sorted(order[:held])
    assert validation == [examples[i] for i in kept_out]
    assert train == [e for i, e in enumerate(examples) if i not in kept_out]
    message = (f"no --validation_file and only {rows} rows: no validation loss" if not held else
               f"no --validation_file: {held} of {rows} rows set apart for the validation loss")
    assert [r.getMessage() for r in caplog.records] == [message]
    assert caplog.records[0].levelname == ("WARNING" if not held else "INFO")


def naive_stream(count, batch_size, group_by_length, lengths, seed, batches):
    """batch_stream written out: shuffled passes back to back; a run of k batches sorted by length, cut, shuffled."""
    rng, order, out = random.Random(seed), [], []
    per = batch_size * max(1, group_by_length)
    while len(out) < batches:
        while len(order) < per:
            epoch = list(range(count))
            rng.shuffle(epoch)
            order += epoch
        drawn, order = order[:per], order[per:]
        if group_by_length <= 1:
            out.append(drawn)
            continue
        drawn = sorted(drawn, key=lambda i: lengths[i])
        groups = [drawn[s : s + batch_size] for s in range(0, per, batch_size)]
        rng.shuffle(groups)
        out += groups
    return out[:batches]


@pytest.mark.parametrize("batch_size, group_by_length", [(3, 0), (3, 1), (2, 3), (4, 2)])
def test_batch_stream_is_shuffled_passes_grouped_by_length_when_asked(batch_size, group_by_length):
    lengths = [5, 1, 9, 3, 7, 2, 8]
    stream = sft.batch_stream(lengths, batch_size, group_by_length, random.Random(11))
    got = [next(stream) for _ in range(9)]
    assert got == naive_stream(len(lengths), batch_size, group_by_length, lengths, 11, 9)
    assert all(len(b) == batch_size for b in got)


class RecordingRun:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((dict(metrics), step))


def test_held_out_metrics_are_the_validation_loss_and_the_checker_s_pass_rate(monkeypatch):
    checked = []
    monkeypatch.setattr(sft, "validate_pass_rate", lambda *a: checked.append(a) or {"overall": 0.625})
    model, tokenizer, run, cfg = tiny_llama(), SimpleNamespace(pad_token_id=PAD), RecordingRun(), SFTConfig()
    sft_data = sft.SFTData(EXAMPLES[:1], EXAMPLES, ["row"])
    metrics = sft.held_out_metrics(model, tokenizer, sft_data, cfg, 9, run)
    assert metrics == {"val/loss": sft.validation_loss(model, EXAMPLES, PAD), "val/pass_rate": 0.625}
    assert run.logged == [(metrics, 9)]
    ((got_model, got_tokenizer, rows, verifier, got_cfg, step, got_run),) = checked
    assert (got_model, got_tokenizer, rows, got_cfg, step, got_run) == (model, tokenizer, ["row"], cfg, 9, run)
    assert isinstance(verifier, sft.rewards.CheckerVerifier)
    assert sft.held_out_metrics(model, tokenizer, sft.SFTData([], [], []), cfg, 9, run) == {}
    assert len(run.logged) == 1 and len(checked) == 1  # nothing to measure: nothing logged


class GatheringWrapped:
    def __init__(self, model):
        self.model, self.world = model, parallel.SINGLE

    @contextmanager
    def gathered(self):
        yield self.model


def test_evaluate_now_measures_the_whole_model_on_the_main_process(monkeypatch):
    calls = []
    monkeypatch.setattr(sft, "held_out_metrics", lambda *a: calls.append(a) or {"val/loss": 1.5})
    whole, tokenizer, sft_data, cfg, run = object(), object(), object(), object(), object()
    assert sft.evaluate_now(GatheringWrapped(whole), tokenizer, sft_data, cfg, 4, run) == {"val/loss": 1.5}
    assert calls == [(whole, tokenizer, sft_data, cfg, 4, run)]


def stand_in_sources(monkeypatch):
    calls = []
    monkeypatch.setattr(sft.data, "load_examples",
                        lambda path, kind, **k: calls.append(("load", path, kind, k)) or [f"{path} {i}" for i in range(25)])
    monkeypatch.setattr(sft.sources, "sft_demonstrations", lambda cfg: calls.append(("demos", cfg)) or ["demo"])
    monkeypatch.setattr(sft.sources, "validation_references",
                        lambda cfg: calls.append(("references", cfg)) or (["reference"], ["r1", "r2", "r3"]))
    monkeypatch.setattr(sft.data, "tokenize_sft", lambda examples, tokenizer, n: [(e, tokenizer, n) for e in examples])
    return calls


LOADING = {"tokenizer": "TOK", "max_prompt_tokens": 12, "strict": True, "config": "cfg-name"}


def test_sft_data_from_a_user_s_train_and_validation_files(monkeypatch):
    calls = stand_in_sources(monkeypatch)
    cfg = SFTConfig(train_file="train.jsonl", validation_file="val.jsonl", dataset_split="dev", max_prompt_tokens=12,
                    strict=True, dataset_config="cfg-name", max_length=30)
    loaded = sft.load_sft_data(cfg, "TOK")
    assert loaded == sft.SFTData([(f"train.jsonl {i}", "TOK", 30) for i in range(25)],
                                 [(f"val.jsonl {i}", "TOK", 30) for i in range(25)], [])
    assert calls == [("load", "train.jsonl", "sft", {**LOADING, "split": "dev"}),
                     ("load", "val.jsonl", "sft", {**LOADING, "split": None})]


def test_a_train_file_alone_gives_up_its_held_out_slice(monkeypatch):
    stand_in_sources(monkeypatch)
    cfg = SFTConfig(train_file="train.jsonl", seed=5, max_length=30)
    train, validation = sft.held_out_examples([f"train.jsonl {i}" for i in range(25)], 5)
    loaded = sft.load_sft_data(cfg, "TOK")
    assert loaded.train == [(e, "TOK", 30) for e in train] and loaded.validation == [(e, "TOK", 30) for e in validation]
    assert len(loaded.validation) == 1 and loaded.validation_rows == []


def test_the_suite_s_demonstrations_with_its_validation_split_or_a_validation_file(monkeypatch):
    calls = stand_in_sources(monkeypatch)
    cfg = SFTConfig(eval_prompts=2, max_length=30)
    assert sft.load_sft_data(cfg, "TOK") == sft.SFTData([("demo", "TOK", 30)], [("reference", "TOK", 30)], ["r1", "r2"])
    assert calls == [("demos", cfg), ("references", cfg)]
    calls.clear()
    cfg = SFTConfig(validation_file="val.jsonl", max_length=30, max_prompt_tokens=12, strict=True,
                    dataset_config="cfg-name")
    assert sft.load_sft_data(cfg, "TOK") == sft.SFTData([("demo", "TOK", 30)],
                                                        [(f"val.jsonl {i}", "TOK", 30) for i in range(25)], [])
    assert calls == [("demos", cfg), ("load", "val.jsonl", "sft", {**LOADING, "split": None})]


# --- the run: stand-in loading and data, the 6-token Llama, a clock that ticks 1 s per reading -------------------


def stand_in_run(monkeypatch, tmp_path, folder="run", **fields):
    calls, tokenizer, ticks = [], SimpleNamespace(pad_token_id=PAD), iter(range(80, 10_000))
    sft_data = sft.SFTData(EXAMPLES, EXAMPLES[:2], [])
    model = tiny_llama()
    recorded_run_setup(monkeypatch, sft, calls, tokenizer, clock=lambda: 1.25 * next(ticks))  # 1.25 s a reading
    monkeypatch.setattr(sft, "load_sft_data", lambda *a: calls.append(("data", *a)) or sft_data)
    monkeypatch.setattr(sft, "load_or_build_policy", lambda *a: calls.append(("policy", *a)) or (model, tokenizer))
    monkeypatch.setattr(sft, "save_policy_folder", lambda *a: calls.append(("save", *a)) or tmp_path / folder / "model")
    step, evaluate = sft.train_step, sft.evaluate_now  # run, their arguments recorded
    monkeypatch.setattr(sft, "train_step", lambda *a: calls.append(("step", *a)) or step(*a))
    monkeypatch.setattr(sft, "evaluate_now", lambda *a: calls.append(("evaluate", *a)) or evaluate(*a))
    cfg = SFTConfig(**{"model": "", "output_dir": str(tmp_path / folder), "batch_size": 2, "max_steps": 3,
                       "group_by_length": 2, "learning_rate": 0.05, "warmup_steps": 0, "lr_schedule": "linear",
                       "log_every": 2, "eval_every": 2, "save_every": 2, "threads": 1, "logits_chunk_mib": 7,
                       "seed": 3, "progress": False, "device": "cpu", "gradient_accumulation_steps": 1, **fields})
    return cfg, calls, sft_data, model, tokenizer


def test_an_sft_run_steps_on_its_batches_logs_evaluates_and_summarises(monkeypatch, tmp_path):
    cfg, calls, sft_data, model, tokenizer = stand_in_run(monkeypatch, tmp_path)
    start = [p.detach().clone() for p in model.parameters()]
    result = sft.train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/sft" in r]
    evals = [r for r in rows if "val/loss" in r]
    assert [(r["step"], r["elapsed_s"], r["tokens"]) for r in steps] == [(2, 1.25, steps[0]["tokens"]), (3, 2.5,
                                                                                                       steps[1]["tokens"])]
    assert [r["lr"] for r in steps] == pytest.approx([0.05 / 3, 0.0])  # linear decay over 3 steps
    assert [r["step"] for r in evals] == [2, 3]
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
    # the batches: batch_stream's, grouped by length in runs of 2 batches
    batches = naive_stream(4, 2, 2, LENGTHS, 3, 3)
    step_calls = [c for c in calls if c[0] == "step"]
    assert [c[4] for c in step_calls] == [[EXAMPLES[i] for i in ids] for ids in batches]
    assert steps[-1]["tokens"] == sum(len(EXAMPLES[i].completion_ids) for i in batches[-1])
    precision = step_calls[0][-1]
    assert isinstance(precision, MixedPrecision)
    assert all(c[1:] == (c[1], step_calls[0][2], step_calls[0][3], c[4], PAD, cfg, True, precision) for c in step_calls)
    evaluations = [c for c in calls if c[0] == "evaluate"]
    assert [(c[3], c[4], c[5], c[7]) for c in evaluations] == [(sft_data, cfg, 2, precision), (sft_data, cfg, 3, precision)]
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step-2", "step-3"]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert result.summary == summary and result.model_dir == tmp_path / "run" / "model"
    assert {k: summary[k] for k in ("stage", "final_loss", "validation", "wall_time_s", "model_dir", "nonfinite",
                                    "packing", "precision", "parallel")} == {
        "stage": "sft", "final_loss": steps[-1]["loss/sft"], "validation": {"val/loss": evals[-1]["val/loss"]},
        "wall_time_s": {"sft": 3.8}, "model_dir": str(result.model_dir), "nonfinite": {"mode": "stop", "skipped_updates": 0},
        "packing": True, "precision": MixedPrecision().describe(),
        "parallel": {"strategy": "none", "world_size": 1, "sharded_state": False, "backend": None, "device": "cpu"}}
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    world_device = torch.device("cpu")
    assert [c for c in calls if c[0] not in ("step", "evaluate")] == [
        ("threads", 1), ("logits_chunks", 7), ("seed", 3, False), ("policy", cfg), ("data", cfg, tokenizer),
        ("save", model, tokenizer, result.run_dir, False)]
    assert next(model.parameters()).device == world_device


def test_a_given_model_s_data_is_read_with_its_tokenizer_before_it_loads(monkeypatch, tmp_path):
    cfg, calls, _, model, tokenizer = stand_in_run(monkeypatch, tmp_path, model="sft-folder", tokenizer="tok-folder",
                                                   trust_remote_code=True, gradient_checkpointing=True, max_steps=1,
                                                   packing=False, lora_r=1)
    result = sft.train(cfg)
    names = [c[0] for c in calls]
    assert names == ["threads", "logits_chunks", "seed", "tokenizer", "data", "policy", "checkpointing", "step",
                     "evaluate", "save"]
    assert calls[3] == ("tokenizer", ("tok-folder",), {"trust_remote_code": True})
    assert calls[4] == ("data", cfg, tokenizer)  # read with the given model's tokenizer, before the model loads
    assert calls[6] == ("checkpointing", model, "SFT model") and calls[7][7] is False  # padded, not packed
    assert calls[-1] == ("save", model, tokenizer, result.run_dir, True)


@pytest.mark.parametrize("field", ["max_steps", "batch_size", "gradient_accumulation_steps"])
def test_an_sft_run_refuses_a_zero_length_batch_or_accumulation(monkeypatch, tmp_path, field):
    cfg, calls, *_ = stand_in_run(monkeypatch, tmp_path, **{field: 0})
    with pytest.raises(sft.UserInputError) as refused:
        sft.train(cfg)
    assert (refused.value.what, refused.value.where) == (
        "max_steps, batch_size and gradient_accumulation_steps must be >= 1", "sft config")
    sft.train(stand_in_run(monkeypatch, tmp_path, folder="ones", max_steps=1, batch_size=1,
                           gradient_accumulation_steps=1)[0])


def test_an_sft_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(monkeypatch, tmp_path):
    cfg, _, _, first, _ = stand_in_run(monkeypatch, tmp_path, max_steps=2, lr_schedule="constant", save_every=0)
    monkeypatch.setattr(MixedPrecision, "state_dict", lambda self: {"scale": 7.0})  # as fp16's scaler would keep
    sft.train(cfg)
    cfg, calls, _, resumed_model, _ = stand_in_run(monkeypatch, tmp_path, resume="latest", allow_config_change=True,
                                                   lr_schedule="constant", save_every=0)
    loaded, savers, checkpointer = [], [], sft.checkpointer
    monkeypatch.setattr(MixedPrecision, "load_state_dict", lambda self, state: loaded.append(state))
    monkeypatch.setattr(sft, "checkpointer", lambda *a: savers.append(a) or checkpointer(*a))
    resumed = sft.train(cfg)
    assert loaded == [{"scale": 7.0}] and savers[0][2].step == 2 and isinstance(savers[0][4], torch.optim.AdamW)
    resumed_batches = [c[4] for c in calls if c[0] == "step"]
    cfg, _, _, whole_model, _ = stand_in_run(monkeypatch, tmp_path, folder="whole", lr_schedule="constant",
                                             save_every=0)
    whole = sft.train(cfg)
    for a, b in zip(resumed_model.parameters(), whole_model.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(first.parameters()), next(whole_model.parameters()))
    assert resumed_batches == [[EXAMPLES[i] for i in naive_stream(4, 2, 2, LENGTHS, 3, 3)[2]]]  # step 3's batch
    assert resumed.summary["final_loss"] == whole.summary["final_loss"]
    assert resumed.summary["validation"] == whole.summary["validation"]


def test_an_sft_run_hands_its_world_and_settings_on_counts_dropped_steps_and_resumes_the_count(monkeypatch, tmp_path):
    cfg, calls, sft_data, model, _ = stand_in_run(monkeypatch, tmp_path, max_steps=2, nonfinite="skip", save_every=0)
    spied = []
    for owner, name in ((sft, "precision_from_config"), (sft, "open_run"), (sft, "make_optimizer"), (sft, "use_packing"),
                        (parallel, "wrap_model"), (parallel.World, "check_same"), (parallel.Wrapped, "prepare"),
                        (type(model), "to")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _n=name, _f=real, **k: spied.append((_n, a, k)) or _f(*a, **k))
    monkeypatch.setattr(sft, "clip_and_step", lambda *a, **k: None)  # every step dropped as non-finite
    callbacks = (Callback(),)
    summary = sft.train(cfg, given=Given(callbacks=callbacks)).summary
    seen = {name: (a, k) for name, a, k in spied}
    world, wrapped = seen["check_same"][0][0], seen["prepare"][0][0]
    assert seen["precision_from_config"] == ((cfg, world.device, "none"), {}) and seen["to"] == ((model, world.device), {})
    assert seen["check_same"] == ((world, sft_data.train, "the tokenised SFT training data"), {})
    assert seen["wrap_model"] == ((model, world, cfg.parallel_strategy), {})
    assert seen["use_packing"] == ((cfg, model, False), {}) and seen["open_run"] == ((cfg, "sft", wrapped.layout, callbacks), {})
    assert seen["make_optimizer"][1] == {"fused": True} and seen["prepare"][0][2] == cfg.max_grad_norm
    assert summary["nonfinite"] == {"mode": "skip", "skipped_updates": 2}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite/skipped_updates"] for r in rows if "loss/sft" in r] == [2]  # logged at step 2
    cfg, *_ = stand_in_run(monkeypatch, tmp_path, resume="latest", allow_config_change=True, nonfinite="skip",
                           save_every=0)
    assert sft.train(cfg).summary["nonfinite"] == {"mode": "skip", "skipped_updates": 3}  # 2 before the resume
    given = RunDir(tmp_path / "given")
    spied.clear()
    assert sft.train(stand_in_run(monkeypatch, tmp_path, max_steps=1)[0], given).run_dir == given.path
    assert "open_run" not in {name for name, *_ in spied}


def test_the_progress_bar_counts_the_steps_shows_only_when_asked_and_carries_the_logged_numbers(monkeypatch, tmp_path):
    bars = recording_bars(monkeypatch, sft)
    for progress in (True, False):
        cfg, *_ = stand_in_run(monkeypatch, tmp_path, folder=f"run-{progress}", progress=progress)
        sft.train(cfg)
    assert [(bar.steps, bar.shown) for bar in bars] == [
        ([1, 2, 3], dict(desc="sft", unit="step", disable=False)), ([1, 2, 3], dict(desc="sft", unit="step", disable=True))]
    rows = [json.loads(line) for line in (tmp_path / "run-True" / "metrics.jsonl").read_text().splitlines()]
    expected = []
    for step in (2, 3):  # logged every 2 steps and at the end, evaluated the same
        loss = f"{next(r for r in rows if r['step'] == step and 'loss/sft' in r)['loss/sft']:.3f}"
        held_out = next(r for r in rows if r["step"] == step and "val/loss" in r)
        expected += [dict(loss=loss), dict(loss=loss, **{k.replace("/", "_"): f"{v:.3f}" for k, v in held_out.items()
                                                         if k.startswith("val/")})]
    assert bars[0].postfixes == expected and len(expected[1]) > 1
