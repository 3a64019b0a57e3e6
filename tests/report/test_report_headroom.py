"""The report's "Headroom before RL" section, from a written headroom.json (no model, no torch)."""

import json

from rlhflab.report import write_report

PROBE = {
    "split": "validation", "prompts": 18, "samples_per_prompt": 8, "temperature": 1.0, "max_new_tokens": 26,
    "seed": 0, "seconds": 1.3, "thresholds": {"min_pass_at_k": 0.02, "min_prompts_with_pass": 2, "ceiling": 0.9},
    "per_family": {
        "sum_result": {"family": "sum_result", "prompts": 9, "samples_per_prompt": 8, "greedy_pass_at_1": 0.0,
                       "sampled_pass_at_1": 0.0, "pass_at_k": 0.0, "prompts_with_pass": 0, "passing_samples": 0,
                       "status": "none", "words": "sum_result: 0 of 8 samples pass on any of its 9 prompts — RL from "
                                                  "this model cannot be expected to help here; improve SFT or the <b>data</b>"},
        "yes_no": {"family": "yes_no", "prompts": 9, "samples_per_prompt": 8, "greedy_pass_at_1": 1 / 3,
                   "sampled_pass_at_1": 0.25, "pass_at_k": 2 / 3, "prompts_with_pass": 6, "passing_samples": 18,
                   "status": "room", "words": "yes_no: pass@8 67% against greedy 33%"},
    },
    "overall": {"family": "overall", "prompts": 18, "samples_per_prompt": 8, "greedy_pass_at_1": 1 / 6,
                "sampled_pass_at_1": 0.125, "pass_at_k": 1 / 3, "prompts_with_pass": 6, "passing_samples": 18},
    "no_headroom": ["sum_result"],
}


PPO_SUMMARY = {"stage": "ppo", "reward": "checker", "validation_pass_rate": {"start": 0.49, "end": 0.67}}


def test_section_names_the_family_without_headroom_and_tabulates_every_rate(make_run, section_of, checked, tmp_path):
    run = make_run(tmp_path / "ppo", summary={**PPO_SUMMARY, "headroom_verdict": [
        "ppo: sum_result did not move (0% → 0%); its pass@8 was 0% — expected: nothing to reinforce"]})
    (run / "headroom.json").write_text(json.dumps(PROBE))
    page = write_report(run)
    checked(page)  # well nested
    part = section_of(page.read_text(), "Headroom before RL")
    assert "sum_result: 0 of 8 samples pass on any of its 9 prompts" in part and 'class="bad"' in part
    assert "33.3%" in part and "25.0%" in part and "66.7%" in part  # yes_no greedy, sampled, pass@8
    assert "0 of 9" in part and "6 of 9" in part and "no headroom" in part and "pass@8" in part
    assert "below 2.0%" in part and "fewer than 2 prompts" in part  # the rule, stated
    assert "its pass@8 was 0% — expected" in part  # the demo's gain-against-headroom lines
    assert "the &lt;b&gt;data&lt;/b&gt;" in part and "<b>" not in part  # a file's text is escaped, never markup


def test_no_file_no_section_and_a_damaged_file_is_noted(make_run, section_of, tmp_path):
    run = make_run(tmp_path / "plain", summary=PPO_SUMMARY)
    assert "Headroom before RL" not in write_report(run).read_text()
    (run / "headroom.json").write_text('{"per_family": ')
    assert "headroom.json could not be read" in section_of(write_report(run).read_text(), "Headroom before RL")
