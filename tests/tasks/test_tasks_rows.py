"""SFT, pair and prompt rows have the requested mix; export writes them; pass-rate table sums."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlhflab.errors import UserInputError
from rlhflab.tasks import (
    FAMILIES,
    VIOLATION_KINDS,
    TaskItem,
    Verdict,
    build_splits,
    check,
    export_suite,
    pair_rows,
    pass_rate_table,
    prompt_rows,
    sample_items,
    sft_rows,
)


def _item_of(row: dict, items_by_prompt: dict[str, TaskItem]) -> TaskItem:
    return items_by_prompt[row["prompt"]]


def test_sft_rows_mix_is_exact():
    items = sample_items("train", 4000, seed=0)
    rows = sft_rows(items, violation_fraction=0.6, dominant_share=0.75, seed=0)
    assert len(rows) == 4000
    assert [r["prompt"] for r in rows] == [i.prompt for i in items]
    violating = [(item, row) for item, row in zip(items, rows) if row["violation"] != "none"]
    assert len(violating) == 2400
    dominant = [row for item, row in violating if row["violation"] == FAMILIES[item.family].kinds[0]]
    assert len(dominant) == 1800
    assert not any(row["violation"] == "missing_eos" for row in rows)
    for item, row in zip(items, rows):
        assert set(row) == {"prompt", "completion", "family", "violation"}
        verdict = check(item, row["completion"])
        assert verdict.kind == ("pass" if row["violation"] == "none" else row["violation"])
    others = Counter(row["violation"] for item, row in violating if row["violation"] != FAMILIES[item.family].kinds[0])
    assert len(others) >= 7  # the non-dominant 25% spread over many kinds
    assert sft_rows(items[:50], seed=1) == sft_rows(items[:50], seed=1)


def test_sft_rows_extremes_and_errors():
    items = sample_items("validation", 22, seed=0)
    assert all(r["violation"] == "none" for r in sft_rows(items, violation_fraction=0.0))
    assert all(r["violation"] != "none" for r in sft_rows(items, violation_fraction=1.0))
    with pytest.raises(UserInputError, match=r"violation_fraction must be in \[0, 1\], got 1.5"):
        sft_rows(items, violation_fraction=1.5)


def test_pair_rows_all_kinds():
    items = build_splits(0)["validation"]
    by_prompt = {i.prompt: i for i in items}
    rows = pair_rows(items, pairs_per_prompt=3, seed=0)
    assert len(rows) == 3 * len(items)  # every family has >= 3 kinds
    per_prompt: dict[str, list[str]] = {}
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected", "family", "violation"}
        item = _item_of(row, by_prompt)
        assert row["chosen"] == item.reference != row["rejected"]
        assert check(item, row["chosen"]).passed
        assert check(item, row["rejected"]).kind == row["violation"]
        per_prompt.setdefault(row["prompt"], []).append(row["violation"])
    for prompt, kinds in per_prompt.items():
        assert len(set(kinds)) == 3
        assert kinds[0] == FAMILIES[by_prompt[prompt].family].kinds[0]
    assert {r["violation"] for r in rows} == set(VIOLATION_KINDS)


def test_pair_rows_kinds_filter():
    items = build_splits(0)["validation"]
    rows = pair_rows(items, kinds=["wrong_case"], pairs_per_prompt=3)
    with_case = [i for i in items if "wrong_case" in FAMILIES[i.family].kinds]
    assert len(with_case) < len(items)  # number_only has no case to get wrong: skipped
    assert len(rows) == len(with_case)
    assert {r["violation"] for r in rows} == {"wrong_case"}
    eos = pair_rows(items[:5], kinds=["missing_eos"], pairs_per_prompt=1)
    assert len(eos) == 5 and all(r["rejected"].startswith(r["chosen"] + "\n" + r["chosen"]) for r in eos)
    with pytest.raises(UserInputError, match="unknown violation kinds"):
        pair_rows(items, kinds=["typo"])


def test_pair_rows_always_kinds_follow_the_dominant_kind_and_leave_other_seeds_alone():
    items = build_splits(0)["validation"]
    plain = pair_rows(items, pairs_per_prompt=3, seed=0)
    assert pair_rows(items, pairs_per_prompt=3, seed=0, always=()) == plain  # no change without `always`
    rows = pair_rows(items, pairs_per_prompt=3, seed=0, always=["wrong_content"])
    per_prompt: dict[str, list[str]] = {}
    for row in rows:
        per_prompt.setdefault(row["prompt"], []).append(row["violation"])
    for item in items:
        kinds, family_kinds = per_prompt[item.prompt], FAMILIES[item.family].kinds
        assert len(kinds) == 3 and kinds[0] == family_kinds[0]
        assert ("wrong_content" in kinds) == ("wrong_content" in family_kinds)  # every family that has it
    share = lambda rs: sum(r["violation"] == "wrong_content" for r in rs) / len(rs)  # noqa: E731
    assert share(rows) > share(plain)
    one = pair_rows(items, pairs_per_prompt=1, seed=0, always=["wrong_content"])
    assert [r["violation"] for r in one] == [FAMILIES[i.family].kinds[0] for i in items]  # the dominant kind first
    with pytest.raises(UserInputError, match="unknown violation kinds"):
        pair_rows(items, always=["typo"])


def test_prompt_rows():
    items = build_splits(0)["test"][:3]
    assert prompt_rows(items) == [{"prompt": i.prompt, "family": i.family, "reference": i.reference} for i in items]


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_export_suite(tmp_path):
    paths = export_suite(tmp_path, seed=2, train=44, validation=22, test=11, sft_examples=110, pairs_per_prompt=2)
    assert sorted(paths) == sorted(
        [f"{s}/{n}" for s in ("train", "validation", "test") for n in ("sft", "pairs", "prompts")] + ["manifest"]
    )
    columns = {
        "sft": {"prompt", "completion", "family", "violation"},
        "pairs": {"prompt", "chosen", "rejected", "family", "violation"},
        "prompts": {"prompt", "family", "reference"},
    }
    manifest = json.loads(paths["manifest"].read_text())
    expected = {"train": (110, 88, 44), "validation": (22, 44, 22), "test": (11, 22, 11)}
    for split, (n_sft, n_pairs, n_prompts) in expected.items():
        assert manifest["counts"][split] == {"sft": n_sft, "pairs": n_pairs, "prompts": n_prompts}
        for name, n in zip(("sft", "pairs", "prompts"), (n_sft, n_pairs, n_prompts)):
            path = paths[f"{split}/{name}"]
            assert path == tmp_path / split / f"{name}.jsonl"
            rows = _read(path)
            assert len(rows) == n and all(set(r) == columns[name] for r in rows)
    assert manifest["parameters"]["sft_examples"] == 110 and manifest["parameters"]["pair_kinds"] is None
    assert manifest["families"] == list(FAMILIES)
    train_sft = _read(paths["train/sft"])
    assert sum(r["violation"] != "none" for r in train_sft) == 66  # round(0.6 * 110)


def test_pass_rate_table():
    ok = Verdict(True, "pass", "exact match")
    table = pass_rate_table(
        [
            ("yes_no", ok),
            ("yes_no", Verdict(False, "wrong_case", "x")),
            ("sum_result", ok),
            ("sum_result", Verdict(False, "missing_space", "x")),
            ("sum_result", Verdict(False, "missing_space", "x")),
        ]
    )
    assert table["overall"] == pytest.approx(2 / 5)
    assert table["per_family"] == {"sum_result": pytest.approx(1 / 3), "yes_no": 0.5}
    assert table["counts"] == {"sum_result": 3, "yes_no": 2}
    assert table["violations"]["missing_space"] == 2 and table["violations"]["wrong_case"] == 1
    assert list(table["violations"]) == list(VIOLATION_KINDS)
    assert pass_rate_table([])["overall"] == 0.0
