"""The report says how many rows each user reward / verifier function lost (summary.json's reward_errors)."""

from rlhflab.report import write_report

TITLE = "Rows your reward and verifier functions lost"


def test_rows_lost_per_function_are_tabulated_with_the_mode_and_limit(make_run, tmp_path, section_of, checked):
    summary = {"stage": "grpo", "reward_errors": {"mode": "invalid", "timeout_s": 600, "lost_rows": {
        "reward function exact": {"raised": 3, "timed_out": 8}, "verifier <b>bad</b>": {"raised": 0, "timed_out": 0}}}}
    out = write_report(make_run(tmp_path / "r", summary=summary))
    checked(out)
    text = out.read_text()
    part = section_of(text, TITLE)
    assert "<th scope=\"row\">reward function exact</th><td class=\"num\">3</td><td class=\"num\">8</td>" \
           "<td class=\"num\">11</td>" in part
    assert "verifier &lt;b&gt;bad&lt;/b&gt;" in part  # a function's name is text
    assert "--reward_errors invalid, 600 s per call; rows lost: left out of the update" in part


def test_no_section_without_user_functions(make_run, tmp_path):
    text = write_report(make_run(tmp_path / "r", summary={"stage": "grpo", "reward_errors": {}})).read_text()
    assert TITLE not in text
