"""Open a run folder fresh or resumed, and the loop's checkpoint saver.

Resuming (`--resume latest` or `--resume RUN/checkpoints/step-N`) reuses the run folder
without wiping it: its config must match the saved config.yaml (or `--allow_config_change`,
recorded in summary.json), metrics.jsonl / samples.jsonl are cut back to their length at
the checkpoint so the history reads as if the run had never stopped (they are fsynced before
each checkpoint's marker; shorter than recorded, after a host crash lost their tail, they are
kept with a warning counting the rows lost), and complete
checkpoints newer than the one resumed from (an abandoned future) are deleted. Those
changes to the folder wait for `Resumed.commit()`, which a trainer calls once the
checkpoint is unpacked into its model and optimiser: a resume that fails there (weights
that do not fit the model) leaves the run folder exactly as it was. What the run reads again (model
and data folders, reward function files, versions) must match RUN/fingerprints.json too
(checkpoint/fingerprints.py), under the same rule as the config. The process that writes the folder
holds its lock, and a fresh run with `--overwrite` sets the run it replaces aside until its first
checkpoint (checkpoint/ownership.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import torch
import yaml

from rlhflab import parallel
from rlhflab.checkpoint.folder import SHARDED, _fsync_file, begin_checkpoint, complete_checkpoints, is_complete
from rlhflab.checkpoint.folder import finish_checkpoint, latest_checkpoint, load_checkpoint, remove_checkpoint, step_of
from rlhflab.checkpoint import fingerprints as prints
from rlhflab.checkpoint.ownership import OwnedRun, drop_replaced, holds_run, kept_message, lock_run, release_run
from rlhflab.checkpoint.ownership import replaced, set_aside
from rlhflab.checkpoint.ranks import FollowerRun, check_layout
from rlhflab.checkpoint.signals import Interrupted, StopSignals
from rlhflab.callbacks import Callback
from rlhflab.checkpoint.state import all_finite, encode
from rlhflab.config import config_to_dict, write_config
from rlhflab.errors import UserInputError, WriteFailed, write_error_reason
from rlhflab.tracking import RunDir, check_folder_free, default_run_path, sink_names

log = logging.getLogger("rlhflab")

# Keys that change nothing a run computes: they may differ between the run and its resume.
IGNORED_KEYS = ("resume", "allow_config_change", "progress", "overwrite", "save_every", "keep_last_n",
                "recipe_chosen_on")
HISTORIES = ("metrics.jsonl", "samples.jsonl")


@dataclass(frozen=True)
class Resumed:
    checkpoint: Path
    step: int
    weights: dict[str, torch.Tensor]
    state: dict  # what the trainer packed, plus "histories"
    config_changes: dict[str, dict]
    on_commit: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    def commit(self) -> None:
        """After the trainer unpacked the checkpoint: cut the histories back, drop newer checkpoints,
        record the resume (and any config change) in config.yaml / summary.json."""
        self.on_commit()


def resume_target(cfg) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) named by `cfg.resume`."""
    if cfg.resume == "latest":
        if not cfg.output_dir:
            raise UserInputError("--resume latest needs the run folder", "--output_dir",
                                 "pass --output_dir RUN (the folder of the run to continue)")
        run_path = Path(cfg.output_dir)
        found = latest_checkpoint(run_path / "checkpoints")
        if found is None:
            kept = replaced(run_path)  # a replacing run that ended before its first checkpoint
            raise UserInputError("no complete checkpoint to resume from", str(run_path / "checkpoints"),
                                 "start the run again (with --overwrite to replace the folder)"
                                 + (f"; {kept_message(run_path, kept)}" if kept else ""))
        return run_path, found
    checkpoint = Path(cfg.resume)
    if step_of(checkpoint) is None or checkpoint.parent.name != "checkpoints":
        raise UserInputError("not a checkpoint folder (RUN/checkpoints/step-N)", f"--resume {cfg.resume}",
                             "pass a step-N folder, or --resume latest --output_dir RUN")
    run_path = checkpoint.parent.parent
    if cfg.output_dir and Path(cfg.output_dir).resolve() != run_path.resolve():
        raise UserInputError(f"the checkpoint belongs to run {run_path}, not --output_dir {cfg.output_dir}",
                             "--resume", "drop --output_dir, or pass a checkpoint of that run")
    return run_path, checkpoint


def config_changes(cfg, saved: Path) -> dict[str, dict]:
    """{key: {"was", "now"}} for every field that differs from the run's config.yaml (IGNORED_KEYS aside)."""
    if not saved.is_file():
        raise UserInputError("the run folder has no config.yaml", str(saved.parent), "is this a run folder?")
    try:
        was = yaml.safe_load(saved.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserInputError(f"unreadable config.yaml ({err})", str(saved),
                             "restore the run's config.yaml, or start the run again with --overwrite") from err
    if not isinstance(was, dict):
        raise UserInputError(f"config.yaml holds a {type(was).__name__}, not a mapping of settings", str(saved),
                             "restore the run's config.yaml, or start the run again with --overwrite")
    now = config_to_dict(cfg)
    # a setting the run's config.yaml lacks came after the run was started: at its default it changes nothing
    defaults = config_to_dict(type(cfg)(**{f.name: getattr(cfg, f.name) for f in fields(cfg)
                                           if f.default is MISSING and f.default_factory is MISSING}))
    new_at_default = {k for k in set(now) - set(was) if now[k] == defaults.get(k)}
    keys = (set(was) | set(now)) - set(IGNORED_KEYS) - {"output_dir"} - new_at_default
    return {k: {"was": was.get(k), "now": now.get(k)} for k in sorted(keys) if was.get(k) != now.get(k)}


def history_position(run_path: Path) -> dict[str, dict]:
    """Bytes and lines of each history file now, fsynced (a checkpoint's marker must never promise rows a host
    crash can still take away); a resume cuts the files back to this."""
    out = {}
    for name in HISTORIES:
        file = run_path / name
        if file.exists():
            _fsync_file(file)
        text = file.read_bytes() if file.exists() else b""
        out[name] = {"bytes": len(text), "lines": text.count(b"\n")}
    return out


def check_histories(run_path: Path, position: dict[str, dict]) -> dict[str, int]:
    """Rows each history file lost against the checkpoint ({} when none); refuse (touching nothing) when a
    file is not the one the checkpoint saw the start of.

    A file shorter than recorded (a host crash took the tail the page cache had not written, or the run
    folder was copied mid-write) keeps its complete rows: the run continues from the checkpoint without the
    lost ones, which `restore_histories` counts in a warning."""
    lost = {}
    for name, at in position.items():
        file = run_path / name
        text = file.read_bytes() if file.exists() else b""
        if len(text) < at["bytes"]:
            lost[name] = at["lines"] - text.count(b"\n")
        elif text[: at["bytes"]].count(b"\n") != at["lines"]:
            raise UserInputError(f"{name} does not match the checkpoint's history", str(file))
    return lost


def restore_histories(run_path: Path, position: dict[str, dict]) -> dict[str, int]:
    """Cut each history file back to the checkpoint (a shorter one to its last complete row); the rows lost."""
    lost = check_histories(run_path, position)
    for name, at in position.items():
        file = run_path / name
        if not file.exists():
            continue
        size = file.stat().st_size
        if size >= at["bytes"]:
            os.truncate(file, at["bytes"])
            continue
        text = file.read_bytes()
        os.truncate(file, text.rfind(b"\n") + 1)  # a half-written last row goes too
        log.warning("%s has %d of the %d rows it held at the checkpoint (a crash lost the rest): continuing "
                    "from the checkpoint without the %d lost row(s)", file, at["lines"] - lost[name],
                    at["lines"], lost[name])
    return lost


SINGLE_LAYOUT = parallel.Layout("none", parallel.SINGLE)


def open_run(cfg, stage: str, layout: parallel.Layout = SINGLE_LAYOUT,
             callbacks: Sequence[Callback] = ()) -> tuple[RunDir, Resumed | None]:
    """The run folder, fresh (config.yaml and versions.json written) or resumed from `cfg.resume`; `callbacks`
    watch what it logs (rank 0).

    A resumed run's folder is only checked here; `Resumed.commit()` changes it (module doc). Several
    processes: rank 0 opens it (its error, if any, is raised on every rank); the others get a
    `FollowerRun` of the same path and read the same checkpoint, with a commit that does nothing.
    """
    world = layout.world
    if not world.distributed:
        return _open_here(cfg, stage, layout, callbacks)
    opened: list = []

    def open_on_main() -> tuple[str, str | None]:
        opened.extend(_open_here(cfg, stage, layout, callbacks))
        run, resumed = opened
        return str(run.path), str(resumed.checkpoint) if resumed is not None else None

    path, checkpoint = world.from_main(open_on_main)
    if world.is_main:
        return opened[0], opened[1]
    if checkpoint is None:
        return FollowerRun(path), None
    step, weights, state = load_checkpoint(Path(checkpoint))
    return FollowerRun(path), Resumed(Path(checkpoint), step, weights, state, {})


def _open_here(cfg, stage: str, layout: parallel.Layout,
               callbacks: Sequence[Callback]) -> tuple[RunDir, Resumed | None]:
    """`open_run` in the process that writes the run folder: it takes the folder's lock first (ownership.py),
    released again when opening fails."""
    path = resume_target(cfg)[0] if cfg.resume else Path(cfg.output_dir or default_run_path(stage))
    sink_names(cfg.report_to)  # a typo fails before anything is locked or moved
    if not cfg.resume:
        check_folder_free(path, cfg.overwrite)  # another run there, without --overwrite: refused untouched
    lock_run(path)
    try:
        return _open_resumed(cfg, stage, layout, callbacks) if cfg.resume else _open_fresh(cfg, path, callbacks)
    except BaseException:
        release_run(path)
        raise


def check_reads_outside(cfg, path: Path) -> None:
    """--overwrite sets the run in `path` aside and deletes it at the new run's first checkpoint: refuse before
    that when the new run reads from it (e.g. --model RUN/model --output_dir RUN), which would lose the input.
    RUN/inputs/ (the Python API's datasets) is carried over, so it is allowed."""
    inside = {name: p for name, p in prints.read_paths(cfg).items()
              if p.resolve().is_relative_to(path.resolve()) and not p.resolve().is_relative_to((path / "inputs").resolve())}
    if inside:
        named = ", ".join(f"{name} {p}" for name, p in inside.items())
        raise UserInputError(f"--overwrite would replace {path}, which holds what this run reads ({named}); the old "
                             "run is deleted once the new one checkpoints", "--output_dir",
                             "write the new run to another --output_dir, or copy what it reads out of the old run first")


def _open_fresh(cfg, path: Path, callbacks: Sequence[Callback]) -> tuple[RunDir, None]:
    """A new run in `path` (locked); a run there (--overwrite) is set aside until this one checkpoints."""
    if holds_run(path):
        check_reads_outside(cfg, path)
        reads_inputs = any(str(v).startswith(str(path / "inputs")) for v in config_to_dict(cfg).values())
        set_aside(path, read_inputs=reads_inputs)
    run = OwnedRun(path, overwrite=cfg.overwrite, report_to=cfg.report_to, callbacks=callbacks)
    # leftovers of a folder that held no whole run: never resume into its checkpoints, never merge into its
    # summary / report
    shutil.rmtree(run.path / "checkpoints", ignore_errors=True)
    for name in ("summary.json", "report.html"):
        (run.path / name).unlink(missing_ok=True)
    write_config(cfg, run.path / "config.yaml")
    run.write_json(prints.FILE, prints.fingerprints(cfg))
    run.write_versions(cfg.seed)
    return run, None


def input_changes(cfg, run_path: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """(what differs from RUN/fingerprints.json, the fingerprints now); a run started before they were
    recorded has nothing to differ from."""
    now = prints.fingerprints(cfg)
    saved = run_path / prints.FILE
    if not saved.is_file():
        log.info("%s has no %s (started by an older rlhflab): its inputs are not checked", run_path, prints.FILE)
        return {}, now
    try:
        was = json.loads(saved.read_text())
    except ValueError as err:
        raise UserInputError(f"unreadable {prints.FILE} ({err})", str(saved),
                             "restore it, or delete it to resume without checking the inputs") from err
    return prints.fingerprint_changes(was, now), now


def _open_resumed(cfg, stage: str, layout: parallel.Layout,
                  callbacks: Sequence[Callback]) -> tuple[RunDir, Resumed]:
    run_path, checkpoint = resume_target(cfg)
    changes = config_changes(cfg, run_path / "config.yaml")
    inputs, fingerprints_now = input_changes(cfg, run_path)
    if (changes or inputs) and not cfg.allow_config_change:
        listed = "; ".join(f"{k}: {v['was']!r} -> {v['now']!r}" for k, v in changes.items())
        read = "; ".join(f"{k}: {v['was'] or 'none'} -> {v['now'] or 'none'}" for k, v in inputs.items())
        what = " and ".join(filter(None, [changes and f"the config differs from the run's config.yaml ({listed})",
                                          inputs and f"what the run reads changed since it started ({read})"]))
        raise UserInputError(what, f"--resume {cfg.resume}",
                             "resume with the run's own settings and inputs, or pass --allow_config_change to "
                             "proceed (the differences are recorded in summary.json)")
    step, weights, state = load_checkpoint(checkpoint)
    check_layout(state.get("parallel"), layout, f"--resume {cfg.resume}")
    check_histories(run_path, state["histories"])
    run = OwnedRun(run_path, resume=True, report_to=cfg.report_to, callbacks=callbacks)

    def commit() -> None:
        lost = restore_histories(run_path, state["histories"])
        for newer in [p for p in complete_checkpoints(checkpoint.parent) if step_of(p) > step]:
            log.warning("removing %s: resuming from step %d abandons it", newer, step)
            remove_checkpoint(newer)
        if changes:
            write_config(cfg, run_path / "config.yaml")
            log.warning("resuming with config changes: %s", changes)
        if inputs:
            log.warning("resuming with changed inputs: %s", inputs)
        run.write_json(prints.FILE, fingerprints_now)
        run.write_versions(cfg.seed)
        summary = json.loads((run_path / "summary.json").read_text()) if (run_path / "summary.json").exists() else {}
        run.update_summary(resumes=[*summary.get("resumes", []),
                                    {"step": step, "checkpoint": str(checkpoint), "config_changes": changes,
                                     "input_changes": inputs,
                                     **({"lost_history_rows": lost} if lost else {})}])
        log.info("resuming %s from %s (step %d)", stage, checkpoint, step)

    return run, Resumed(checkpoint, step, weights, state, changes, commit)


Contents = Callable[[], tuple[dict[str, torch.Tensor], dict]]
ShardWriter = Callable[[Path], None]  # every rank writes its shards into the folder it is given


class Checkpointer:
    """The loop's side of checkpoints: every `save_every` steps, at the end, and when a stop signal came;
    `save_every` < 0: only when a stop signal came (the run's model folder is still written at its end).

    Use as a context manager around the loop (it installs the SIGINT / SIGTERM handlers).
    `contents()` packs (weights, state) only when a checkpoint is actually written, on rank 0 only.
    Several processes: every rank calls `step_done` / `finish` (the ranks agree on a stop signal any of
    them received); with a sharded layout every rank's `write_shards` fills `step-N/sharded/` first.
    """

    def __init__(self, run_path: Path, save_every: int, keep_last_n: int, saved_step: int | None = None,
                 layout: parallel.Layout = SINGLE_LAYOUT, write_shards: ShardWriter | None = None):
        """`saved_step`: the step of the checkpoint a resumed run started from (already on disk)."""
        if layout.sharded and write_shards is None:
            raise ValueError("a sharded layout needs write_shards (every rank's part of the state)")
        self.run_path = run_path
        self.root = run_path / "checkpoints"
        self.save_every = save_every
        self.keep_last_n = keep_last_n
        self.signals = StopSignals()
        self.saved_step = saved_step
        self.layout = layout
        self.write_shards = write_shards

    def __enter__(self) -> Checkpointer:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signals.__exit__(*exc)

    def step_done(self, step: int, contents: Contents) -> None:
        """After a finished step: save when due or when a signal asked; then raise `Interrupted` on a signal."""
        parallel.fail_if_asked(self.layout.world, step)
        signum = self.layout.world.max(self.signals.requested or 0) or None  # any rank's signal stops them all
        if signum is not None or (self.save_every > 0 and step % self.save_every == 0):
            self.save(step, contents)
            if signum is None:  # not one a signal asked for: a Ctrl-C to stop a mistaken --overwrite keeps the old run
                self._drop_replaced()
        if signum is not None:
            raise Interrupted(signum, step, self.root / f"step-{step}")

    def finish(self, step: int, contents: Contents) -> None:
        """The end-of-run checkpoint, unless this step was just saved or `save_every` is negative (none)."""
        if self.save_every >= 0 and self.saved_step != step:
            self.save(step, contents)
            self._drop_replaced()

    def _drop_replaced(self) -> None:
        if self.layout.world.is_main:
            drop_replaced(self.run_path)

    def save(self, step: int, contents: Contents) -> Path:
        """Rank 0 packs (and checks) the contents and opens `.tmp-step-N`; with a sharded layout every rank
        writes its shards into it; rank 0 adds the rest and the marker. An error on rank 0 reaches every rank."""
        world, packed = self.layout.world, []

        def begin() -> str:
            packed.append(self._pack(step, contents))  # non-finite weights: raised before any folder exists
            return str(begin_checkpoint(self.root, step))

        try:
            tmp = Path(world.from_main(begin))
            if self.layout.sharded:
                self.write_shards(tmp / SHARDED)  # every rank, at once (torch.distributed.checkpoint)
            path = Path(world.from_main(
                lambda: str(finish_checkpoint(self.root, step, tmp, *packed[0], self.keep_last_n))))
        except Exception as err:
            failed = self._failed(step, packed, err)
            if failed is err:
                raise
            raise failed from err
        self.saved_step = step
        return path

    def _failed(self, step: int, packed: list, err: Exception) -> Exception:
        """After a failed save: the partial folder removed (complete checkpoints untouched); a failed write
        as `WriteFailed` naming the checkpoint, the space its tensors needed and the last complete one."""
        if self.layout.world.is_main:  # `.tmp-step-N`, or `step-N` renamed but without its marker
            for leftover in (self.root / f".tmp-step-{step}", self.root / f"step-{step}"):
                if leftover.is_dir() and not is_complete(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
        reason = write_error_reason(err)
        if isinstance(err, WriteFailed) or reason is None:
            return err
        needed = None
        if packed:
            tensors: dict[str, torch.Tensor] = {}
            encode(packed[0][1], tensors)
            needed = sum(t.numel() * t.element_size() for t in [*packed[0][0].values(), *tensors.values()])
        return WriteFailed(f"checkpoint step-{step}", self.root / f"step-{step}", reason, self.run_path, needed)

    def _pack(self, step: int, contents: Contents) -> tuple[dict[str, torch.Tensor], dict]:
        weights, state = contents()
        if not all_finite(weights):  # DESIGN.md: never checkpoint after a non-finite loss or gradient
            raise FloatingPointError(f"step {step}: non-finite weights; no checkpoint written")
        return weights, {**state, "histories": history_position(self.run_path), "parallel": self.layout.describe()}
