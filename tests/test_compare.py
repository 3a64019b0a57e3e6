"""`rlhflab compare`: a real two-method comparison on a tiny model, the wall-time budget with a failing
method, every refusal before any run, the KL measurement and the paired-noise verdict."""

import contextlib
import io
import json
import math

import pytest
import torch
import yaml
from tinyhf import save_suite_model

from rlhflab import compare, data, models
from rlhflab.cli import main
from rlhflab.config import CompareConfig, DemoConfig
from rlhflab.errors import UserInputError
from rlhflab.intervals import mcnemar_p, paired_counts
from rlhflab.report.method_compare import verdict_lines
from rlhflab.rollout import GenerationSettings, generate, response_logprobs
from rlhflab.tracking import RunDir, RunResult

SUITE = {"num_train_prompts": 22, "num_validation_prompts": 11, "num_test_prompts": 12, "max_new_tokens": 6,
         "response_length": 6, "progress": False, "threads": 1, "kl_samples": 2, "do_sample": True}
TINY = {"batch_size": 8, "eval_every": 1, "eval_prompts": 4, "sample_prompts": 2, "console_samples": 0,
        "learning_rate": 1e-3, "save_every": 0}
SECTIONS = {"ppo": {**TINY, "num_mini_batches": 2, "num_ppo_epochs": 1, "value_warmup_rollouts": 0},  # 2 updates
            "grpo": {**TINY, "num_generations": 4, "learning_rate": 2e-3}}
# with sampled evaluation (an untrained greedy model answers every prompt alike), a verifier that passes about
# half of any model's answers, so pass rates, gains and paired counts are not all 0 or 1
EVEN = "def even_length(prompts, completions, **columns):\n    return [len(c) % 2 == 0 for c in completions]\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    (folder / "verify.py").write_text(EVEN)
    config = folder / "compare.yaml"
    config.write_text(yaml.safe_dump({**SUITE, "model": save_suite_model(folder / "policy"),
                                      "verifier": f"{folder / 'verify.py'}:even_length", **SECTIONS}))
    return folder, config


def run_cli(argv):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def compared(setup):
    folder, config = setup
    out = folder / "out"
    code, stdout = run_cli(["compare", "--config", str(config), "--methods", "ppo,grpo,grpo-async,grpo+dynamic",
                            "--budget", "episodes=16", "--output_dir", str(out), "--seed", "3"])
    return code, out, stdout, json.loads((out / "summary.json").read_text())


def test_summary_numbers_are_consistent(compared):
    code, out, _, summary = compared
    assert code == 0 and summary["failed"] == []
    start = summary["test_pass_rate"]["start"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_model = {m: [s for s in samples if s["model"] == m] for m in ("start", "ppo", "grpo", "grpo-async")}
    assert start == sum(s["passed"] for s in by_model["start"]) / 12
    for name in ("ppo", "grpo", "grpo-async"):
        m = summary["methods"][name]
        assert set(m) >= {"test_pass_rate", "gain", "kl_to_reference", "wall_s", "episodes", "episodes_per_s",
                          "stopped", "alarms"}
        assert m["test_pass_rate"] == sum(s["passed"] for s in by_model[name]) / 12
        assert m["test_pass_rate"] == summary["test_pass_rate"][name] == summary["test_tables"][name]["overall"]
        assert m["gain"] == m["test_pass_rate"] - start
        assert m["episodes"] == 16  # the same number of sampled responses for every online method
        assert m["episodes_per_s"] == pytest.approx(16 / m["train_s"])
        assert 0 < m["train_s"] < m["wall_s"] and math.isfinite(m["kl_to_reference"])
        # paired by prompt: the same 12 test prompts in the same order for every model
        assert [s["prompt"] for s in by_model[name]] == [s["prompt"] for s in by_model["start"]]
        fixed = sum(s["passed"] and not b["passed"] for s, b in zip(by_model[name], by_model["start"]))
        assert m["vs_start"]["fixed"] == fixed
    # the variant against its method, prompt by prompt
    versus = summary["methods"]["grpo-async"]["vs_method"]
    assert versus["method"] == "grpo" and "vs_method" not in summary["methods"]["grpo"]
    assert versus["fixed"] == sum(a["passed"] and not g["passed"] for a, g in zip(by_model["grpo-async"],
                                                                                   by_model["grpo"]))
    assert versus["broken"] == sum(g["passed"] and not a["passed"] for a, g in zip(by_model["grpo-async"],
                                                                                    by_model["grpo"]))
    assert summary["methods"]["ppo"]["kl_to_reference"] != 0  # trained with lr 1e-3: it moved
    assert start not in (0.0, 1.0) and summary["test_tables"]["start"]["counts"]  # per-family tables


def test_every_method_gets_the_shared_settings_and_only_its_own_section(compared):
    _, out, _, _ = compared
    ppo, grpo = (yaml.safe_load((out / name / "config.yaml").read_text()) for name in ("ppo", "grpo"))
    for key in ("model", "seed", "temperature", "response_length", "max_new_tokens", "verifier", "num_test_prompts",
                "total_episodes", "do_sample"):
        assert ppo[key] == grpo[key], key
    assert ppo["seed"] == 3 and ppo["total_episodes"] == 16 and ppo["max_seconds"] == 0
    assert ppo["learning_rate"] == 1e-3 and grpo["learning_rate"] == 2e-3 and grpo["num_generations"] == 4
    assert ppo["num_ppo_epochs"] == 1
    written = yaml.safe_load((out / "config.yaml").read_text())  # a valid --config again: shared keys + sections
    assert written["grpo"]["learning_rate"] == 2e-3 and written["methods"] == "ppo,grpo,grpo-async,grpo+dynamic"
    dynamic = yaml.safe_load((out / "grpo+dynamic" / "config.yaml").read_text())
    assert dynamic["dynamic_sampling"] is True and dynamic["learning_rate"] == 2e-3 and not grpo["dynamic_sampling"]
    # the variant: its method's section and settings, with generation overlapped (one update stale at most)
    variant = yaml.safe_load((out / "grpo-async" / "config.yaml").read_text())
    assert {k: v for k, v in variant.items() if k not in ("output_dir", "async_generation")} == \
        {k: v for k, v in grpo.items() if k not in ("output_dir", "async_generation")}
    assert variant["async_generation"] is True and grpo["async_generation"] is False and variant["max_staleness"] == 1
    steps = [json.loads(line) for line in (out / "grpo-async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/staleness"] for r in steps if "async/staleness" in r] == [0, 1]


def test_report_and_console_show_every_method(compared):
    _, out, stdout, summary = compared
    page = (out / "report.html").read_text()
    families = page[page.index('id="families"'):page.index("</table>", page.index('id="families"'))]
    assert "<th>ppo</th>" in families and "<th>grpo</th>" in families and "<th>start</th>" in families
    assert page.count("<img") >= 2  # validation and KL curves on shared axes
    assert summary["verdict"][0] in page.replace("&#x27;", "'")
    assert (out / "ppo" / "report.html").is_file() and (out / "grpo" / "report.html").is_file()
    from rlhflab.report import write_report  # `rlhflab report DIR` on a comparison gives the same page

    assert write_report(out, out / "again.html").read_text() == page
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    # the untrained model fails the suite's checker (its reward) everywhere: every group all-equal, refilled, padded
    dynamic = summary["methods"]["grpo+dynamic"]
    assert dynamic["episodes"] == 16 and dynamic["episodes_generated"] > 16 == summary["methods"]["grpo"][
        "episodes_generated"]
    assert lines[header].split() == ["method", "test", "pass", "gain", "KL", "wall", "s", "episodes/s", "generated",
                                     "variant", "vs", "its", "method"]
    assert [line.split()[0] for line in lines[header + 2:header + 7]] == ["start", "ppo", "grpo", "grpo-async",
                                                                            "grpo+dynamic"]
    assert f"{summary['methods']['grpo']['test_pass_rate']:.1%}" in lines[header + 4]
    assert "vs grpo: " in lines[header + 5] and "vs " not in lines[header + 4] and "vs grpo: " in lines[header + 6]
    assert f" {dynamic['episodes_generated']} " in lines[header + 6]


def test_seconds_budget_is_kept_and_a_failing_method_is_recorded(setup, monkeypatch):
    import rlhflab.trainers.grpo

    def broken(cfg, **_):
        raise FloatingPointError("grpo update 1: non-finite loss")

    monkeypatch.setattr(rlhflab.trainers.grpo, "train", broken)
    folder, config = setup
    out = folder / "timed"
    code, stdout = run_cli(["compare", "--config", str(config), "--methods", "grpo,ppo", "--budget", "seconds=1.5",
                            "--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 1 and summary["failed"] == ["grpo"]
    assert "FloatingPointError: grpo update 1: non-finite loss" in summary["methods"]["grpo"]["error"]
    ppo = summary["methods"]["ppo"]  # ran after the failure
    ppo_summary = json.loads((out / "ppo" / "summary.json").read_text())
    walls = ppo_summary["wall_time_s"]
    assert ppo_summary["budget_stop"]["max_seconds"] == 1.5
    assert 1.5 <= walls["loop"] + walls["evaluation"] + walls["save"] < 1.5 + 1.0  # stopped within about an update
    assert ppo["episodes"] == ppo_summary["episodes"] > 16 and ppo["episodes"] % 8 == 0
    assert yaml.safe_load((out / "ppo" / "config.yaml").read_text())["lr_schedule"] == "constant"
    assert "failed" in stdout and "grpo failed" in (out / "report.html").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ppo,gpro"], "did you mean 'grpo'?"),
    (["--methods", "ppo,ppo"], "method listed twice: ppo"),
    (["--methods", ""], "no method given"),
    (["--budget", "minutes=3"], "cannot read --budget"),
    (["--budget", "episodes=lots"], "episodes must be a whole number"),
    (["--budget", "episodes=-8"], "the budget must be positive"),
    (["--budget", "episodes=20"], "use episodes=16 or episodes=24"),
    (["--budget", "seconds=0"], "the budget must be positive"),
    (["--methods", "ppo"], "a section for grpo, which --methods does not list"),
    (["--model", ""], "no starting model given"),
    (["--train_file", "prompts.jsonl"], "training on your own prompts but testing on the built-in suite"),
])
def test_bad_flags_are_refused_before_any_run(setup, flags, message):
    folder, config = setup
    with pytest.raises(UserInputError, match=message.replace("?", r"\?")):
        compare.parse_compare(["--config", str(config), "--methods", "ppo,grpo", "--output_dir",
                               str(folder / "never"), *flags])
    assert not (folder / "never").exists()


@pytest.mark.parametrize("section, message", [
    ({"seed": 1}, "seed is shared by every method"),
    ({"total_episodes": 64}, "total_episodes is part of the budget"),
    ({"learning_rat": 1e-4}, "did you mean 'learning_rate'"),
    ({"beta": "high"}, "'beta' should be float"),
    ([1, 2], "section 'grpo' must be a mapping"),
])
def test_bad_method_sections_are_refused(setup, tmp_path, section, message):
    folder, config = setup
    values = yaml.safe_load(config.read_text())
    values["grpo"] = section
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(UserInputError, match=message):
        compare.parse_compare(["--config", str(path), "--methods", "ppo,grpo"])


def test_a_method_this_version_lacks_is_named(setup, monkeypatch):
    folder, config = setup
    monkeypatch.setitem(compare.METHODS, "rloo", compare.Method("rloo", "RLOOConfig", "rlhflab.trainers.no_such",
                                                                online=True))
    with pytest.raises(UserInputError, match=r"method 'rloo' is not available .*rlhflab.trainers.no_such"):
        compare.parse_compare(["--config", str(config), "--methods", "ppo,grpo,rloo"])
    assert "rloo" not in compare.available_methods()


def test_kl_is_zero_for_the_reference_itself_and_matches_the_exact_kl_of_one_token(setup):
    folder, _ = setup
    tokenizer = models.load_tokenizer(str(folder / "policy"))
    reference = models.load_causal_lm(str(folder / "policy")).eval()
    policy = models.load_causal_lm(str(folder / "policy")).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompts = ["Reply with yes or no: is 3 odd?", "Write the word cat in uppercase."]
    same = compare.kl_to_reference(reference, reference, tokenizer, prompts, samples=3, response_length=5,
                                   temperature=1.0, batch_size=4, seed=0)
    assert same == 0.0
    estimate = compare.kl_to_reference(policy, reference, tokenizer, prompts, samples=1500, response_length=1,
                                       temperature=0.8, batch_size=1000, seed=0)
    exact = []  # one response token: KL(pi || ref) of the first-token distributions, at the same temperature
    for ids in data.encode_prompts(tokenizer, prompts):
        with torch.no_grad():
            logits = [m(torch.tensor([ids])).logits[0, -1] / 0.8 for m in (policy, reference)]
        logp, logq = (torch.log_softmax(x, -1) for x in logits)
        exact.append(float((logp.exp() * (logp - logq)).sum()))
    assert estimate == pytest.approx(sum(exact) / 2, rel=0.1)


def test_kl_does_not_depend_on_the_batch_it_was_sampled_in(setup):
    """Left padding and batch size change neither the sampled tokens' log-probs nor the estimate."""
    folder, _ = setup
    tokenizer = models.load_tokenizer(str(folder / "policy"))
    model = models.load_causal_lm(str(folder / "policy")).eval()
    prompts = ["Reply with yes or no: is 3 odd?", "Write cat."]
    out = generate(model, data.encode_prompts(tokenizer, prompts), pad_id=tokenizer.pad_token_id,
                   eos_id=tokenizer.eos_token_id, settings=GenerationSettings(4, True, 1.0),
                   generator=torch.Generator().manual_seed(0))
    together = response_logprobs(model, out.query_ids, out.query_mask, out.response_ids, out.response_mask)
    for row in range(2):
        real = out.query_mask[row]
        alone = response_logprobs(model, out.query_ids[row:row + 1, real], out.query_mask[row:row + 1, real],
                                  out.response_ids[row:row + 1], out.response_mask[row:row + 1])
        torch.testing.assert_close(alone[0], together[row], atol=1e-5, rtol=0)


def test_mcnemar_against_hand_worked_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == 2 / 32  # all 5 discordant prompts one way: 2 * (1/2)^5
    assert mcnemar_p(6, 0) == 2 / 64
    assert mcnemar_p(3, 1) == mcnemar_p(1, 3) == 2 * (1 + 4) / 16
    assert mcnemar_p(10, 10) == 1.0
    counts = paired_counts([True, False, False, True], [True, True, True, False])
    assert {k: counts[k] for k in ("fixed", "broken", "p_value", "difference", "n")} == {
        "fixed": 2, "broken": 1, "p_value": 1.0, "difference": 0.25, "n": 4}
    assert counts["low"] < 0 < counts["high"]  # McNemar p = 1: the interval straddles 0


def _summary(rates, kl=None):
    start = rates.pop("start")
    return {"test_pass_rate": {"start": start, **rates}, "failed": [],
            "methods": {n: {"test_pass_rate": r, "gain": r - start, "kl_to_reference": (kl or {}).get(n, 1.0),
                            "wall_s": 10.0, "episodes_per_s": 50.0} for n, r in rates.items()}}


def test_verdict_says_which_gain_is_beyond_noise():
    n = 40
    start = [False] * n
    grpo = [True] * 30 + [False] * 10  # +30 prompts: beyond noise
    rloo = [True] * 28 + [False] * 12  # 2 fewer than grpo: within noise of it
    lines = verdict_lines(_summary({"start": 0.0, "grpo": 0.75, "rloo": 0.7}),
                          {"start": start, "grpo": grpo, "rloo": rloo})
    assert lines[0].startswith("Most gain on the 40 held-out test prompts: grpo: 75.0% (+75.0 pts")
    assert "beyond noise: +75.0 pts [+57.0, +85.9] (paired over the test prompts: 30 better, 0 worse" in lines[0]
    assert lines[1].startswith("Runner-up rloo: 70.0%")
    assert "within noise: +5.0 pts [-3.2, +12.7] (paired over the test prompts: 2 better, 0 worse" in lines[1]
    tied = verdict_lines(_summary({"start": 0.5, "a": 0.5, "b": 0.5}, kl={"a": 2.0, "b": 0.5}),
                         {"start": [True, False], "a": [False, True], "b": [True, False]})
    assert tied[0].startswith("No method raised the test pass rate above the start's 50.0%")
    assert tied[1].startswith("b ties with a") and "lower KL" in tied[1]


def test_demo_compare_runs_after_the_demo_and_joins_its_summary(tmp_path, monkeypatch):
    import rlhflab.compare.demo_step
    import rlhflab.demo

    calls = []

    def fake_demo(cfg):
        run = RunDir(cfg.output_dir, overwrite=True)
        summary = run.update_summary(stage="demo", test_pass_rate={"sft": 0.25}, test_tables={"sft": {"overall": 0.25}},
                                     wall_time_s={"total": 100.0}, runs={"sft": "x"})
        calls.append("demo")
        return RunResult(run.path, summary, run.path / "sft" / "model")

    def fake_compare(plan):
        calls.append(plan)
        table = {"overall": 0.5, "per_family": {}, "counts": {}}
        return RunResult(plan.out, {"test_tables": {"start": {"overall": 0.25}, "ppo": table}, "budget": {},
                                    "test_pass_rate": {"start": 0.25, "ppo": 0.5}, "verdict": ["ppo gained"],
                                    "methods": {"ppo": {"test_pass_rate": 0.5, "gain": 0.25}},
                                    "wall_time_s": {"total": 50.0}})

    monkeypatch.setattr(rlhflab.demo, "run_demo", fake_demo)
    monkeypatch.setattr(rlhflab.compare.demo_step, "run_compare", fake_compare)  # where the demo step calls it
    cfg = DemoConfig(output_dir=str(tmp_path / "demo"), compare=True, seed=7, threads=1, num_test_prompts=12)
    result = compare.run_demo_with_comparison(cfg)
    assert calls[0] == "demo"
    plan = calls[1]
    assert plan.cfg.model == str(tmp_path / "demo" / "sft" / "model") and plan.out == tmp_path / "demo" / "compare"
    assert (plan.cfg.seed, plan.cfg.threads, plan.cfg.num_test_prompts) == (7, 1, 12)
    assert list(plan.configs) == compare.available_methods()
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary == result.summary
    assert summary["test_pass_rate"] == {"sft": 0.25, "compare/ppo": 0.5}
    assert summary["compare"]["methods"]["ppo"]["gain"] == 0.25 and summary["wall_time_s"]["total"] == 150.0


def test_compare_defaults_are_each_methods_own_defaults():
    """A shared field's default in compare is the one every method has, so `rlhflab compare` with its defaults
    runs each method as its own command would."""
    import dataclasses

    defaults = CompareConfig()
    for name in compare.available_methods():
        method = compare.METHODS[name]
        cls = compare.config_class(method)
        own = {f.name: f.default for f in dataclasses.fields(cls)}
        for field, value in compare.shared_values(defaults, method, cls).items():
            assert own[field] == value, (name, field)


def test_sweep_runs_a_new_online_stage(setup):
    folder, config = setup
    values = yaml.safe_load(config.read_text())
    base = folder / "grpo_base.yaml"
    base.write_text(yaml.safe_dump({**{k: v for k, v in values.items() if k in SUITE and k != "kl_samples"},
                                    "model": values["model"], **SECTIONS["grpo"], "total_episodes": 16}))
    out = folder / "sweep_beta"
    code, stdout = run_cli(["sweep", "--stage", "grpo", "--config", str(base), "--vary", "beta=0.0,0.04",
                            "--out", str(out)])
    assert code == 0
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["value"] for r in runs] == ["0.0", "0.04"] and all(r["held_out"] is not None for r in runs)
    betas = [yaml.safe_load((out / f"beta={v}" / "config.yaml").read_text())["beta"] for v in ("0.0", "0.04")]
    assert betas == [0.0, 0.04] and (out / "comparison.html").is_file()


@pytest.mark.parametrize("stage, field, texts, values, extra", [
    ("rloo", "num_generations", "2,4", [2, 4], []),
    ("reinforce", "baseline", "batch_mean,leave_one_out", ["batch_mean", "leave_one_out"], ["--num_generations", "2"]),
    ("dpo", "loss_type", "sigmoid,ipo", ["sigmoid", "ipo"], []),
    ("online-dpo", "beta", "0.1,0.2", [0.1, 0.2], []),
])
def test_sweep_plans_every_new_stage(setup, stage, field, texts, values, extra):
    from rlhflab.sweep import plan_sweep

    folder, _ = setup
    plan = plan_sweep(["--stage", stage, "--vary", f"{field}={texts}", "--model", str(folder / "policy"),
                       "--batch_size", "8", *extra, "--out", str(folder / f"plan-{stage}")])
    assert [getattr(c, field) for c in plan.configs] == values
    assert not (folder / f"plan-{stage}").exists()  # planned only


def test_the_readme_per_method_sections_plan(setup, tmp_path):
    """docs/comparing-methods.md: its example YAML is a valid compare config for every method it names."""
    from pathlib import Path

    folder, _ = setup
    readme = (Path(__file__).resolve().parents[1] / "docs" / "comparing-methods.md").read_text()
    block = readme[readme.index("# compare.yaml"):]
    path = tmp_path / "compare.yaml"
    path.write_text(block[:block.index("```")])
    plan = compare.parse_compare(["--config", str(path), "--model", str(folder / "policy")])
    assert plan.configs["grpo"].beta == 0.0 and plan.configs["dpo"].beta == 0.2
    assert plan.configs["online-dpo"].num_generations == 8 and plan.configs["ppo"].response_length == 26


def test_every_variant_plans_with_its_methods_section_and_its_own_setting(setup):
    folder, config = setup
    plan = compare.parse_compare(["--config", str(config), "--methods", "ppo,grpo,grpo-async,grpo+dynamic,grpo+filter,"
                                  "grpo+entropy,rloo+entropy", "--budget", "episodes=64"])
    own = {"grpo-async": ("async_generation", True), "grpo+dynamic": ("dynamic_sampling", True),
           "grpo+filter": ("filter_prompts", "pass_rate"), "grpo+entropy": ("use_adaptive_entropy", True)}
    for name, (field, value) in own.items():
        cfg = plan.configs[name]
        assert getattr(cfg, field) == value and getattr(plan.configs["grpo"], field) != value, name
        assert cfg.learning_rate == 2e-3 and cfg.num_generations == 4  # grpo's section
    assert plan.configs["rloo+entropy"].use_adaptive_entropy and compare.METHODS["rloo+entropy"].variant_of == "rloo"
