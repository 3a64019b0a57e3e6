"""The reward model's data and scoring plumbing with stand-ins (issue 36's mutation run of trainers/reward.py): pairs
tokenised for a decoder or an encoder, the packed scorer's bookkeeping, the policy's sampled answers shared out in
seeded batches, every split's pairs (suite, hard negatives, near misses, calibration rows, a user's files) and
the held-out metrics written beside the saved model."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhflab import data, parallel
from rlhflab.config import RMConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import reward

Pair = reward.TokenizedPair


def test_decoder_pairs_are_prompt_plus_answer_ids_with_the_prompt_s_length(monkeypatch):
    seen = []

    def tokenize_sft(examples, tokenizer, max_length):
        seen.append(([(e.prompt, e.completion, e.family, e.violation) for e in examples], tokenizer, max_length))
        return [data.TokenizedSFT([7, len(e.prompt)], [len(e.completion), 1]) for e in examples]

    monkeypatch.setattr(reward.data, "tokenize_sft", tokenize_sft)
    pairs = [data.PairExample("ab", "c", "dddd", "f", "v"), data.PairExample("xyz", "uv", "w", "g", None)]
    out = reward.tokenize_pairs(pairs, "tok", 9)
    assert seen == [([("ab", "c", "f", "v"), ("ab", "dddd", "f", "v"), ("xyz", "uv", "g", None),
                      ("xyz", "w", "g", None)], "tok", 9)]
    assert out == [Pair([7, 2, 1, 1], [7, 2, 4, 1], "f", "v", prompt_tokens=2),
                   Pair([7, 3, 2, 1], [7, 3, 1, 1], "g", None, prompt_tokens=2)]


def test_encoder_pairs_are_framed_as_the_reward_model_scores_them(monkeypatch):
    seen = []
    monkeypatch.setattr(reward, "encoder_rows", lambda tok, prompts, answers, max_length: seen.append(
        (tok, prompts, answers, max_length)) or [[len(p), len(a)] for p, a in zip(prompts, answers)])
    pairs = [data.PairExample("ab", "c", "dddd", "f", "v"), data.PairExample("xyz", "uv", "w", "g", None)]
    out = reward.tokenize_pairs(pairs, "tok", 9, encoder=True)
    assert seen == [("tok", ["ab", "xyz"], ["c", "uv"], 9), ("tok", ["ab", "xyz"], ["dddd", "w"], 9)]
    assert out == [Pair([2, 1], [2, 4], "f", "v"), Pair([3, 2], [3, 1], "g", None)]  # prompt_tokens unknown: 0


def test_the_packed_scorer_runs_each_prompt_s_distinct_sequences_once_and_hands_each_row_its_two(monkeypatch):
    packed = []
    monkeypatch.setattr(reward.models, "pack_groups", lambda groups, pad: packed.append((groups, pad)) or groups)
    monkeypatch.setattr(reward.models, "grouped_scores", lambda model, groups: torch.tensor(
        [float(sum(s)) for g in groups for s in g], dtype=torch.bfloat16))
    batch = [Pair([5, 1], [5, 2], None, None, prompt_tokens=1), Pair([6, 1], [6, 3], None, None, prompt_tokens=1),
             Pair([5, 2], [5, 4], None, None, prompt_tokens=1),  # prompt 5 again: its [5, 2] is scored once
             Pair([9, 9], [9, 8], None, None)]  # prompt unknown: a group of its own
    chosen, rejected = reward.grouped_pair_scores(None, batch, pad_id=3)
    assert packed == [([[[5, 1], [5, 2], [5, 4]], [[6, 1], [6, 3]], [[9, 9], [9, 8]]], 3)]
    assert chosen.dtype == torch.float32
    assert chosen.tolist() == [6.0, 7.0, 7.0, 18.0] and rejected.tolist() == [7.0, 9.0, 9.0, 17.0]
    monkeypatch.setattr(reward, "grouped_pair_scores", lambda *a: ("grouped", a))
    assert reward.pair_scores("m", batch, 3, chunks=4, shared_prefix=True) == ("grouped", ("m", batch, 3))


def items(*prompts):
    return [SimpleNamespace(prompt=p, reference=f"ref-{p}", family="f") for p in prompts]


def stand_in_sampling(monkeypatch, loaded: list, generated: list):
    monkeypatch.setattr(reward.models, "load_causal_lm", lambda *a, **k: loaded.append((a, k)) or "policy")

    def generate(policy, tokenizer, prompts, settings, batch_size, generator):
        generated.append((policy, tokenizer, prompts, settings, batch_size, torch.randint(1000, (1,), generator=generator).item()))
        return [SimpleNamespace(text=f"{p}-{i}", ended_with_eos=i % 2 == 0) for i, p in enumerate(prompts)]

    monkeypatch.setattr(reward, "generate_answers", generate)

    class Checker:
        def __call__(self, prompts, texts, rows, ended):
            return [SimpleNamespace(passed=e) for e in ended]

    monkeypatch.setattr(reward.rewards, "CheckerVerifier", Checker)
    monkeypatch.setattr(reward, "ANSWER_BATCH", 3)


def draw(seed, stream, batch):
    return torch.randint(1000, (1,), generator=torch.Generator().manual_seed(reward.answer_batch_seed(seed, stream, batch))).item()


def test_the_policy_s_answers_are_sampled_in_seeded_batches_and_checked(monkeypatch):
    loaded, generated = [], []
    stand_in_sampling(monkeypatch, loaded, generated)
    cfg = RMConfig(model="policy-folder", hard_negatives=2, seed=4, dtype="bfloat16", trust_remote_code=True,
                   progress=False, device="cpu")
    answers = reward.sample_policy_answers(cfg, "tok", items("p", "q"), stream="validation")
    assert loaded == [(("policy-folder",), {"dtype": "bfloat16", "trust_remote_code": True,
                                            "device": torch.device("cpu")})]
    assert [(g[0], g[1], g[2], g[4], g[5]) for g in generated] == [
        ("policy", "tok", ["p", "p", "q"], 3, draw(4, "validation", 0)), ("policy", "tok", ["q"], 3, draw(4, "validation", 1))]
    settings = generated[0][3]
    assert (settings.max_new_tokens, settings.do_sample, settings.temperature) == (reward.HARD_NEGATIVE_TOKENS, True, 1.0)
    assert [i.prompt for i in answers.items] == ["p", "p", "q", "q"]
    assert answers.texts == ["p-0", "p-1", "q-2", "q-0"] and answers.passed == [True, False, True, True]


def test_each_process_samples_every_world_size_th_batch_and_all_get_every_answer_in_order(monkeypatch):
    loaded, generated = [], []
    stand_in_sampling(monkeypatch, loaded, generated)
    world = SimpleNamespace(rank=1, world_size=2, distributed=True, device=torch.device("cpu"), is_main=False)
    gathered = []

    def gather(mine, w):
        gathered.append((dict(mine), w))
        return [{0: [("a", True)] * 3, 2: [("c", False)]}, mine]

    monkeypatch.setattr(reward.parallel, "gather_objects", gather)
    cfg = RMConfig(model="policy-folder", hard_negatives=1, seed=4, progress=False, device="cuda")
    answers = reward.sample_policy_answers(cfg, "tok", items("p", "q", "r", "s", "t", "u", "v"), world=world)
    assert loaded[0][1]["device"] == world.device  # the launcher's device, not --device
    assert [(g[2], g[5]) for g in generated] == [(["s", "t", "u"], draw(4, "train", 1))]  # batch 1 of 0, 1, 2
    assert gathered == [({1: [("s-0", True), ("t-1", False), ("u-2", True)]}, world)]
    assert answers.texts == ["a", "a", "a", "s-0", "t-1", "u-2", "c"]
    assert answers.passed == [True, True, True, True, False, True, False]


def test_hard_negatives_are_sampled_from_the_train_split(monkeypatch):
    seen = []
    answers = reward.PolicyAnswers(items("p", "p"), ["x", "ok"], [False, True])
    monkeypatch.setattr(reward, "sample_policy_answers", lambda *a: seen.append(a) or answers)
    pairs = reward.hard_negative_pairs("cfg", "tok", ["item"], "world")
    assert seen == [("cfg", "tok", ["item"], "train", "world")]
    assert [(p.chosen, p.rejected) for p in pairs] == [("ref-p", "x")]


def stand_in_pairs(monkeypatch, calls: list):
    """The suite's splits and pairs, the sampled answers, a user's files and the tokeniser replaced and recorded."""
    splits = {"train": items("t1", "t2"), "validation": items("v1"), "test": items("s1")}
    monkeypatch.setattr(reward.sources, "pair_prompt_sets", lambda cfg: calls.append(("splits",)) or splits)
    monkeypatch.setattr(reward.sources, "suite_pairs", lambda cfg, s: calls.append(("suite", s is splits)) or {
        split: [data.PairExample(i.prompt, "good", "bad", "f", "kind") for i in rows] for split, rows in s.items()})
    monkeypatch.setattr(reward.sources, "near_miss_pairs", lambda cfg, rows: calls.append(("near", rows)) or [
        data.PairExample(rows[0].prompt, "good", "near", "f", "near_miss")])

    def sample(cfg, tokenizer, rows, split, world):
        calls.append(("sample", split, world))
        return reward.PolicyAnswers([rows[0]] * 4, [f"{split}-a", f"{split}-b", f"{split}-a", f"{split}-c"],
                                    [False, True, False, False])

    monkeypatch.setattr(reward, "sample_policy_answers", sample)
    monkeypatch.setattr(reward.data, "load_examples", lambda path, kind, **k: calls.append(("file", path, kind, k)) or [
        data.PairExample(f"from {path}", "c", "r")])
    monkeypatch.setattr(reward, "tokenize_pairs", lambda pairs, tok, max_length, encoder: [
        Pair([1], [2], p.family, p.violation) for p in pairs])
    return splits


def test_the_suite_s_pairs_with_near_misses_hard_negatives_and_calibration_rows(monkeypatch, caplog):
    calls = []
    splits = stand_in_pairs(monkeypatch, calls)
    seen = []
    monkeypatch.setattr(reward, "tokenize_pairs", lambda pairs, tok, max_length, encoder: seen.append(
        ([(p.prompt, p.rejected, p.violation) for p in pairs], tok, max_length, encoder)) or [
        Pair([1], [2], p.family, p.violation) for p in pairs])
    cfg = RMConfig(near_misses=1, hard_negatives=2, calibration_coef=0.5, max_length=11)
    with caplog.at_level("INFO", logger="rlhflab"):
        out = reward.load_pairs(cfg, "tok", encoder=True, world="world")
    assert calls[:3] == [("splits",), ("suite", True), ("near", splits["train"])]
    assert [c for c in calls if c[0] == "sample"] == [("sample", s, "world") for s in ("train", "validation", "test")]
    hard = reward.HARD_NEGATIVE
    assert seen[0] == ([("t1", "bad", "kind"), ("t2", "bad", "kind"), ("t1", "near", "near_miss"),
                        ("t1", "train-a", hard), ("t1", "train-c", hard)], "tok", 11, True)
    assert seen[1][0] == [("v1", "bad", "kind"), ("v1", "validation-a", hard), ("v1", "validation-c", hard)]
    assert seen[3] == ([("t1", "train-b", reward.SAMPLED), ("t1", "train-c", reward.SAMPLED)], "tok", 11, True)
    assert sorted(out) == ["test", "train", "validation"] and len(out["validation"]) == 3
    assert [p.labels for p in out["train"]] == [None] * 5 + [(False, True), (False, False)]
    assert "hard negatives (the policy's failing answers): {'train': 2, 'validation': 2, 'test': 2}" in caplog.text
    assert "calibration rows (two sampled answers each, 25 % of the answers pass): 2" in caplog.text


def test_hard_negatives_without_calibration_add_no_calibration_rows(monkeypatch):
    calls = []
    stand_in_pairs(monkeypatch, calls)
    out = reward.load_pairs(RMConfig(hard_negatives=2), "tok")
    assert all(p.labels is None for p in out["train"]) and len(out["train"]) == 4  # 2 suite pairs, 2 hard negatives
    assert ("near", ) not in [c[:1] for c in calls]


def test_a_user_s_pairs_files_replace_the_suite_s_and_its_test_split_is_dropped(monkeypatch):
    calls = []
    stand_in_pairs(monkeypatch, calls)
    cfg = RMConfig(train_file="pairs.jsonl", validation_file="val.jsonl", max_prompt_tokens=12, strict=True,
                   dataset_split="train[:10]", dataset_config="en")
    out = reward.load_pairs(cfg, "tok")
    files = [c for c in calls if c[0] == "file"]
    common = dict(tokenizer="tok", max_prompt_tokens=12, strict=True, config="en")
    assert files == [("file", "pairs.jsonl", "pairs", {**common, "split": "train[:10]"}),
                     ("file", "val.jsonl", "pairs", {**common, "split": None})]
    assert sorted(out) == ["train", "validation"] and [len(v) for v in out.values()] == [1, 1]
    alone = reward.load_pairs(RMConfig(train_file="pairs.jsonl"), "tok")
    assert sorted(alone) == ["train"]  # no validation file: no validation split, and never the suite's test split


@pytest.mark.parametrize("fields, flag", [(dict(hard_negatives=1, train_file="p.jsonl"), "--hard_negatives"),
                                          (dict(calibration_coef=0.5), "--calibration_coef"),
                                          (dict(near_misses=1, train_file="p.jsonl"), "--near_misses")])
def test_settings_that_need_the_suite_or_sampled_answers_are_refused_before_any_work(monkeypatch, fields, flag):
    calls = []
    stand_in_pairs(monkeypatch, calls)
    with pytest.raises(UserInputError) as refused:
        reward.load_pairs(RMConfig(**fields), "tok")
    assert refused.value.where == flag and calls == []


def test_no_training_pairs_is_refused_naming_the_kinds_to_allow(monkeypatch):
    calls = []
    stand_in_pairs(monkeypatch, calls)
    monkeypatch.setattr(reward.sources, "suite_pairs", lambda cfg, s: {split: [] for split in s})
    with pytest.raises(UserInputError, match="no training pairs") as refused:
        reward.load_pairs(RMConfig(), "tok")
    assert refused.value.where == "--pair_kinds"


def test_held_out_metrics_are_read_on_each_split_s_sample_and_the_model_saved_whole(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(reward, "use_shared_prefix", lambda cfg, model: seen.append(("shared", cfg, model)) or True)
    monkeypatch.setattr(reward, "metric_sample", lambda pairs, split, seed: seen.append(("sample", split, seed)) or pairs[:1])
    monkeypatch.setattr(reward, "evaluate_pairs", lambda model, pairs, pad, shared_prefix: seen.append(
        ("evaluate", model, pairs, pad, shared_prefix)) or {"accuracy": len(pairs)})

    def save(folder, model, tokenizer):
        seen.append(("save", Path(folder).parent, model, tokenizer))
        (Path(folder) / "weights").write_text("w")

    monkeypatch.setattr(reward.models, "save_model_folder", save)
    model, tokenizer, cfg = torch.nn.Linear(2, 1), SimpleNamespace(pad_token_id=5), RMConfig(seed=8)
    pairs = {"train": ["a", "b"], "validation": ["c"]}
    metrics = reward.held_out_and_save(model, tokenizer, pairs, cfg, str(tmp_path / "model"))
    assert metrics == {"train": {"accuracy": 1}, "validation": {"accuracy": 1}}
    assert seen[:5] == [("shared", cfg, model), ("sample", "train", 8), ("evaluate", model, ["a"], 5, True),
                        ("sample", "validation", 8), ("evaluate", model, ["c"], 5, True)]
    assert seen[5] == ("save", tmp_path, model, tokenizer)
    assert (tmp_path / "model" / "weights").read_text() == "w"  # renamed into place whole


def test_the_model_folder_is_written_through_an_atomic_folder_sized_for_its_weights(monkeypatch, tmp_path):
    monkeypatch.setattr(reward, "use_shared_prefix", lambda cfg, model: False)
    monkeypatch.setattr(reward, "evaluate_pairs", lambda *a, **k: {})
    monkeypatch.setattr(reward.models, "save_model_folder", lambda folder, model, tokenizer: None)
    opened = []
    real = reward.atomic_folder
    monkeypatch.setattr(reward, "atomic_folder", lambda *a: opened.append(a) or real(*a))
    model = torch.nn.Linear(3, 2)
    reward.held_out_and_save(model, SimpleNamespace(pad_token_id=0), {"train": []}, RMConfig(), str(tmp_path / "m"))
    assert opened == [(tmp_path / "m", "the final reward model folder", tmp_path, 8 * 4)]  # 8 float32 weights


def test_the_answer_sampling_bar_shows_on_the_main_process_when_asked(monkeypatch):
    from stage_stubs import recording_bars

    stand_in_sampling(monkeypatch, [], [])
    bars = recording_bars(monkeypatch, reward)
    main = SimpleNamespace(rank=0, world_size=1, distributed=False, device=torch.device("cpu"), is_main=True)
    for progress, world in ((True, main), (False, main), (True, SimpleNamespace(**{**vars(main), "is_main": False}))):
        cfg = RMConfig(model="p", hard_negatives=1, progress=progress, device="cpu")
        reward.sample_policy_answers(cfg, "tok", items("p", "q", "r", "s"), stream="test", world=world)
    assert [(bar.steps, bar.shown) for bar in bars] == [
        ([0, 1], dict(desc="sampling test answers", unit="batch", disable=disabled)) for disabled in (False, True, True)]


def test_sampled_answers_are_drawn_with_sampling_on_at_temperature_one(monkeypatch):
    generated = []
    stand_in_sampling(monkeypatch, [], generated)
    reward.sample_policy_answers(RMConfig(model="p", hard_negatives=1, progress=False, device="cpu"), "tok", items("p"))
    settings = generated[0][3]
    assert settings.do_sample is True and settings.temperature == 1.0 and (settings.top_k, settings.top_p) == (0, 1.0)


@pytest.mark.parametrize("fields, refused", [
    (dict(hard_negatives=1, train_file="p.jsonl"), ("hard negatives need the built-in suite's checker", "--hard_negatives",
                                                    "drop --hard_negatives, or add the policy's failing answers to your pairs file")),
    (dict(calibration_coef=0.5), ("the calibration term reads the policy's sampled answers", "--calibration_coef",
                                  "add --hard_negatives 2 (answers sampled per prompt), or drop --calibration_coef")),
    (dict(near_misses=1, train_file="p.jsonl"), ("near misses are built from the built-in suite's items", "--near_misses",
                                                 "drop --near_misses, or add near-miss rejected answers to your pairs file"))])
def test_each_refused_pairs_setting_says_what_where_and_what_to_do(monkeypatch, fields, refused):
    stand_in_pairs(monkeypatch, [])
    with pytest.raises(UserInputError) as error:
        reward.load_pairs(RMConfig(**fields), "tok")
    assert (error.value.what, error.value.where, error.value.fix) == refused


def test_no_training_pairs_says_which_kinds_to_allow(monkeypatch):
    stand_in_pairs(monkeypatch, [])
    monkeypatch.setattr(reward.sources, "suite_pairs", lambda cfg, s: {split: [] for split in s})
    with pytest.raises(UserInputError) as error:
        reward.load_pairs(RMConfig(), "tok")
    assert (error.value.what, error.value.fix) == ("no training pairs", "allow violation kinds the suite's families produce")


def test_the_config_and_tokenizer_reach_every_source_and_decoder_framing_is_the_default(monkeypatch):
    calls = []
    stand_in_pairs(monkeypatch, calls)
    cfg = RMConfig(near_misses=1, hard_negatives=1)
    seen = []
    for name in ("pair_prompt_sets", "suite_pairs", "near_miss_pairs"):
        real = getattr(reward.sources, name)
        monkeypatch.setattr(reward.sources, name, lambda c, *a, _f=real, _n=name: seen.append((_n, c)) or _f(c, *a))
    sample = reward.sample_policy_answers
    monkeypatch.setattr(reward, "sample_policy_answers", lambda c, tok, *a: seen.append(("sample", c, tok)) or
                        sample(c, tok, *a))
    monkeypatch.setattr(reward, "tokenize_pairs", lambda pairs, tok, max_length, encoder: seen.append(
        ("tokenize", tok, encoder)) or [])
    reward.load_pairs(cfg, "tok")
    assert seen[:3] == [("pair_prompt_sets", cfg), ("suite_pairs", cfg), ("near_miss_pairs", cfg)]
    assert [s for s in seen if s[0] == "sample"] == [("sample", cfg, "tok")] * 3
    assert [s for s in seen if s[0] == "tokenize"] == [("tokenize", "tok", False)] * 3  # a decoder's framing
