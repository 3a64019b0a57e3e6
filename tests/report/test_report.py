"""write_report on synthetic run folders: valid self-contained HTML, escaping, robustness, content."""

import re

import pytest

from rlhflab.errors import UserInputError
from rlhflab.report import load_run, write_report
from rlhflab.report.series import alarm_steps, collect_alarms

XSS = "<script>alert(1)</script>"
IMG_XSS = "<img src=x onerror=alert(2)>"


def test_report_is_valid_html_with_embedded_png_curves(ppo_run, checked):
    out = write_report(ppo_run)
    assert out == ppo_run / "report.html"
    page = checked(out)
    assert len(page.imgs) >= 10  # scores, KL, rlhf_reward, ratio, clipfrac, value loss, EV, entropy, length, pass rate
    text = out.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text
    for title in ("Training curves", "Sample answers to fixed prompts", "Wall time", "Pass rate per family"):
        assert f">{title}<" in text


def test_verdict_numbers_come_from_the_summary(ppo_run, checked, section_of):
    text = write_report(ppo_run).read_text()
    verdict = section_of(text, "Did the model get better on held-out prompts?")
    # 100 validation prompts (config: eval_prompts 100 of 300): Wilson per rate, Newcombe for the change
    assert ("held-out validation pass rate 49.0% [39.4–58.7] → 67.0% [57.3–75.4] (+18.0 pts [+4.3, +30.8], better, "
            "unpaired over 100 prompts each; start → end)") in verdict
    assert "Better on the held-out check." in verdict


def test_a_drop_is_reported_as_worse(make_run, tmp_path, section_of):
    run = make_run(tmp_path / "r", summary={"validation_pass_rate": {"start": 0.6, "end": 0.45, "n": 300}})
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "60.0% [54.4–65.4] → 45.0% [39.5–50.7] (-15.0 pts [-22.7, -7.0], worse" in verdict
    assert "Worse on the held-out check." in verdict


def test_a_change_without_a_prompt_count_is_never_called_better(make_run, tmp_path, section_of):
    run = make_run(tmp_path / "r", summary={"validation_pass_rate": {"start": 0.4, "end": 0.6}})  # no n, no config
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "40.0% → 60.0% (+20.0 points, no interval: prompt count unknown" in verdict
    assert "Better" not in verdict and "not shown to be more than noise" in verdict


def _demo_run(make_run, path, passing: dict[str, range], n: int = 300):
    """A demo folder whose test answers pass exactly the given prompt indices (families lowercase / yes_no / sum)."""
    families = ["lowercase", "yes_no", "sum_result"]
    samples = [{"stage": name, "family": families[i % 3], "prompt": f"prompt {i}", "answer": "a", "passed": i in passes}
               for name, passes in passing.items() for i in range(n)]
    tables = {}
    for name, passes in passing.items():
        counts = {f: sum(1 for i in range(n) if families[i % 3] == f) for f in families}
        per_family = {f: sum(1 for i in passes if families[i % 3] == f) / counts[f] for f in families}
        tables[name] = {"overall": len(passes) / n, "per_family": per_family, "counts": counts}
    summary = {"stage": "demo", "test_pass_rate": {k: t["overall"] for k, t in tables.items()}, "test_tables": tables}
    return make_run(path, summary=summary, samples=samples)


def test_demo_verdict_compares_each_model_with_sft_prompt_by_prompt(make_run, tmp_path, section_of):
    # sft passes prompts 0-146 (49%); ppo 19-219 (67%: 73 fixed, 19 broken); ppo_rm 30-149 (40%: 3 fixed, 30 broken)
    run = _demo_run(make_run, tmp_path / "demo", {"sft": range(147), "ppo": range(19, 220), "ppo_rm": range(30, 150)})
    text = write_report(run).read_text()
    verdict = section_of(text, "Did the model get better on held-out prompts?")
    assert ("49.0% [43.4–54.6] → 67.0% [61.5–72.1] (+18.0 pts [+12.0, +23.8], better, paired over 300 prompts; "
            "sft → ppo)") in verdict
    assert "49.0% [43.4–54.6] → 40.0% [34.6–45.6] (-9.0 pts [-12.6, -5.3], worse, paired over 300 prompts" in verdict
    assert "Mixed: better on ppo; worse on ppo_rm." in verdict
    families = section_of(text, "Pass rate per family")
    assert re.search(r"overall</th><td[^>]*>49.0% \[43.4–54.6\]</td>", families)
    assert "paired over the same prompts" in families


def test_demo_verdict_says_within_noise_for_a_small_gain_on_300_prompts(make_run, tmp_path, section_of):
    # ppo: 14 of sft's passes lost, 20 new ones: +2 points, McNemar p = 0.39
    run = _demo_run(make_run, tmp_path / "demo", {"sft": range(147), "ppo": range(14, 167)})
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "Within noise on the held-out check: the 95 % interval of the difference includes 0 " \
           "(ppo +2.0 pts [-1.8, +5.8])." in verdict
    assert "Better" not in verdict and 'class="verdict neutral"' in verdict


def test_demo_verdict_without_samples_falls_back_to_unpaired_intervals(make_run, tmp_path, section_of):
    run = make_run(tmp_path / "demo", summary={"stage": "demo", "test_pass_rate": {"sft": 0.49, "ppo": 0.67, "ppo_rm": 0.4}})
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "49.0% → 67.0% (+18.0 points, no interval: prompt count unknown; sft → ppo)" in verdict
    assert "Mixed: higher on ppo; lower on ppo_rm." in verdict


def test_no_held_out_check_is_said_plainly(make_run, tmp_path, section_of):
    run = make_run(tmp_path / "r", metrics=[{"step": 1, "loss/rm": 0.5}], summary={"stage": "x"})
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "No held-out check in this run" in verdict


def test_sft_verdict_falls_back_to_validation_rows_in_metrics(make_run, tmp_path, section_of):
    rows = [{"step": 200, "val/pass_rate": 0.08}, {"step": 400, "val/pass_rate": float("nan")},
            {"step": 600, "val/pass_rate": 0.57}]
    run = make_run(tmp_path / "sft", metrics=rows, summary={"stage": "sft"},
                   config={"eval_prompts": 100, "num_validation_prompts": 300, "validation_file": ""})
    verdict = section_of(write_report(run).read_text(), "Did the model get better on held-out prompts?")
    assert "8.0% [4.1–15.0] → 57.0% [47.2–66.3] (+49.0 pts [+37.0, +59.1], better, unpaired over 100 prompts each; " \
           "step 200 → step 600)" in verdict


def test_text_from_the_model_and_files_is_escaped(make_run, tmp_path, samples_rows, checked):
    samples = samples_rows(answer=lambda s: f"{XSS} at {s}")
    samples[0]["reason"] = IMG_XSS
    samples[1]["prompt"] = f"prompt {XSS}"
    run = make_run(tmp_path / "evil", config={"model": XSS, "seed": 1}, samples=samples,
                   summary={"stage": XSS, "rm_diagnosis": {"roc_auc": 0.7}, "alarms": [{"name": XSS, "step": 1, "reason": IMG_XSS}]},
                   versions={"cpu": XSS}, worst_cases=f"# worst\n- answer '{XSS}'\n", metrics=[{"step": 1, f"alarm/{XSS}": 1}])
    page = checked(write_report(run))
    text = (run / "report.html").read_text()
    assert "script" not in page.tags
    assert all(src.startswith("data:image/png") for src in page.imgs)  # the injected <img src=x> is text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; at 0" in text
    assert f"{XSS} at 0" in page.all_text and IMG_XSS in page.all_text  # shown to the reader as text
    assert re.search(r"<pre>[^<]*&lt;script&gt;", text)  # worst_cases.md inside <pre>, escaped


def test_nan_and_inf_metrics_do_not_break_plots(make_run, tmp_path, metrics_rows, checked, section_of):
    rows = metrics_rows(kl=lambda i: [float("nan"), "nan", "inf", None, 0.5, 0.6][i - 1])
    for row in rows:
        if "objective/scores" in row:
            row["objective/scores"] = float("nan")
    run = make_run(tmp_path / "nan", metrics=rows, summary={"validation_pass_rate": {"start": 0.5, "end": "nan"}})
    text = write_report(run).read_text()
    checked(run / "report.html")
    curves = section_of(text, "Training curves")
    assert "reward (objective/scores): no finite values" in curves
    assert 'alt="reward (objective/scores)"' not in curves  # no image for an all-NaN series
    assert 'alt="KL to the reference (objective/kl, nats)"' in curves
    assert "(4 non-finite point(s) dropped)" in curves


def test_empty_samples_and_empty_eval_still_render(make_run, tmp_path, checked, section_of):
    run = make_run(tmp_path / "empty", config={"seed": 0}, metrics=[], samples=[],
                   summary={"stage": "eval", "split": "test", "pass_rate": {"overall": float("nan"), "per_family": {}, "counts": {}}})
    text = write_report(run).read_text()
    checked(run / "report.html")
    assert "samples.jsonl is empty" in section_of(text, "Sample answers to fixed prompts")
    assert "No held-out check in this run" in text
    assert ">Training curves<" not in text


def test_missing_and_damaged_files_are_noted_and_their_sections_omitted(make_run, tmp_path, section_of):
    run = make_run(tmp_path / "partial", summary={"stage": "ppo"})
    (run / "metrics.jsonl").write_text('{"step": 1, "objective/kl": 0.1}\n{"step": 2, "objective/k')
    text = write_report(run).read_text()
    notes = section_of(text, "Missing or damaged files")
    assert "config.yaml not found" in notes and "versions.json not found" in notes
    assert "samples.jsonl not found" in notes and "1 malformed line(s) skipped (first at line 2)" in notes
    assert "Config (config.yaml)" not in text and ">Sample answers to fixed prompts<" not in text
    assert ">Training curves<" in text  # the good line still plots


def test_samples_side_by_side_at_start_middle_and_end(ppo_run, section_of):
    samples = section_of(write_report(ppo_run).read_text(), "Sample answers to fixed prompts")
    headers = re.findall(r"<th>([^<]*)</th>", samples)
    assert headers == ["prompt", "reference", "step 0", "step 20", "step 40"]
    assert "answer at 0" in samples and "answer at 20" in samples and "answer at 40" in samples
    assert "answer at 10" not in samples


def test_family_table_and_reproduction_facts(ppo_run, section_of):
    text = write_report(ppo_run).read_text()
    families = section_of(text, "Pass rate per family")
    assert re.search(r"lowercase</th><td[^>]*>50.0%</td><td[^>]*>75.0%</td><td[^>]*>\+25.0 pts", families)
    facts = section_of(text, "The run")
    assert re.search(r"seed</th><td[^>]*>7<", facts)
    assert "2.13.0+cpu" in text and "learning_rate: 0.0001" in text
    wall = section_of(text, "Wall time")
    assert "42" in wall and re.search(r"training</th><td[^>]*>12</td><td[^>]*>57%", wall)  # 6 x 2.0 s of 21 s


def test_a_stage_run_beside_the_others_has_its_own_seconds_under_the_split(make_run, tmp_path, section_of):
    summary = {"stage": "demo", "wall_time_s": {"sft": 100.0, "ppo_rm": 300.0, "ppo": 0.2, "total": 400.2},
               "side_by_side": {"ppo": 412.3}}  # the demo's: its ppo row is the wait after the RM's stages
    wall = section_of(write_report(make_run(tmp_path / "demo", summary=summary)).read_text(), "Wall time")
    assert "ppo ran in a second process beside the stages after it: 412 s of its own" in wall


def test_alarms_are_listed_and_marked(make_run, tmp_path, metrics_rows, section_of, checked):
    rows = metrics_rows()
    rows[3]["alarm/entropy_collapse"] = 1.0  # step 3
    rows[4]["alarm/entropy_collapse"] = 0  # not fired
    summary = {"alarms": [{"name": "kl_spike", "step": 2, "reason": "KL 9.1 > 5"}], "stopped": {"step": 3, "reason": "alarm"},
               "best": {"step": 1, "val/pass_rate": 0.52, "restored": True}}
    run = make_run(tmp_path / "alarms", metrics=rows, summary=summary)
    assert [(a.name, a.step) for a in collect_alarms(load_run(run))] == [("kl_spike", 2), ("entropy_collapse", 3)]
    assert alarm_steps(load_run(run)) == [2, 3]
    text = write_report(run).read_text()
    alarms = section_of(text, "Alarms")
    assert "kl_spike" in alarms and "KL 9.1 &gt; 5" in alarms and "entropy_collapse" in alarms
    assert "stopped early at step 3" in text and "Red dashed lines mark alarm steps." in text
    assert "best one seen, from step 1 (validation pass rate 52.0%)" in text
    plain = make_run(tmp_path / "plain", metrics=metrics_rows())
    write_report(plain)
    marked, unmarked = checked(run / "report.html").imgs, checked(plain / "report.html").imgs
    assert len(marked) == len(unmarked) and marked[0] != unmarked[0]  # the marks are drawn


def test_demo_gets_a_section_per_stage_with_rm_diagnosis(make_run, tmp_path, metrics_rows, samples_rows, checked):
    demo = make_run(tmp_path / "demo", config={"seed": 0},
                    summary={"stage": "demo", "test_pass_rate": {"sft": 0.5, "ppo": 0.6}, "wall_time_s": {"total": 9.0}},
                    samples=[{"stage": "sft", "prompt": "p", "answer": "a", "passed": False},
                             {"stage": "ppo", "prompt": "p", "answer": "b", "passed": True}])
    make_run(demo / "sft", metrics=[{"step": 10, "loss/sft": 2.0}, {"step": 20, "loss/sft": 1.0}], summary={"stage": "sft"})
    make_run(demo / "ppo", metrics=metrics_rows(), samples=samples_rows(), summary={"stage": "ppo"})
    make_run(demo / "rm_diagnosis", summary={"rm_diagnosis": {"roc_auc": 0.759, "point_biserial": 0.372}},
             worst_cases="# Failing answers the reward model scored highest\n- score 4.87 'RESULT: <sum>'\n")
    text = write_report(demo).read_text()
    checked(demo / "report.html")
    stages = re.findall(r"<h2>Stage: (\w+)</h2>", text)
    assert stages == ["sft", "ppo", "rm_diagnosis"]
    assert "0.759" in text and "scored highest\n- score 4.87 &#x27;RESULT: &lt;sum&gt;&#x27;" in text
    assert re.findall(r"<th>(sft|ppo)</th>", text)[:2] == ["sft", "ppo"]  # demo test answers side by side


def test_not_a_run_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserInputError, match="run folder not found"):
        write_report(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserInputError, match="config.yaml"):
        write_report(tmp_path / "plain")


def test_unicode_and_very_long_answers_render(make_run, tmp_path, samples_rows, metrics_rows, checked):
    """Korean, Arabic, emoji with a skin tone, a combining accent, a zero-width space and a NUL render as text; a
    lone surrogate (undecodable bytes a data file or JSON kept) is written as U+FFFD instead of failing the
    whole page; a 200,000-character answer does not break the page."""
    odd = "한국어 答え مرحبا 🤖👍🏽 e\u0301 zero\u200bwidth \x00nul \udcff"
    long = "x" * 200_000
    rows = samples_rows(answer=lambda s: (odd if s < 20 else long) + f" at {s}")
    rows[0]["prompt"] = odd
    run = make_run(tmp_path / "unicode", config={"seed": 1, "model": odd}, metrics=metrics_rows(), samples=rows,
                   summary={"stage": "ppo", "validation_pass_rate": {"start": 0.49, "end": 0.67}})
    page = checked(write_report(run))
    text = (run / "report.html").read_text(encoding="utf-8")
    assert "한국어 答え مرحبا 🤖👍🏽 e\u0301 zero\u200bwidth" in text and "\ufffd" in text and "\udcff" not in text
    assert f"{long} at 20" in page.all_text


def test_the_prompts_filtered_out_before_rl_are_listed_per_family(make_run, tmp_path, section_of):
    summary = {"stage": "grpo", "prompt_filter": {"mode": "pass_rate", "samples_per_prompt": 8, "low": 0.0, "high": 1.0,
                                                  "prompts": 7, "kept": 3, "generated": 56, "seconds": 1.5,
                                                  "per_family": {"a": {"prompts": 2, "kept": 1, "always_solved": 0,
                                                                       "never_solved": 1},
                                                                 "b": {"prompts": 5, "kept": 2, "always_solved": 3,
                                                                       "never_solved": 0}}}}
    run = make_run(tmp_path / "filtered", config={"seed": 1}, summary=summary)
    write_report(run)
    html = section_of((run / "report.html").read_text(), "Train prompts filtered out before RL")
    assert re.sub(r"<td[^>]*>", "<td>", html).count("<td>2</td><td>0</td><td>1</td><td>1</td>") == 1  # family a
    assert "answered 8 times" in html and "56 answers" in html
