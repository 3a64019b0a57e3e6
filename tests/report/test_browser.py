"""A real run's report.html opened in headless Chromium: what a reader sees, not what the HTML says.

The other report tests parse the HTML; this one asks a browser. A tiny `rlhflab demo` (SFT -> PPO with the
checker -> reward model -> its diagnosis -> PPO with the reward model -> held-out test, a few seconds)
writes the page, Chromium (Debian's chromium-headless-shell, driven by Playwright without its own browser
download) opens it from disk, and the tests read the rendered page: the verdict, the per-family table, that
every plot decoded and takes up room on the screen, and that the console stayed clean and nothing was fetched.

The browser is installed here with apt when it is missing and the user is root (as in CI); where that
cannot be done the tests are skipped with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlhflab.cli import main

BROWSERS = ("chromium-headless-shell", "chromium")  # either Debian package works; the first is 60 MB smaller
APT_PACKAGE = "chromium-headless-shell"
VERDICT = "Did the model get better on held-out prompts?"
FAMILIES = "Pass rate per family"
Z95 = 1.959964


def apt_install(package: str) -> str:
    """Install a Debian package; '' when it worked, else why not (for the skip reason)."""
    if not shutil.which("apt-get"):
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return f"not root: run `apt-get install {package}` as root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120", package]
    for command in (install, ["apt-get", "update"], install):  # a fresh machine has no package lists yet
        try:
            proc = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took over 300 s"
        if proc.returncode == 0 and command is install:
            return ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return f"`{' '.join(install)}` failed: {tail[0]}"


def find_or_install_browser() -> tuple[str | None, str]:
    """(path of a Chromium binary, '') or (None, why there is none)."""
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if found:
        return found, ""
    why = apt_install(APT_PACKAGE)
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    return (found, "") if found else (None, why or f"apt installed {APT_PACKAGE} but none of {BROWSERS} is on PATH")


@dataclass
class Reading:
    """What the browser showed: text by section, tables as cell texts, every plot's state, and trouble."""

    verdict: str = ""
    family_rows: list[list[str]] = field(default_factory=list)  # header row first
    plots: list[dict] = field(default_factory=list)  # tag, alt, decoded, natural_width, width, height
    console_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)


# Runs in the page after load. Closed <details> are opened first: a reader can open them, and a plot in a
# closed one has no box to measure.
READ_PAGE = """() => {
    document.querySelectorAll('details').forEach(d => { d.open = true; });
    const section = title => [...document.querySelectorAll('section')]
        .find(s => s.firstElementChild && s.firstElementChild.innerText.trim() === title);
    const verdict = section(%s), families = section(%s);
    const table = families && families.querySelector('table');
    return {
        verdict: verdict ? verdict.innerText : '',
        family_rows: table ? [...table.rows].map(r => [...r.cells].map(c => c.innerText.trim())) : [],
        plots: [...document.querySelectorAll('img, svg, canvas')].map(e => {
            const box = e.getBoundingClientRect();
            return {tag: e.tagName.toLowerCase(), alt: e.getAttribute('alt') || '',
                    decoded: e.tagName !== 'IMG' || (e.complete && e.naturalWidth > 0),
                    natural_width: e.naturalWidth || 0, width: box.width, height: box.height};
        }),
    };
}""" % (json.dumps(VERDICT), json.dumps(FAMILIES))


def read_in_browser(browser, path: Path) -> Reading:
    """Open `path` in a fresh page, offline: any request that is not the file itself or a data: URI is
    recorded and refused, as it would fail for a reader without a network."""
    reading = Reading()
    page = browser.new_page()
    page.on("console", lambda m: m.type == "error" and reading.console_errors.append(m.text))
    page.on("pageerror", lambda e: reading.console_errors.append(f"uncaught: {e}"))

    def offline(route):
        if route.request.url.startswith(("file:", "data:")):
            return route.continue_()
        reading.outside_requests.append(route.request.url)
        return route.abort()

    page.route("**/*", offline)
    page.goto(path.resolve().as_uri(), wait_until="load")
    for key, value in page.evaluate(READ_PAGE).items():
        setattr(reading, key, value)
    page.close()
    return reading


@pytest.fixture(scope="module")
def browser():
    executable, why = find_or_install_browser()
    if executable is None:
        pytest.skip(f"no headless Chromium: {why}")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=executable)
        except sync_api.Error as error:
            pytest.skip(f"{executable} does not start: {str(error).splitlines()[0]}")
        yield chromium
        chromium.close()


TINY_DEMO = ["--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64", "--sft_examples", "64",
             "--batch_size", "8", "--max_steps", "8", "--eval_every", "4", "--eval_prompts", "4",
             "--max_new_tokens", "6", "--save_every", "0", "--num_train_prompts", "22",
             "--num_validation_prompts", "11", "--num_test_prompts", "33", "--threads", "1", "--progress", "false",
             "--ppo_total_episodes", "16", "--rm_pair_prompts", "16", "--rm_hard_negatives", "0",
             "--rm_calibration_coef", "0", "--rm_diagnosis_samples", "1"]
TINY_PPO = "batch_size: 8\nnum_mini_batches: 2\nnum_ppo_epochs: 1\nresponse_length: 6\neval_every: 1\n" \
           "eval_prompts: 4\nsample_prompts: 2\nsave_every: 0\n"
TINY_RM = "pairs_per_prompt: 1\nnum_epochs: 1\nbatch_size: 8\nsave_every: 0\n"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, browser) -> Path:
    """A real `rlhflab demo` on a tiny model; its report.html is the one the command writes."""
    folder = tmp_path_factory.mktemp("browser")
    (folder / "ppo.yaml").write_text(TINY_PPO)
    (folder / "rm.yaml").write_text(TINY_RM)
    out = folder / "demo"
    assert main(["demo", "--output_dir", str(out), "--ppo_config", str(folder / "ppo.yaml"),
                 "--rm_config", str(folder / "rm.yaml"), *TINY_DEMO]) == 0
    assert (out / "report.html").is_file()
    return out


@pytest.fixture(scope="module")
def reading(browser, demo_run) -> Reading:
    return read_in_browser(browser, demo_run / "report.html")


@pytest.fixture(scope="module")
def summary(demo_run) -> dict:
    return json.loads((demo_run / "summary.json").read_text())


def numbers(text: str, signed: bool = False) -> list[float]:
    """The numbers in a cell; rates are unsigned, so '3.1–26.5' reads as two of them."""
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?" if signed else r"\d+(?:\.\d+)?", text)]


RATE = r"(\d+(?:\.\d+)?)%(?:\s*\[([^\]]*)\])?"  # '49.0%' or '49.0% [43.4–54.6]' as a reader sees it


def wilson(rate: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a pass rate over n prompts, in percent."""
    centre = (rate + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(rate * (1 - rate) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return 100 * (centre - half), 100 * (centre + half)


def check_rate(shown: list[float], rate: float, n: int, where) -> None:
    """`shown`: a rate in percent, then maybe its 95 % interval; that must be the Wilson interval over n."""
    assert shown[0] == pytest.approx(100 * rate, abs=0.051), where
    if len(shown) > 1:
        assert shown[1:3] == pytest.approx(wilson(rate, n), abs=0.051), where


def test_the_verdict_states_each_models_held_out_rate_against_sft(reading, summary):
    rates = summary["test_pass_rate"]  # {"sft": r, "ppo": r, "ppo_rm": r}
    n = sum(summary["test_tables"]["sft"]["counts"].values())
    lines = [line for line in reading.verdict.splitlines() if line.strip()]
    assert lines[0] == VERDICT and lines[1]  # the heading, then the one-sentence verdict
    if all(rates[name] <= rates["sft"] for name in ("ppo", "ppo_rm")):  # no gain is never called better, by any rule
        assert not lines[1].startswith("Better"), lines[1]
    for name in ("ppo", "ppo_rm"):
        line = next(line for line in lines if f"sft → {name})" in line)
        shown = re.search(RATE + r"\s*→\s*" + RATE, line)
        assert shown, line
        check_rate([float(shown[1]), *numbers(shown[2] or "")], rates["sft"], n, line)
        check_rate([float(shown[3]), *numbers(shown[4] or "")], rates[name], n, line)
        change = re.search(r"([-+]\d+\.\d) (?:points|pts)", line)
        assert change and float(change[1]) == pytest.approx(100 * (rates[name] - rates["sft"]), abs=0.051), line


def test_the_family_table_shows_every_familys_rate_and_count_as_the_summary_has_them(reading, summary):
    header, *rows = reading.family_rows
    tables = summary["test_tables"]
    assert header[0] == "family" and header[1:4] == ["sft", "ppo", "ppo_rm"] and header[4:] == ["change", "n"]
    counts = tables["sft"]["counts"]
    assert [r[0] for r in rows] == sorted(counts) + ["overall"]
    assert sum(counts.values()) == 33 and all(n == 3 for n in counts.values())
    for family, *cells, change, n in rows:
        count = sum(counts.values()) if family == "overall" else counts[family]
        assert numbers(n) == [count], (family, n)
        rates = [tables[c]["overall"] if family == "overall" else tables[c]["per_family"][family] for c in header[1:4]]
        for column, cell, rate in zip(header[1:4], cells, rates):
            check_rate(numbers(cell), rate, count, (family, column, cell))
        shown = numbers(change, signed=True)  # sft -> ppo_rm in points, then maybe the interval of the difference
        assert shown[0] == pytest.approx(100 * (rates[-1] - rates[0]), abs=0.051), (family, change)
        if len(shown) == 3:
            assert shown[1] <= shown[0] <= shown[2], (family, change)
    # some cells with an interval and others without would read as if the bare ones were exact
    assert len({len(numbers(cell)) for row in rows for cell in row[1:4]}) == 1, rows


def test_every_plot_decodes_and_takes_room_on_the_screen(reading, demo_run):
    source = (demo_run / "report.html").read_text()
    assert len(reading.plots) == source.count("<img ") + source.count("<svg") + source.count("<canvas")
    assert len(reading.plots) >= 20  # curves of SFT, two PPO runs, the reward model, and the pass-rate plots
    broken = [p for p in reading.plots if not p["decoded"] or p["width"] < 100 or p["height"] < 60]
    assert not broken, broken[:5]
    assert all(p["alt"] for p in reading.plots)  # a reader without images still learns what each one shows


def test_the_console_is_clean_and_nothing_is_fetched(reading):
    assert reading.console_errors == []
    assert reading.outside_requests == []


def test_the_reading_catches_a_broken_page(browser, tmp_path):
    """The checks above can fail: a page with an undecodable image, a remote image and a script error."""
    page = tmp_path / "broken.html"
    page.write_text(f"<html><body><section><h2>{VERDICT}</h2><p>Better.</p></section>"
                    "<img alt='bad' src='data:image/png;base64,AAAA'><img alt='far' src='https://example.com/a.png'>"
                    "<img alt='tiny' width='1' height='1' src='data:image/gif;base64,"
                    "R0lGODlhAQABAAAAACH5BAEKAAEALAAAAAABAAEAAAICTAEAOw=='>"
                    "<script>undefinedFunction()</script></body></html>")
    reading = read_in_browser(browser, page)
    assert reading.verdict.startswith(VERDICT) and reading.family_rows == []
    assert [(p["alt"], p["decoded"]) for p in reading.plots] == [("bad", False), ("far", False), ("tiny", True)]
    assert reading.plots[2]["width"] == 1
    assert reading.outside_requests == ["https://example.com/a.png"]
    assert any("undefinedFunction" in e for e in reading.console_errors)
