"""Every python and bash block of the documentation (docs/*.md and README.md) runs, so the pages cannot drift
from the code.

A block that cannot run here says so right above its fence, and why: `<!-- not run: needs a GPU -->`; a block
another test runs as written names it: `<!-- run by: tests/test_readme_walkthrough.py ... -->` (that file must
name the page). Every other block runs, page by page, top to bottom in one namespace per page, like a notebook:

- python blocks through `exec`, with the stage configs (`rlhflab.GRPOConfig` ...) swapped for ones that keep the
  block's settings but make the run small (`SMALL`: a few steps or updates of a tiny model);
- bash blocks line by line: `rlhflab ...` in this process through `rlhflab.cli.main` with the same small settings
  appended as flags (later flags win), `torchrun ... -m rlhflab ...` as launched (small settings, one thread a
  process), `cd` and `export` here, anything else (`mkdir`, a heredoc) in bash.

Every page starts in a fresh folder holding what its examples name: the demo's SFT and reward models
(`runs/demo/sft/model`, `runs/demo/rm/model`: a tiny model with the suite's tokenizer, a reward model trained on
it), `runs/sft/model`, the files of "Your own data" (written by that page's own block), and `configs/`. A hub
model id becomes the tiny model's folder (`HUB`): nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from tinyhf import save_suite_model

import rlhflab
from rlhflab import cli
from rlhflab.api import compare_methods
from rlhflab.config import STAGES

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
RUN_LANGUAGES = ("python", "bash")
HUB = ("Qwen/Qwen2.5-0.5B-Instruct",)  # hub model ids the runnable blocks name -> the tiny model's folder

# --- small settings: each stage's fields that make a run take a second -------------------------------------
SUITE = dict(num_train_prompts=22, num_validation_prompts=8, num_test_prompts=8, sft_examples=64, threads=2,
             progress=False, write_report=False, max_new_tokens=4)
ONLINE = dict(SUITE, total_episodes=8, batch_size=4, response_length=4, eval_prompts=4, sample_prompts=2,
              console_samples=0, headroom_samples=0, calibration_prompts=8, num_mini_batches=1)
SMALL = {
    "sft": dict(SUITE, max_steps=2, batch_size=8, eval_prompts=4, hidden_size=32, num_layers=1, num_heads=4,
                intermediate_size=64),
    "rm": dict(SUITE, batch_size=8, pair_prompts=16, hard_negatives=0, calibration_coef=0.0, max_length=48),
    "dpo": dict(SUITE, max_steps=2, batch_size=4, eval_prompts=4),
    "ppo": dict(ONLINE, num_ppo_epochs=1, value_warmup_rollouts=0),
    "grpo": dict(ONLINE, num_generations=2),
    "rloo": dict(ONLINE, num_generations=2),
    "reinforce": dict(ONLINE),
    "online-dpo": dict(ONLINE, num_generations=2),
    "eval": dict(SUITE),
    "rm diagnose": dict(SUITE, samples_per_prompt=2),
    "compare": dict(SUITE, budget="episodes=8", kl_samples=1),
}
# compare's per-method sections (a section may not hold the shared fields or the budget)
COMPARE_SECTIONS = {"ppo": dict(batch_size=4, num_mini_batches=1, num_ppo_epochs=1, value_warmup_rollouts=0,
                                eval_prompts=4, console_samples=0, headroom_samples=0),
                    **{m: dict(batch_size=4, num_generations=2, eval_prompts=4, console_samples=0, headroom_samples=0)
                       for m in ("grpo", "rloo", "online-dpo")},
                    "reinforce": dict(batch_size=4, eval_prompts=4, console_samples=0, headroom_samples=0),
                    "dpo": dict(batch_size=4, eval_prompts=4)}
DEMO = ["--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64", "--sft_examples", "64",
        "--batch_size", "8", "--max_steps", "4", "--eval_every", "0", "--eval_prompts", "4", "--max_new_tokens", "4",
        "--save_every", "0", "--num_train_prompts", "22", "--num_validation_prompts", "8", "--num_test_prompts", "8",
        "--threads", "1", "--progress", "false", "--stage_processes", "1", "--stages_side_by_side", "false",
        "--ppo_total_episodes", "8", "--rm_pair_prompts", "16", "--rm_hard_negatives", "0", "--rm_extra_layers", "0",
        "--rm_calibration_coef", "0", "--rm_diagnosis_samples", "1", "--headroom_samples", "0"]
TINY_PPO_YAML = "batch_size: 4\nnum_mini_batches: 1\nnum_ppo_epochs: 1\nvalue_warmup_rollouts: 0\nresponse_length: 4\neval_prompts: 4\n" \
                "sample_prompts: 2\nsave_every: 0\nconsole_samples: 0\n"
TINY_RM_YAML = "pairs_per_prompt: 1\nnum_epochs: 1\nbatch_size: 8\nsave_every: 0\n"
CONFIG_STAGES = {"SFTConfig": "sft", "RewardConfig": "rm", "RMConfig": "rm", "DPOConfig": "dpo", "PPOConfig": "ppo",
                 "GRPOConfig": "grpo", "RLOOConfig": "rloo", "ReinforceConfig": "reinforce",
                 "REINFORCEConfig": "reinforce", "OnlineDPOConfig": "online-dpo", "EvalConfig": "eval",
                 "RMDiagnoseConfig": "rm diagnose", "CompareConfig": "compare"}


# --- the blocks of a page ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str  # the HTML comment right above the fence, or ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(not run|run by):\s*(.*?)\s*-->$")


def page_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(page, i + 1, language, code, above if above.startswith("<!--") else ""))
        i = end + 1
    return blocks


def runnable(page: Path) -> list[Block]:
    return [b for b in page_blocks(page) if b.language in RUN_LANGUAGES and not b.marker]


def test_every_block_is_run_or_says_why_not():
    for page in PAGES:
        for block in page_blocks(page):
            if block.language not in RUN_LANGUAGES or not block.marker:
                continue
            found = MARKER.match(block.marker)
            assert found, f"{block.where}: write <!-- not run: WHY --> or <!-- run by: tests/FILE.py --> above it"
            kind, reason = found.groups()
            if kind == "not run":
                assert len(reason.split()) >= 3, f"{block.where}: say why it is not run, not just {reason!r}"
            else:
                test_file = ROOT / reason.split()[0]
                assert test_file.is_file(), f"{block.where}: {test_file} does not exist"
                assert page.name in test_file.read_text(), f"{block.where}: {test_file.name} does not read {page.name}"


def test_the_fences_are_what_the_pages_mean():
    """A block meant to run has a language; an output sample is `text`, so nothing runnable hides as plain."""
    for page in PAGES:
        for block in page_blocks(page):
            assert block.language, f"{block.where}: name the block's language (python, bash, yaml, text)"


# --- running them --------------------------------------------------------------------------------------------
def stage_of(argv: list[str]) -> tuple[str, int]:
    """The stage an `rlhflab` argv runs and how many words name it."""
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in ("rm diagnose", "tasks export"):
        return f"{argv[0]} {argv[1]}", 2
    return argv[0], 1


def fields_of(stage: str, settings: dict) -> dict:
    """The settings the stage's config has (the suite's sizes are not every stage's fields)."""
    names = {f.name for f in dataclasses.fields(STAGES[stage])}
    return {key: value for key, value in settings.items() if key in names}


def flags(stage: str) -> list[str]:
    return [word for key, value in fields_of(stage, SMALL.get(stage, {})).items()
            for word in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))]


@contextlib.contextmanager
def working_in(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


class Runner:
    """One page's examples, in order, in one folder and one Python namespace."""

    def __init__(self, folder: Path, hub_model: str, monkeypatch):
        self.folder, self.hub_model, self.monkeypatch = folder, hub_model, monkeypatch
        self.namespace: dict = {"__name__": "__docs__"}
        self.outputs = 0  # run folders named here for commands that name none
        (folder / "tiny_ppo.yaml").write_text(TINY_PPO_YAML)
        (folder / "tiny_rm.yaml").write_text(TINY_RM_YAML)

    # python ----------------------------------------------------------------------------------------------
    def run_python(self, block: Block) -> None:
        code = block.code
        for hub_id in HUB:
            code = code.replace(hub_id, self.hub_model)
        for name, stage in CONFIG_STAGES.items():
            self.monkeypatch.setattr(rlhflab, name, shrunk(STAGES[stage], stage), raising=False)
        self.monkeypatch.setattr(rlhflab, "compare_methods", small_compare(compare_methods))
        exec(compile(code, block.where, "exec"), self.namespace)

    # bash ------------------------------------------------------------------------------------------------
    def run_bash(self, block: Block, only_files: bool = False) -> None:
        for command in commands(block.code):
            self.run_command(command, block, only_files)

    def run_command(self, command: str, block: Block, only_files: bool) -> None:
        if "<<" not in command and "&&" in command:
            for part in command.split("&&"):
                self.run_command(part.strip(), block, only_files)
            return
        for hub_id in HUB:
            command = command.replace(hub_id, self.hub_model)
        words = shlex.split(command, comments=True) if "<<" not in command else [command.split()[0]]
        if not words:
            return
        if words[0] == "cd":
            os.chdir(words[1])
        elif words[0] == "export":
            key, value = words[1].split("=", 1)
            self.monkeypatch.setenv(key, value)
        elif words[0] == "rlhflab":
            if not only_files:
                self.rlhflab(words[1:], block)
        elif words[0] == "torchrun":  # a launch of several processes: for real, each process on one thread
            at = words.index("rlhflab")
            self.shell(shlex.join([*words[:at + 1], *self.small(words[at + 1:]), "--threads", "1"]), block)
        else:
            self.shell(command, block)

    def shell(self, command: str, block: Block) -> None:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{block.where}: {command[:80]!r} failed:\n{done.stderr[-3000:]}"

    def rlhflab(self, argv: list[str], block: Block) -> None:
        argv = self.small(argv)
        code = cli.main(argv)
        assert code == 0, f"{block.where}: rlhflab {' '.join(argv)} exited {code}"

    def small(self, argv: list[str]) -> list[str]:
        """The command with small settings appended (per stage of a chain; a sweep's stage)."""
        if argv[0] == "chain":
            segments, current = [], []
            for word in [*argv[1:], "then"]:
                if word == "then":
                    segments.append(self.small(current))
                    current = []
                else:
                    current.append(word)
            return ["chain", *[w for i, s in enumerate(segments) for w in ([] if i == 0 else ["then"]) + s]]
        stage, _ = stage_of(argv)
        if stage == "demo":
            extra = [*DEMO, "--ppo_config", str(self.folder / "tiny_ppo.yaml"),
                     "--rm_config", str(self.folder / "tiny_rm.yaml")]
        elif stage == "sweep":
            extra = flags(argv[argv.index("--stage") + 1] if "--stage" in argv else "ppo")
        elif stage == "compare":  # the tiny sections of the methods listed (a section for another is refused)
            listed = argv[argv.index("--methods") + 1].split(",") if "--methods" in argv else list(COMPARE_SECTIONS)
            bases = {m.removesuffix("-async").split("+")[0] for m in listed}
            config = self.folder / f"tiny_compare_{self.outputs}.yaml"
            config.write_text(yaml.safe_dump({m: v for m, v in COMPARE_SECTIONS.items() if m in bases}))
            extra = [*flags("compare"), "--config", str(config)]
        elif stage in STAGES:
            extra = flags(stage)
            if "--overlong_buffer_len" in argv:  # the page's buffer, within the shrunk response_length
                extra += ["--overlong_buffer_len", "2"]
        else:
            extra = []
        writes = stage not in ("report", "tasks export", "chain")
        if writes and not {"--output_dir", "--out", "--output-dir"} & set(argv):
            self.outputs += 1  # two runs started within one second would otherwise share a default folder
            extra += ["--output_dir", f"runs/docs-{self.outputs}"]
        return [*argv, *extra]


def shrunk(cls, stage: str):
    """`cls(**fields)` with the small settings of `stage` laid over the block's own."""
    small = fields_of(stage, SMALL[stage])

    def make(**fields):
        return dataclasses.replace(cls(**fields), **small)

    return make


def small_compare(compare_methods):
    def run(args, sections=None):
        methods = args.methods.split(",")
        merged = {m: {**COMPARE_SECTIONS[m], **(sections or {}).get(m, {})} for m in methods}
        return compare_methods(args, merged)

    return run


def commands(script: str) -> list[str]:
    """The script's commands: continuation lines joined, a heredoc kept with the line that opens it."""
    lines = script.replace("\\\n", " ").splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        heredoc = re.search(r"<<\s*'?(\w+)'?", line)
        if heredoc:
            end = lines.index(heredoc.group(1), i + 1)
            out.append("\n".join(lines[i:end + 1]))
            i = end + 1
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
        i += 1
    return out


# --- the folder every page starts from ------------------------------------------------------------------------
OWN_DATA = ROOT / "docs" / "own-data.md"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """What the pages' examples name: the own-data files, the demo's models, configs/."""
    root = tmp_path_factory.mktemp("docs-base")
    with working_in(root):
        walkthrough = next(b for b in page_blocks(OWN_DATA) if b.language == "bash")
        Runner(root, "", None).run_bash(walkthrough, only_files=True)  # mkdir, cd, the data, my_rewards.py
    folder = root / "mywork"
    save_suite_model(folder / "runs" / "demo" / "sft" / "model")
    with working_in(folder), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["rm", "--model", "runs/demo/sft/model", "--output_dir", "runs/demo/rm", "--save_every", "0",
                         *flags("rm")]) == 0
    shutil.copytree(folder / "runs" / "demo" / "sft" / "model", folder / "runs" / "sft" / "model")
    (folder / "configs").symlink_to(ROOT / "configs")
    return folder


LEAVE_OUT = {  # what a page makes itself
    "getting-started.md": ["runs/demo"],  # its demo writes runs/demo
    "README.md": ["runs/sft"],  # its commands train runs/sft
}


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_the_page_runs(page, base, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "work"
    shutil.copytree(base, folder, symlinks=True)
    for path in LEAVE_OUT.get(page.name, []):
        shutil.rmtree(folder / path)
    monkeypatch.chdir(folder)
    runner = Runner(folder, str(base / "runs" / "demo" / "sft" / "model"), monkeypatch)
    ran = []
    for block in runnable(page):
        if block.language == "python":
            runner.run_python(block)
        else:
            runner.run_bash(block)
        ran.append(block.where)
    assert ran == [b.where for b in runnable(page)]  # every unmarked block of the page, in order
