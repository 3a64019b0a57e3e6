"""Synthetic run folders (written here, no training) and an HTML checker for the report tests."""

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

VOID = {"img", "meta", "br", "hr", "input", "link", "wbr"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, *, config=None, metrics=None, samples=None, summary=None, versions=None,
              worst_cases=None) -> Path:
    """A run folder with exactly the files given (None = file absent, [] = empty file)."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for name, rows in (("metrics.jsonl", metrics), ("samples.jsonl", samples)):
        if rows is not None:
            (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if versions is not None:
        (path / "versions.json").write_text(json.dumps(versions))
    if worst_cases is not None:
        (path / "worst_cases.md").write_text(worst_cases)
    return path


def ppo_metrics(updates: int = 6, kl=lambda i: 0.1 * i) -> list[dict]:
    rows = [{"step": 0, "episode": 0, "val/pass_rate": 0.49, "val/pass_rate/lowercase": 0.5,
             "val/pass_rate/yes_no": 0.25}]
    for i in range(1, updates + 1):
        rows.append({"step": i, "objective/scores": 0.3 + 0.05 * i, "objective/kl": kl(i),
                     "objective/rlhf_reward": 0.3, "objective/entropy": 1.0 - 0.05 * i, "val/ratio": 1.0,
                     "policy/ratio_min": 0.8, "policy/ratio_max": 1.2, "policy/clipfrac_avg": 0.05,
                     "loss/value_avg": 0.5 / i, "val/explained_variance": 0.1 * i, "response/length_mean": 8.0,
                     "time/generation": 1.0, "time/scoring": 0.5, "time/training": 2.0})
    rows.append({"step": updates, "episode": 64 * updates, "val/pass_rate": 0.67, "val/pass_rate/lowercase": 0.75,
                 "val/pass_rate/yes_no": 0.5})
    return rows


def sample_rows(steps=(0, 10, 20, 30, 40), answer=lambda step: f"answer at {step}") -> list[dict]:
    return [{"step": s, "family": "lowercase", "prompt": "Lowercase: ABC", "answer": answer(s), "reference": "abc",
             "passed": s >= 20, "kind": "pass" if s >= 20 else "wrong_case", "reason": "r"} for s in steps]


PPO_SUMMARY = {"stage": "ppo", "reward": "checker", "validation_pass_rate": {"start": 0.49, "end": 0.67},
               "final": {"objective/kl": 0.6, "objective/scores": 0.6}, "wall_time_s": {"ppo": 42.0}}
VERSIONS = {"python": "3.11.7", "torch": "2.13.0+cpu", "platform": "Linux", "cpu_count": 2, "gpus": []}


@pytest.fixture
def ppo_run(tmp_path):
    return write_run(tmp_path / "ppo_run", config={"seed": 7, "learning_rate": 1e-4, "model": "sft/model",
                                                   "eval_prompts": 100, "num_validation_prompts": 300},
                     metrics=ppo_metrics(), samples=sample_rows(), summary=PPO_SUMMARY, versions=VERSIONS)


class CheckedPage(HTMLParser):
    """Parses a page and checks every non-void tag is closed in order; records imgs, tags and text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.imgs, self.tags, self.text = [], [], [], [], []
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"unclosed: {self.stack}")

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs).get("src", ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def check_page(path: Path) -> CheckedPage:
    """Parse a written page; assert it is well nested and every image is an embedded PNG."""
    page = CheckedPage(path.read_text(encoding="utf-8"))
    assert not page.errors, page.errors[:5]
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,"), src[:80]
        assert base64.b64decode(src.split(",", 1)[1], validate=True).startswith(PNG_SIGNATURE)
    return page


def section_html(text: str, heading: str) -> str:
    """The HTML of the first <section> whose heading is `heading`."""
    match = re.search(rf"<section[^>]*><h\d>{re.escape(heading)}</h\d>(.*?)</section>", text, re.S)
    assert match, f"no section '{heading}'"
    return match.group(1)


# the helpers as fixtures: with --import-mode=importlib a test module cannot import conftest
@pytest.fixture
def make_run():
    return write_run


@pytest.fixture
def checked():
    return check_page


@pytest.fixture
def metrics_rows():
    return ppo_metrics


@pytest.fixture
def samples_rows():
    return sample_rows


@pytest.fixture
def section_of():
    return section_html
