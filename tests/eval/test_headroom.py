"""The headroom probe: pass@k against hand-worked numbers, the words for a family with nothing to reinforce,
the probe on a tiny model, the online loop writing RUN/headroom.json and its report section, `rlhflab eval`."""

import itertools
import json
from math import comb

import pytest
import torch
from tinyhf import save_suite_model

from rlhflab import sources, tasks
from rlhflab.cli import main
from rlhflab.config import PPOConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.report import write_report
from rlhflab.rewards import Check
from rlhflab.trainers import ppo
from rlhflab.trainers.headroom import (family_headroom, format_headroom, headroom_verdict, headroom_words, pass_at_k,
                                       probe_from_verdicts, probe_headroom)
from rlhflab import models
from rlhflab.intervals import paired_difference

ZERO_WORDS = "RL from this model cannot be expected to help here; improve SFT or the data"


# --- pass@k ------------------------------------------------------------------------------------------------------


def test_pass_at_k_hand_worked_values():
    assert pass_at_k(4, 1, 4) == 1.0  # n = k: any of the k samples passes
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # 1 - C(6,4)/C(8,4) = 55/70
    assert pass_at_k(8, 2, 4) == pytest.approx(0.7857142857)
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 is c / n
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3 of 5 include a pass
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass():
    """The naive version: enumerate every k of the n samples (Chen et al.'s definition, drawn without replacement)."""
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                naive = sum(any(s) for s in subsets) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12), (n, c, k)


# --- one family's rates and words ----------------------------------------------------------------------------------


def test_family_rates_hand_worked():
    h = family_headroom("yes_no", greedy=[False, False, True],
                        sampled=[[True, False, False, False], [False] * 4, [True, True, False, False]])
    assert (h.prompts, h.samples_per_prompt, h.prompts_with_pass, h.passing_samples) == (3, 4, 2, 3)
    assert h.greedy_pass_at_1 == pytest.approx(1 / 3)
    assert h.sampled_pass_at_1 == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)  # 0.25
    assert h.pass_at_k == pytest.approx(2 / 3)
    assert h.status == "room" and not h.no_headroom
    assert headroom_words(h) == ("yes_no: pass@4 67% against greedy 33% — sampled answers pass where greedy ones "
                                 "fail: headroom for RL")


def test_a_family_no_sample_passes_is_said_to_have_nothing_for_rl():
    h = family_headroom("sum_result", greedy=[False] * 9, sampled=[[False] * 8] * 9)
    assert h.no_headroom and h.status == "none" and h.pass_at_k == 0.0
    assert headroom_words(h) == f"sum_result: 0 of 8 samples pass on any of its 9 prompts — {ZERO_WORDS}"
    one = family_headroom("sum_result", greedy=[False], sampled=[[False] * 4])
    assert headroom_words(one) == f"sum_result: 0 of 4 samples pass on any of its 1 prompt — {ZERO_WORDS}"


@pytest.mark.parametrize("prompts, passing, flagged", [
    (10, 1, True),  # pass@k 10 % but one prompt: fewer than 2 prompts with any pass
    (10, 2, False),  # two prompts, 20 %
    (120, 2, True),  # two prompts but pass@k 1.7 % < 2 %
    (120, 3, False),  # 2.5 %
    (1, 1, False),  # a family probed on one prompt that passes: it cannot have two
])
def test_near_zero_is_below_2_percent_or_under_2_prompts(prompts, passing, flagged):
    sampled = [[True, False]] * passing + [[False, False]] * (prompts - passing)
    h = family_headroom("comma_list", greedy=[False] * prompts, sampled=sampled)
    assert h.no_headroom is flagged
    assert (ZERO_WORDS in headroom_words(h)) is flagged
    if flagged:
        assert headroom_words(h).startswith(f"comma_list: only {passing} of {prompts} prompts had a passing sample")


def test_a_family_already_passing_greedily_is_at_its_ceiling():
    h = family_headroom("uppercase", greedy=[True] * 9 + [False], sampled=[[True, True]] * 10)
    assert h.status == "ceiling" and "little left for RL to gain" in headroom_words(h)


def test_probe_groups_rows_by_family_and_lists_those_without_headroom():
    rows = [PromptRow("a", {"family": "yes_no"}), PromptRow("b", {"family": "sum_result"}),
            PromptRow("c", {"family": "yes_no"}), PromptRow("d", {"family": "sum_result"})]
    probe = probe_from_verdicts(rows, [True, False, False, False],
                                [[True, True], [False, False], [True, False], [False, False]])
    assert probe["no_headroom"] == ["sum_result"]
    assert probe["per_family"]["yes_no"]["pass_at_k"] == 1.0 and probe["per_family"]["yes_no"]["status"] == "room"
    assert probe["overall"]["pass_at_k"] == 0.5 and probe["overall"]["greedy_pass_at_1"] == 0.25
    assert probe["overall"]["sampled_pass_at_1"] == pytest.approx((1 + 0 + 0.5 + 0) / 4)


def test_verdict_reads_each_familys_gain_against_its_headroom():
    probe = {"per_family": {
        "sum_result": {"samples_per_prompt": 8, "pass_at_k": 0.0, "greedy_pass_at_1": 0.0, "status": "none"},
        "yes_no": {"samples_per_prompt": 8, "pass_at_k": 0.4, "greedy_pass_at_1": 0.1, "status": "room"},
        "lowercase": {"samples_per_prompt": 8, "pass_at_k": 0.9, "greedy_pass_at_1": 0.3, "status": "room"},
        "uppercase": {"samples_per_prompt": 8, "pass_at_k": 1.0, "greedy_pass_at_1": 1.0, "status": "ceiling"},
        "comma_list": {"samples_per_prompt": 8, "pass_at_k": 0.0, "greedy_pass_at_1": 0.0, "status": "none"},
        "number_only": {"samples_per_prompt": 8, "pass_at_k": 1.0, "greedy_pass_at_1": 1.0, "status": "ceiling"},
    }}
    # (before, after, fixed, broken) of 30 test prompts per family; e.g. 15 fixed / 0 broken: Agresti-Min centre
    # 15 / 32, half-width 1.96 sqrt(16 - 15² / 32) / 32 = .1834 -> [+28.5, +65.2]
    counts = {"sum_result": (0.0, 0.0, 0, 0), "yes_no": (0.1, 0.2, 4, 1), "lowercase": (0.3, 0.8, 15, 0),
              "uppercase": (1.0, 1.0, 0, 0), "comma_list": (0.0, 0.3, 9, 0), "number_only": (1.0, 0.6, 0, 12)}
    # number_only: 12 broken, Agresti-Min centre -12 / 32, half-width 1.96 sqrt(13 - 12² / 32) / 32 = .1786
    changes = {f: {"before": b, "after": a, **paired_difference(fixed, broken, 30).as_difference()}
               for f, (b, a, fixed, broken) in counts.items()}
    lines = headroom_verdict(probe, changes, "ppo")
    assert lines == [  # the surprises first, one line each; then one line per expected kind
        "ppo: number_only 100% → 60% (-40.0 pts [-55.4, -19.6]) — worse beyond noise: the reward pays for answers "
        "of this family that the checker fails (read its samples against their rewards), or the KL leash is too "
        "loose",
        "ppo: yes_no had headroom (pass@8 40%, greedy 10%) but did not move beyond noise: yes_no 10% → 20% "
        "(+10.0 pts [-5.3, +24.0]) — look at the reward, or evaluate on more prompts",
        "ppo: comma_list 0% → 30% (+30.0 pts [+11.4, +44.9]) although its pass@8 was 0% — passes the probe did not "
        "see (probe more prompts or samples)",
        "ppo: moved beyond noise where there was headroom: lowercase 30% → 80% (+50.0 pts [+28.5, +65.2]), pass@8 90%",
        "ppo: did not move, as expected: nothing to reinforce: sum_result 0% → 0% (+0.0 pts [-6.1, +6.1]), pass@8 0%",
        "ppo: did not move, already passing: little left to gain: uppercase 100% → 100% (+0.0 pts [-6.1, +6.1]), "
        "greedy 100%",
    ]
    assert headroom_verdict(probe, {}, "ppo") == []  # no per-family changes: nothing to say


# --- the probe on a tiny model ---------------------------------------------------------------------------------------


class FamilyVerifier:
    """Passes every answer of the named families, fails the rest; records what it was asked."""

    name = "by-family"

    def __init__(self, passing: set[str]):
        self.passing = passing
        self.calls: list[list[str]] = []

    def __call__(self, prompts, completions, rows, ended_with_eos=None):
        self.calls.append(list(prompts))
        return [Check(r.family in self.passing, "pass" if r.family in self.passing else "fail") for r in rows]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def suite_rows(split: str, n: int) -> list[PromptRow]:
    return sources.suite_prompts(tasks.build_splits(0, 22, 11, 11)[split], split)[:n]


def test_probe_answers_each_prompt_greedily_once_and_k_times_sampled(policy_dir):
    model, tokenizer = models.load_causal_lm(policy_dir), models.load_tokenizer(policy_dir)
    model.train()
    rows = suite_rows("validation", 6)
    families = sorted({r.family for r in rows})
    verifier = FamilyVerifier({families[0]})
    rng = torch.get_rng_state()
    probe = probe_headroom(model, tokenizer, rows, verifier, samples_per_prompt=3, temperature=1.0, max_new_tokens=4)
    assert torch.equal(torch.get_rng_state(), rng) and model.training  # the caller's RNG and mode untouched
    greedy_call, sampled_call = verifier.calls
    assert greedy_call == [r.prompt for r in rows]
    assert sampled_call == [r.prompt for r in rows for _ in range(3)]  # each prompt's samples contiguous
    assert probe["per_family"][families[0]]["pass_at_k"] == 1.0
    assert probe["per_family"][families[0]]["sampled_pass_at_1"] == 1.0
    assert probe["no_headroom"] == families[1:]
    assert probe["prompts"] == 6 and probe["samples_per_prompt"] == 3 and probe["split"] == "validation"
    table = format_headroom(probe)
    assert "pass@3" in table and f"{families[1]}: 0 of 3 samples pass on any of its" in table


# --- the online loop, its report section, and `rlhflab eval` ----------------------------------------------------------


def tiny_ppo(policy_dir, out, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, batch_size=8, num_mini_batches=1, num_ppo_epochs=1, response_length=6,
                total_episodes=8, eval_every=0, eval_prompts=4, sample_prompts=2, max_new_tokens=6,
                num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False,
                threads=1, headroom_samples=4, output_dir=str(out), save_every=0)
    return PPOConfig(**{**base, **overrides})


def test_online_run_writes_the_start_policys_headroom_and_the_report_shows_it(policy_dir, tmp_path):
    result = ppo.train(tiny_ppo(policy_dir, tmp_path / "run", headroom_prompts=6))
    probe = json.loads((result.run_dir / "headroom.json").read_text())
    expected = suite_rows("validation", 6)
    assert probe["prompts"] == 6 and probe["samples_per_prompt"] == 4 and probe["split"] == "validation"
    assert sum(h["prompts"] for h in probe["per_family"].values()) == 6
    assert set(probe["per_family"]) == {r.family for r in expected}
    assert probe["max_new_tokens"] == 6  # the rollouts' cap
    html = write_report(result.run_dir).read_text()
    assert "Headroom before RL" in html and 'id="headroom"' in html
    assert probe["no_headroom"]  # an untrained model: families with nothing to reinforce, in words on the page
    assert all(probe["per_family"][family]["words"] in html for family in probe["no_headroom"])
    off = ppo.train(tiny_ppo(policy_dir, tmp_path / "off", headroom_samples=0))
    assert not (off.run_dir / "headroom.json").exists()
    assert "Headroom before RL" not in write_report(off.run_dir).read_text()


def test_eval_command_probes_the_validation_split(policy_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    code = main(["eval", "--model", policy_dir, "--num_train_prompts", "22", "--num_validation_prompts", "11",
                 "--num_test_prompts", "11", "--max_new_tokens", "4", "--samples_per_prompt", "2",
                 "--headroom_prompts", "5", "--out", str(out), "--progress", "false", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "test pass rate" in printed and "headroom probe: 5 validation prompts, 2 samples each" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["split"] == "test" and summary["headroom"]["split"] == "validation"
    assert summary["headroom"]["prompts"] == 5
    assert json.loads((out / "headroom.json").read_text()) == summary["headroom"]
    assert main(["eval", "--model", policy_dir, "--samples_per_prompt", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "samples_per_prompt must be >= 1" in capsys.readouterr().err


def test_online_probe_fields_are_checked_before_loading(tmp_path):
    from rlhflab.config import PPOConfig
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.setup import check_online_config

    for field in ("headroom_prompts", "headroom_samples"):
        with pytest.raises(UserInputError, match=f"{field} must be >= 0"):
            check_online_config(PPOConfig(model=str(tmp_path), **{field: -5}))


# --- the edges (issue 36: mutants of trainers/headroom.py and eval/headroom.py that the cases above let through) ------


def hand_probe() -> dict:
    rows = [PromptRow("a", {"family": "yes_no"}), PromptRow("b", {"family": "sum_result"}),
            PromptRow("c", {"family": "yes_no"})]
    return {"split": "validation", "prompts": 3, "samples_per_prompt": 2, "temperature": 0.7, "seconds": 1.25,
            **probe_from_verdicts(rows, [True, False, False], [[True, True], [False, False], [True, False]])}


def test_the_console_table_of_a_probe():
    assert format_headroom(hand_probe()).splitlines() == [
        "headroom probe: 3 validation prompts, 2 samples each at temperature 0.7 (1.2 s)",
        "headroom     greedy  sampled   pass@2",
        "-" * 37,
        "sum_result       0%       0%       0%   (n=1)   no headroom",
        "yes_no          50%      75%     100%   (n=2)",
        "-" * 37,
        "overall         33%      50%      67%   (n=3)",
        "sum_result: 0 of 2 samples pass on any of its 1 prompt — " + ZERO_WORDS]


def test_the_online_loop_probes_its_first_validation_prompts_when_asked(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from rlhflab.trainers import headroom

    calls = []
    monkeypatch.setattr(headroom, "probe_headroom", lambda *args, **kw: calls.append((args, kw)) or hand_probe())

    class Run:
        written = []

        def write_json(self, name, payload):
            self.written.append((name, payload))

    rows = suite_rows("validation", 6)
    cfg = SimpleNamespace(headroom_samples=4, headroom_prompts=0, eval_prompts=3, temperature=0.9, response_length=7,
                          eval_batch_size=5, seed=11)
    run, verifier = Run(), FamilyVerifier(set())
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        probe = headroom.record_start_headroom("policy", "tokenizer", rows, verifier, cfg, run)
    assert probe == hand_probe() and run.written == [("headroom.json", probe)]
    (args, kw), = calls
    assert args == ("policy", "tokenizer", rows[:3], verifier)  # headroom_prompts 0: the eval_prompts ones
    assert kw == {"samples_per_prompt": 4, "temperature": 0.9, "max_new_tokens": 7, "batch_size": 5, "seed": 11}
    assert "headroom probe: 3 validation prompts" in caplog.text
    calls.clear()
    headroom.record_start_headroom("policy", "tokenizer", rows, verifier, SimpleNamespace(**{**vars(cfg),
                                   "headroom_prompts": 5}), run)
    assert calls[0][0][2] == rows[:5]
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        assert headroom.record_start_headroom("p", "t", rows, None, cfg, run) is None
        assert "headroom probe skipped: no verifier says which answers pass" in caplog.text
        no_prompts = SimpleNamespace(**{**vars(cfg), "eval_prompts": 0})
        assert headroom.record_start_headroom("p", "t", rows, verifier, no_prompts, run) is None
        assert "no validation prompts (eval_prompts 0; set --headroom_prompts N to probe)" in caplog.text
    assert headroom.record_start_headroom("p", "t", [], verifier, cfg, run) is None
    assert headroom.record_start_headroom("p", "t", rows, verifier, SimpleNamespace(**{**vars(cfg), "headroom_samples": 0}),
                                          run) is None
    assert len(calls) == 1 and len(run.written) == 2


def test_the_probe_needs_a_sample_and_a_prompt(policy_dir):
    with pytest.raises(ValueError, match="needs >= 1 sample and >= 1 prompt, got 0, 1"):
        probe_headroom(None, None, suite_rows("validation", 1), FamilyVerifier(set()), samples_per_prompt=0,
                       temperature=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match="got 2, 0"):
        probe_headroom(None, None, [], FamilyVerifier(set()), samples_per_prompt=2, temperature=1.0, max_new_tokens=2)


def test_eval_probes_a_saved_model_into_its_run_folder(policy_dir, tmp_path):
    from rlhflab.config import EvalConfig
    from rlhflab.eval.headroom import check_headroom_fields, probe_saved_model
    from rlhflab.errors import UserInputError
    from rlhflab.tracking import RunDir

    RunDir(tmp_path / "ev").close()
    cfg = EvalConfig(model=policy_dir, num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11,
                     max_new_tokens=2, samples_per_prompt=2, headroom_prompts=3, temperature=0.8, seed=5, threads=1)
    probe = probe_saved_model(cfg, tmp_path / "ev")
    assert (probe["split"], probe["prompts"], probe["samples_per_prompt"], probe["temperature"], probe["seed"]) == (
        "validation", 3, 2, 0.8, 5)
    assert probe["max_new_tokens"] == 2 and sum(h["prompts"] for h in probe["per_family"].values()) == 3
    assert json.loads((tmp_path / "ev" / "headroom.json").read_text()) == probe
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["headroom"] == probe
    whole = probe_saved_model(dataclasses_replace(cfg, headroom_prompts=0, headroom_split="test"), tmp_path / "ev")
    assert (whole["split"], whole["prompts"]) == ("test", 11)
    for field, value, words in [("samples_per_prompt", 0, "samples_per_prompt must be >= 1, got 0"),
                                ("headroom_prompts", -1, "headroom_prompts must be >= 0, got -1")]:
        with pytest.raises(UserInputError, match=words) as refused:
            check_headroom_fields(dataclasses_replace(cfg, **{field: value}))
        assert refused.value.where == f"--{field}"
    check_headroom_fields(dataclasses_replace(cfg, samples_per_prompt=1, headroom_prompts=0))


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_verdict_skips_a_family_without_a_change_and_joins_the_rest_of_a_kind():
    at_ceiling = {"samples_per_prompt": 4, "pass_at_k": 1.0, "greedy_pass_at_1": 0.95, "status": "ceiling"}
    probe = {"per_family": {"lists": at_ceiling, "uppercase": at_ceiling, "yes_no": at_ceiling}}
    level = {"before": 1.0, "after": 1.0, **paired_difference(0, 0, 30).as_difference()}
    lines = headroom_verdict(probe, {"uppercase": level, "yes_no": level}, "grpo")  # lists: no change measured
    assert lines == ["grpo: did not move, already passing: little left to gain: uppercase 100% → 100% (+0.0 pts "
                     "[-6.1, +6.1]), greedy 95%; yes_no 100% → 100% (+0.0 pts [-6.1, +6.1]), greedy 95%"]


def test_eval_hands_the_probe_its_model_settings_and_split(monkeypatch, tmp_path):
    from rlhflab.config import EvalConfig
    from rlhflab.eval import headroom as eval_headroom
    from rlhflab.errors import UserInputError
    from rlhflab.tracking import RunDir

    calls = {}
    monkeypatch.setattr(eval_headroom.models, "load_tokenizer", lambda name, **kw: calls.setdefault("tok", (name, kw)))
    monkeypatch.setattr(eval_headroom.models, "load_causal_lm", lambda name, **kw: calls.setdefault("lm", (name, kw)))
    monkeypatch.setattr(eval_headroom, "eval_prompts", lambda cfg, tok: calls.setdefault("rows", (cfg.split, tok)) and
                        suite_rows("validation", 4))
    monkeypatch.setattr(eval_headroom, "eval_verifier", lambda cfg, rows: "verifier")
    monkeypatch.setattr(eval_headroom, "probe_headroom", lambda *a, **kw: {"rows": len(a[2]), **kw})
    RunDir(tmp_path / "ev").close()
    # trust_remote_code asked for, as a user would: it must reach the (stand-in) loaders; its default stays False
    cfg = EvalConfig(model="m", tokenizer="t", trust_remote_code=True, dtype="bfloat16", device="cpu",
                     headroom_split="train", headroom_prompts=2, samples_per_prompt=3, eval_batch_size=7, seed=9,
                     temperature=0.6, max_new_tokens=5)
    assert eval_headroom.probe_saved_model(cfg, tmp_path / "ev") == {
        "rows": 2, "samples_per_prompt": 3, "temperature": 0.6, "max_new_tokens": 5, "batch_size": 7, "seed": 9,
        "split": "train"}
    assert calls["tok"] == ("t", {"trust_remote_code": True})
    assert calls["lm"][0] == "m" and calls["lm"][1] == {"dtype": "bfloat16", "trust_remote_code": True,
                                                         "device": torch.device("cpu")}
    assert calls["rows"] == ("train", calls["tok"])
    for field, value in [("samples_per_prompt", 0), ("headroom_prompts", -1)]:
        with pytest.raises(UserInputError) as refused:
            eval_headroom.check_headroom_fields(dataclasses_replace(cfg, **{field: value}))
        assert refused.value.fix == {"samples_per_prompt": "1 = no headroom probe; 4 or 8 samples per prompt for one",
                                     "headroom_prompts": "0 = every prompt of the split"}[field]


def test_pass_at_k_and_a_familys_rates_say_what_was_wrong():
    with pytest.raises(ValueError) as refused:
        pass_at_k(4, 1, 5)
    assert str(refused.value) == "pass@k needs 0 <= c <= n and 1 <= k <= n, got n=4 c=1 k=5"
    with pytest.raises(ValueError) as mismatched:  # greedy verdicts given, but not one per prompt of samples
        family_headroom("yes_no", [True], [[True], [False]])
    assert str(mismatched.value) == "yes_no: 1 greedy verdicts for 2 prompts of samples"
    assert hand_probe()["overall"]["family"] == "overall"


def test_sample_verdicts_answers_in_batches_from_a_generator_of_its_own(monkeypatch):
    from types import SimpleNamespace

    from rlhflab.rollout import GenerationSettings
    from rlhflab.trainers import headroom

    calls = {}

    def answers(model, tokenizer, prompts, settings, **kw):
        calls["generate"] = (model, tokenizer, prompts, settings, kw)
        return [SimpleNamespace(text=f"{p}!", ended_with_eos=True) for p in prompts]

    monkeypatch.setattr(headroom, "generate_answers", answers)
    monkeypatch.setattr(headroom, "verify_rows", lambda answered, asked, verifier: [
        {**a, "passed": a["answer"] == "a!"} for a in answered])
    rows = [PromptRow("a", {"family": "yes_no"}), PromptRow("b", {"family": "yes_no"})]
    settings = GenerationSettings(3, True, 0.5)
    assert headroom.sample_verdicts("m", "t", rows, "v", settings, 2, 3, 7) == [[True, True], [False, False]]
    model, tokenizer, prompts, used, kw = calls["generate"]
    assert (model, tokenizer, prompts, used) == ("m", "t", ["a", "a", "b", "b"], settings)
    assert set(kw) == {"batch_size", "generator"} and kw["batch_size"] == 3
    assert torch.equal(kw["generator"].get_state(), torch.Generator().manual_seed(7).get_state())


def test_the_probe_decodes_greedily_then_samples_the_full_softmax(monkeypatch):
    from types import SimpleNamespace

    from rlhflab.rollout import GenerationSettings
    from rlhflab.trainers import headroom

    calls = []

    def verdicts(model, tokenizer, rows, verifier, settings, repeats, batch_size, seed):
        calls.append((settings, repeats, batch_size, seed))
        return [[row.prompt == "a"] * repeats for row in rows]

    monkeypatch.setattr(headroom, "sample_verdicts", verdicts)
    monkeypatch.setattr(headroom, "time", SimpleNamespace(time=iter([100.0, 101.23456]).__next__))
    rows = [PromptRow("a", {"family": "yes_no"}), PromptRow("b", {"family": "yes_no"})]
    probe = headroom.probe_headroom("m", "t", rows, "v", samples_per_prompt=1, temperature=0.7, max_new_tokens=5)
    greedy, sampled = calls  # one sample per prompt is allowed: the defaults batch 100 answers, seed 0
    assert greedy == (GenerationSettings(5, False, 1.0, 0, 1.0), 1, 100, 0) and greedy[0].do_sample is False
    assert sampled == (GenerationSettings(5, True, 0.7, 0, 1.0), 1, 100, 0) and sampled[0].do_sample is True
    assert probe["thresholds"] == {"min_pass_at_k": 0.02, "min_prompts_with_pass": 2, "ceiling": 0.9}
    assert (probe["seed"], probe["seconds"], probe["overall"]["pass_at_k"]) == (0, 1.23, 0.5)


def test_a_short_family_name_keeps_the_table_eight_wide():
    rows = [PromptRow("a", {"family": "ab"}), PromptRow("b", {"family": "ab"})]
    probe = {"split": "validation", "prompts": 2, "samples_per_prompt": 2, "temperature": 1.0, "seconds": 0.5,
             **probe_from_verdicts(rows, [True, False], [[True, False], [True, True]])}
    lines = format_headroom(probe).splitlines()
    assert lines[1:4] == ["headroom   greedy  sampled   pass@2", "-" * 35,
                          "ab            50%      75%     100%   (n=2)"]


def test_online_probe_fields_take_zero_and_refuse_a_negative_in_words():
    from types import SimpleNamespace

    from rlhflab.errors import UserInputError
    from rlhflab.trainers.headroom import check_probe_fields

    check_probe_fields(SimpleNamespace(headroom_samples=0, headroom_prompts=0))  # off / the eval_prompts ones
    for name in ("headroom_samples", "headroom_prompts"):
        with pytest.raises(UserInputError) as refused:
            check_probe_fields(SimpleNamespace(**{"headroom_samples": 0, "headroom_prompts": 0, name: -1}))
        assert (refused.value.what, refused.value.where, refused.value.fix) == (
            f"{name} must be >= 0, got -1", f"--{name}",
            "headroom_samples 0 turns the probe off; headroom_prompts 0 probes the eval_prompts ones")


def test_the_online_loop_probes_one_prompt_with_one_sample_and_logs_its_table(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from rlhflab.trainers import headroom

    calls = []
    monkeypatch.setattr(headroom, "probe_headroom", lambda *args, **kw: calls.append((args, kw)) or hand_probe())
    run = SimpleNamespace(write_json=lambda name, payload: None)
    rows, verifier = suite_rows("validation", 3), FamilyVerifier(set())
    cfg = SimpleNamespace(headroom_samples=1, headroom_prompts=0, eval_prompts=1, temperature=1.0, response_length=4,
                          eval_batch_size=2, seed=0)
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        assert headroom.record_start_headroom("p", "t", rows, verifier, cfg, run) == hand_probe()
    assert calls[0][0][2] == rows[:1] and calls[0][1]["samples_per_prompt"] == 1
    assert caplog.messages == [format_headroom(hand_probe())]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        headroom.record_start_headroom("p", "t", rows, None, cfg, run)
        headroom.record_start_headroom("p", "t", rows, verifier, SimpleNamespace(**{**vars(cfg), "eval_prompts": 0}),
                                       run)
    assert caplog.messages == [
        "headroom probe skipped: no verifier says which answers pass (pass --verifier)",
        "headroom probe skipped: no validation prompts (eval_prompts 0; set --headroom_prompts N to probe)"]
