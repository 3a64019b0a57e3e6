"""Write the suite as JSONL files, and the text a tokenizer for it is trained on.

Other stages (and TRL, for comparison runs) read the files, so the built-in
suite and a user's own data travel the same path.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

from rlhflab.tasks.base import blank
from rlhflab.tasks.checker import FAMILIES
from rlhflab.tasks.pools import SPLITS
from rlhflab.tasks.rows import pair_rows, prompt_rows, sft_rows
from rlhflab.tasks.splits import build_splits, sample_items


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def export_suite(
    out_dir: str | Path,
    *,
    seed: int = 0,
    train: int = 400,
    validation: int = 300,
    test: int = 300,
    sft_examples: int = 4000,
    violation_fraction: float = 0.6,
    dominant_share: float = 0.75,
    pair_kinds: Sequence[str] | None = None,
    pairs_per_prompt: int = 3,
) -> dict[str, Path]:
    """Write {split}/sft.jsonl, {split}/pairs.jsonl, {split}/prompts.jsonl and manifest.json.

    Train SFT rows are `sft_examples` fresh prompts from the train pool; validation
    and test SFT rows are one per split prompt, mixed with violations the same way.
    Returns {"train/sft": path, ..., "manifest": path}.
    """
    out = Path(out_dir)
    splits = build_splits(seed, train=train, validation=validation, test=test)
    paths: dict[str, Path] = {}
    counts: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        items = splits[split]
        sft_items = sample_items("train", sft_examples, seed=seed, split_seed=seed) if split == "train" else items
        tables = {
            "sft": sft_rows(sft_items, violation_fraction, dominant_share, seed=seed),
            "pairs": pair_rows(items, pair_kinds, pairs_per_prompt, seed=seed),
            "prompts": prompt_rows(items),
        }
        for name, rows in tables.items():
            paths[f"{split}/{name}"] = _write_jsonl(out / split / f"{name}.jsonl", rows)
        counts[split] = {name: len(rows) for name, rows in tables.items()}
    manifest = {
        "parameters": {
            "seed": seed, "train": train, "validation": validation, "test": test,
            "sft_examples": sft_examples, "violation_fraction": violation_fraction,
            "dominant_share": dominant_share, "pair_kinds": list(pair_kinds) if pair_kinds is not None else None,
            "pairs_per_prompt": pairs_per_prompt,
        },
        "families": list(FAMILIES),
        "counts": counts,
    }  # fmt: skip
    paths["manifest"] = out / "manifest.json"
    paths["manifest"].write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths


def template_corpus() -> list[str]:
    """Texts to train the BPE tokenizer on: every template and answer frame, content removed.

    Merges then cover the template words, never content words, so an unseen test
    word is spelled from the same single characters as a train word. The last
    text holds every character the suite can produce, so each one is in the vocabulary.
    """
    texts: list[str] = []
    for family in FAMILIES.values():
        texts.extend(blank(t) for t in family.templates)
        texts.extend(family.frames)
    texts = list(dict.fromkeys(t for t in texts if t))  # dedupe, keep order
    chars = set(string.ascii_letters + string.digits + " \n").union(*texts)
    texts.append("".join(sorted(chars)))
    return texts
