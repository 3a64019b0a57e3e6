"""The RM section of a report shows the length-bias probe, one row per filler."""

import re

from rlhflab.report import write_report


def test_rm_diagnosis_report_has_a_length_bias_table(make_run, tmp_path, checked):
    probe = {"pairs": 8, "fillers": ["hope_this_helps", "repeat_last_sentence"], "mean_change": 0.25,
             "share_raised": 0.75, "mean_added_tokens": 5.0, "change_per_token": 0.05, "plain_score_std": 1.0,
             "per_filler": {"hope_this_helps": {"mean_change": 0.5, "share_raised": 1.0, "mean_added_tokens": 4.0,
                                                "change_per_token": 0.125},
                            "repeat_last_sentence": {"mean_change": 0.0, "share_raised": 0.5,
                                                     "mean_added_tokens": 6.0, "change_per_token": "nan"}}}
    run = make_run(tmp_path / "diag", config={"seed": 0},
                   summary={"stage": "rm diagnose", "rm_diagnosis": {"roc_auc": 0.7}, "length_bias": probe})
    text = write_report(run).read_text()
    checked(run / "report.html")
    table = re.search(r'<table id="length-bias">(.*?)</table>', text, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    assert len(rows) == 4  # header, two fillers, all fillers
    assert "hope_this_helps" in rows[1] and ">0.5<" in rows[1] and "100.0%" in rows[1]
    assert "all fillers" in rows[3] and ">0.25<" in rows[3] and "75.0%" in rows[3]
