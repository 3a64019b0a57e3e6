"""Held-out pass rate (eval/pass_rate.py): tables and paired comparisons on hand-made verdicts, the verifier and the
prompts an evaluation reads, and `evaluate` on a tiny model (issue 36: docs/mutation.md lists the mutants these
tests kill)."""

import json
import math

import pytest
import yaml
from tinyhf import save_suite_model

from rlhflab import rewards
from rlhflab.config import EvalConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.eval.pass_rate import (describe_versus, eval_prompts, eval_verifier, evaluate, format_table, interval_of,
                                    paired_versus, paired_versus_by_family, table_from_rows)
from rlhflab.intervals import paired_counts, wilson


def answers(passed: str, families: str = "aabbb") -> list[dict]:
    """'10110' -> rows of those verdicts, family a or b by position."""
    return [{"family": {"a": "lists", "b": "yes_no"}[f], "passed": p == "1", "kind": "pass" if p == "1" else "wrong"}
            for p, f in zip(passed, families)]


def test_each_model_is_paired_with_the_base_on_the_same_prompts():
    runs = {"sft": answers("10100"), "ppo": answers("11110"), "dpo": answers("00100")}
    versus = paired_versus(runs, "sft")
    assert list(versus) == ["ppo", "dpo"]  # the base is not compared with itself
    assert versus["ppo"] == paired_counts([True, False, True, False, False], [True, True, True, True, False])
    assert (versus["ppo"]["fixed"], versus["ppo"]["broken"], versus["dpo"]["broken"]) == (2, 0, 1)
    by_family = paired_versus_by_family(runs, "sft")
    assert list(by_family) == ["ppo", "dpo"] and list(by_family["ppo"]) == ["lists", "yes_no"]
    lists, yes_no = by_family["ppo"]["lists"], by_family["ppo"]["yes_no"]
    assert (lists["before"], lists["after"], lists["fixed"], lists["n"]) == (0.5, 1.0, 1, 2)
    assert (yes_no["before"], yes_no["after"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert yes_no == {"before": pytest.approx(1 / 3), "after": pytest.approx(2 / 3),
                      **paired_counts([True, False, False], [True, True, False])}
    assert by_family["dpo"]["lists"]["broken"] == 1 and by_family["dpo"]["yes_no"]["broken"] == 0


def test_the_verdict_line_of_each_model():
    versus = {"ppo": paired_counts([False] * 10, [True] * 10), "dpo": paired_counts([True, False], [True, False]),
              "old": {"fixed": 1, "broken": 0}}  # written without an interval: no line
    lines = describe_versus(versus, "sft", 10)
    assert lines == ["ppo vs sft: +100.0 pts [+56.7, +100.0], better (paired over 10 test prompts: 10 fixed, 0 broken)",
                     "dpo vs sft: +0.0 pts [-49.0, +49.0], within noise (paired over 10 test prompts: 0 fixed, 0 broken)"]


def test_a_table_written_before_intervals_shows_its_plain_rates():
    rows = answers("10110") + [{"family": "lowercase", "passed": True, "kind": "pass"}]
    table = table_from_rows(rows)
    assert table["intervals"]["overall"] == wilson(4, 6).as_rate()
    assert table["intervals"]["lists"] == wilson(1, 2).as_rate() and table["intervals"]["yes_no"] == wilson(2, 3).as_rate()
    assert interval_of(table) == wilson(4, 6) and interval_of(table, "lowercase") == wilson(1, 1)
    old = {k: v for k, v in table.items() if k != "intervals"}
    assert interval_of(old) is None and interval_of({**old, "intervals": None}) is None
    old["per_family"] = {"lists": 0.5, "yes_no": float("nan")}
    text = format_table({"new": table, "old": old}, title="pass")
    assert text.splitlines() == [
        "pass                      new                 old",
        "-" * 49,
        "lists              50% [9–91]                 50%   (n=2)",
        "lowercase       100% [21–100]                   —   (n=1)",  # no per-family rate in the old table
        "yes_no            67% [21–94]                   —   (n=3)",
        "-" * 49,
        "overall     66.7% [30.0–90.3]               66.7%   (n=6)",
        "[low–high]: 95 % interval of each rate (Wilson)"]
    assert format_table({"empty": {"overall": None, "per_family": {}, "counts": {}}}).splitlines()[3] == (
        "overall                    —   (n=0)")


def test_the_checker_needs_a_family_and_a_reference_in_every_row(tmp_path):
    suite = PromptRow("Say yes.", {"family": "yes_no", "reference": "yes"}, "suite #0")
    bare = [PromptRow("Say a.", {}, "p.jsonl:1"), PromptRow("Say b.", {"family": "yes_no"}, "p.jsonl:2")]
    assert isinstance(eval_verifier(EvalConfig(), [suite]), rewards.CheckerVerifier)
    assert isinstance(eval_verifier(EvalConfig(verifier=" checker "), [suite]), rewards.CheckerVerifier)
    with pytest.raises(UserInputError) as refused:
        eval_verifier(EvalConfig(verifier="  "), [suite, *bare])
    assert refused.value.what == "2 of 3 prompts have no suite 'family' / 'reference' for the checker (first: p.jsonl:1)"
    assert refused.value.where == "--verifier" and "FILE.py:NAME" in refused.value.fix
    (tmp_path / "checks.py").write_text("def short(prompts, completions, **kwargs):\n"
                                        "    return [len(c) < 3 for c in completions]\n")
    own = eval_verifier(EvalConfig(verifier=f"{tmp_path / 'checks.py'}:short", reward_timeout=5.0,
                                   reward_errors="invalid"), bare)
    assert isinstance(own, rewards.FunctionVerifier) and own.name == "short"
    assert own.call.limits == rewards.CallLimits(5.0, "invalid")
    assert [c.passed for c in own(["p", "q"], ["ab", "abcd"], bare)] == [True, False]


def test_the_prompts_are_the_suite_split_or_the_file(tmp_path):
    from rlhflab import sources, tasks

    cfg = EvalConfig(split="validation", split_seed=3, num_train_prompts=22, num_validation_prompts=11,
                     num_test_prompts=11)
    expected = sources.suite_prompts(tasks.build_splits(3, 22, 11, 11)["validation"], "validation")
    assert eval_prompts(cfg) == expected and len(expected) == 11
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Say a.", "answer": "a"}) + "\n")
    rows = eval_prompts(EvalConfig(prompts_file=str(path)))
    assert [(r.prompt, r.columns.get("answer")) for r in rows] == [("Say a.", "a")]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def test_evaluate_writes_its_samples_table_and_summary(policy_dir, tmp_path):
    (tmp_path / "checks.py").write_text("def first(prompts, completions, **kwargs):\n"
                                        "    return [p.endswith('a.') for p in prompts]\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}.", "family": "mine"}) + "\n" for w in "abc"))
    cfg = EvalConfig(model=policy_dir, prompts_file=str(prompts), verifier=f"{tmp_path / 'checks.py'}:first",
                     max_new_tokens=2, output_dir=str(tmp_path / "eval"), progress=False, threads=1, seed=4)
    result = evaluate(cfg)
    run = tmp_path / "eval"
    assert result.run_dir == run
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["prompt"], s["passed"], s["family"]) for s in samples] == [
        ("Say a.", True, "mine"), ("Say b.", False, "mine"), ("Say c.", False, "mine")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary == result.summary
    assert (summary["stage"], summary["model"], summary["split"], summary["verifier"], summary["decoding"]) == (
        "eval", policy_dir, str(prompts), "first", "greedy")
    assert summary["pass_rate"] == table_from_rows(samples) and summary["pass_rate"]["intervals"]["mine"]["n"] == 3
    assert summary["reward_errors"] == {"mode": "stop", "timeout_s": 600.0,
                                        "lost_rows": {"verifier first": {"raised": 0, "timed_out": 0}}}
    assert set(summary["wall_time_s"]) == {"eval"} and summary["wall_time_s"]["eval"] >= 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["test/pass_rate"]) for m in metrics] == [(0, pytest.approx(1 / 3))]
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == 4
    sampled = evaluate(EvalConfig(model=policy_dir, prompts_file=str(prompts), verifier=cfg.verifier, do_sample=True,
                                  max_new_tokens=2, output_dir=str(tmp_path / "sampled"), progress=False, threads=1))
    assert sampled.summary["decoding"] == "sampled" and math.isclose(sampled.summary["pass_rate"]["overall"], 1 / 3)


def test_evaluate_refuses_a_missing_model_before_anything_runs(tmp_path):
    with pytest.raises(UserInputError, match="no model given") as refused:
        evaluate(EvalConfig(output_dir=str(tmp_path / "none")))
    assert refused.value.where == "--model"
    with pytest.raises(UserInputError, match="reward_timeout"):
        evaluate(EvalConfig(model="no/such/folder", reward_timeout=-1.0, output_dir=str(tmp_path / "neg")))
    assert not (tmp_path / "none").exists() and not (tmp_path / "neg").exists()


# --- the edges (issue 36: mutants of eval/pass_rate.py that the cases above let through) -----------------------------


def test_a_prompts_file_is_read_strictly_and_rendered_with_the_tokenizer(tmp_path):
    class ChatTokenizer:
        chat_template = "stand-in"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "<chat>" + "|".join(m["content"] for m in messages) + f"<gen={add_generation_prompt}>"

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Say a."}], "family": "mine"}) + "\n")
    rows = eval_prompts(EvalConfig(prompts_file=str(chat)), ChatTokenizer())
    assert [(r.prompt, r.family) for r in rows] == [("<chat>Say a.<gen=True>", "mine")]
    assert eval_prompts(EvalConfig(prompts_file=str(chat)))[0].prompt == "user: Say a.\nassistant: "  # no template
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "Say a."}) + "\n" + json.dumps({"answer": "no prompt"}) + "\n")
    with pytest.raises(UserInputError) as refused:  # strict: one bad row of two refuses the file, none dropped
        eval_prompts(EvalConfig(prompts_file=str(mixed)), ChatTokenizer())
    assert refused.value.what.startswith("1 of 2 rows are invalid for kind 'prompts'")


def test_a_verifier_file_that_is_missing_is_named_under_its_flag(tmp_path):
    with pytest.raises(UserInputError) as refused:
        eval_verifier(EvalConfig(verifier=f"{tmp_path / 'none.py'}:fn"), [])
    assert refused.value.what == f"file not found: {tmp_path / 'none.py'}" and refused.value.where == "--verifier"
    with pytest.raises(UserInputError) as unchecked:
        eval_verifier(EvalConfig(), [PromptRow("Say a.", {}, "p.jsonl:1")])
    assert unchecked.value.fix == "pass --verifier FILE.py:NAME, a function that says which answers are right"


def test_the_default_title_heads_the_table():
    table = table_from_rows(answers("10"))
    assert format_table({"sft": table}).splitlines()[0] == "held-out pass rate  " + " " * 15 + "sft"


def test_evaluate_hands_each_step_its_settings(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import torch

    from rlhflab.eval import pass_rate
    from rlhflab.tracking import RunDir

    calls = {}
    items = [PromptRow("Say a.", {"family": "mine"}, "p:1"), PromptRow("Say b.", {"family": "mine"}, "p:2")]
    rows = [{"prompt": "Say a.", "family": "mine", "passed": True, "kind": "pass"},
            {"prompt": "Say b.", "family": "mine", "passed": False, "kind": "wrong"}]

    def answer(model, tokenizer, asked, verifier, cfg, progress="unset"):
        calls["answer"] = (model, tokenizer, asked, verifier, progress)
        return rows

    def run_dir(path, **kw):
        calls["run"] = (path, kw)
        return RunDir(path, **kw)

    monkeypatch.setattr(pass_rate, "configure_threads", lambda threads: None)
    monkeypatch.setattr(pass_rate, "check_backend", lambda cfg: None)
    monkeypatch.setattr(pass_rate, "seed_everything", lambda *a, **kw: calls.setdefault("seed", (a, kw)))
    monkeypatch.setattr(pass_rate, "models", SimpleNamespace(
        load_tokenizer=lambda name, **kw: calls.setdefault("tok", (name, kw)) and "tokenizer",
        load_causal_lm=lambda name, **kw: calls.setdefault("lm", (name, kw)) and "model"))
    monkeypatch.setattr(pass_rate, "backend_from_config", lambda cfg, name: calls.setdefault("backend", name) and "hf")
    monkeypatch.setattr(pass_rate, "use_backend", lambda model, backend: calls.setdefault("use", (model, backend)))
    monkeypatch.setattr(pass_rate, "eval_prompts", lambda cfg, tokenizer: calls.setdefault("prompts", tokenizer) and items)
    monkeypatch.setattr(pass_rate, "eval_verifier",
                        lambda cfg, asked: calls.setdefault("verifier", asked) and rewards.CheckerVerifier())
    monkeypatch.setattr(pass_rate, "answer_and_check", answer)
    monkeypatch.setattr(pass_rate, "RunDir", run_dir)
    monkeypatch.setattr(pass_rate, "default_run_path", lambda stage: calls.setdefault("stage", stage) and tmp_path / "ev")
    monkeypatch.setattr(pass_rate, "time", SimpleNamespace(time=iter([1000.0, 1012.34, 0.0]).__next__))
    # trust_remote_code asked for, as a user would: it must reach the (stand-in) loaders; its default stays False
    cfg = EvalConfig(model="m", trust_remote_code=True, dtype="bfloat16", device="cpu", seed=4, deterministic=True,
                     overwrite=True, progress=False)
    summary = evaluate(cfg).summary
    assert calls["seed"] == ((4, True), {})
    assert calls["tok"] == ("m", {"trust_remote_code": True})
    assert calls["lm"] == ("m", {"dtype": "bfloat16", "trust_remote_code": True, "device": torch.device("cpu")})
    assert (calls["backend"], calls["use"], calls["prompts"], calls["verifier"]) == ("m", ("model", "hf"), "tokenizer",
                                                                                      items)
    assert calls["answer"][:3] == ("model", "tokenizer", items) and calls["answer"][4] is False
    assert calls["stage"] == "eval" and calls["run"] == (tmp_path / "ev", {"overwrite": True, "report_to": "none"})
    assert summary["wall_time_s"] == {"eval": 12.3} and summary["pass_rate"]["overall"] == 0.5
    assert json.loads((tmp_path / "ev" / "versions.json").read_text())["determinism"]["seed"] == 4
    calls.clear()
    with pytest.raises(UserInputError) as refused:  # --reward_errors is checked before the model loads
        evaluate(EvalConfig(model="m", reward_errors="bogus", output_dir=str(tmp_path / "bogus")))
    assert refused.value.where == "--reward_errors" and "tok" not in calls


def test_a_missing_model_is_refused_in_these_words(tmp_path):
    with pytest.raises(UserInputError) as refused:
        evaluate(EvalConfig(output_dir=str(tmp_path / "none")))
    assert (refused.value.what, refused.value.fix) == ("no model given",
                                                       "pass a model folder, e.g. runs/demo-.../sft/model")
