"""Checkpoint folders on disk: atomic write, completion marker, choice of the latest, pruning.

    RUN/checkpoints/step-N/
        model.safetensors   trainable weights (policy / LoRA adapters / value head / RM ...)
        state.safetensors   every other tensor: optimiser moments, RNG states, best policy ...
        state.json          everything else, as JSON (see `rlhflab.checkpoint.state`)
        sharded/            several processes with sharded weights (FSDP2) only: every rank's shards of the
                            trainable weights and their optimiser state (torch.distributed.checkpoint's
                            format, `rlhflab.parallel.state`); model.safetensors is then empty
        COMPLETE            written last: {"step": N, "files": {name: {"bytes", "sha256"}}}, every file above

A folder is written as `.tmp-step-N`, each file fsynced, renamed to `step-N`, and only
then gets its `COMPLETE` marker. A crash at any moment leaves either a `.tmp-*` folder
or a `step-N` without marker: both are ignored when choosing what to resume from and
removed by the next save. Nothing here needs pickle to load (safetensors + JSON only).

A run's final folders (model/, value/, adapter/) are written the same way by `atomic_folder`: into a hidden
`.tmp-<name>` beside them, fsynced, then renamed, so `chain` or a later stage never loads a half folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlhflab.checkpoint.state import decode, encode
from rlhflab.errors import UserInputError, writing

log = logging.getLogger("rlhflab")

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")
SHARDED = "sharded"  # the folder every rank writes its shards into (torch.distributed.checkpoint)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename / new entry in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_of(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest step first; folders without a marker are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def remove_checkpoint(path: Path) -> None:
    """Marker first, so a crash half-way through the delete never leaves a 'complete' folder with files missing."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def clean_incomplete(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove `.tmp-*` folders and `step-N` folders without a marker (left by a crash mid-write)."""
    removed = []
    for path in root.iterdir() if root.is_dir() else []:
        if path == keep or not path.is_dir():
            continue
        if path.name.startswith(".tmp-") or (step_of(path) is not None and not is_complete(path)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d incomplete checkpoint folder(s): %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def prune(root: Path, keep_last_n: int) -> list[Path]:
    """Delete all but the newest `keep_last_n` complete checkpoints (keep_last_n <= 0 keeps all)."""
    done = complete_checkpoints(root)
    old = done[:-keep_last_n] if keep_last_n > 0 else []
    for path in old:
        remove_checkpoint(path)
    return old


def save_checkpoint(root: Path, step: int, weights: dict[str, torch.Tensor], state: dict,
                    keep_last_n: int = 2) -> Path:
    """Write `root/step-<step>` atomically (see module doc); then clean up and prune older ones."""
    return finish_checkpoint(root, step, begin_checkpoint(root, step), weights, state, keep_last_n)


def begin_checkpoint(root: Path, step: int) -> Path:
    """A fresh, empty `.tmp-step-<step>` folder: other processes may write their shards into it before
    `finish_checkpoint` (one process) adds the files, renames it and writes the marker."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _files_under(folder: Path) -> list[str]:
    """Every file under `folder` (sub-folders too), as sorted relative paths."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def finish_checkpoint(root: Path, step: int, tmp: Path, weights: dict[str, torch.Tensor], state: dict,
                      keep_last_n: int = 2) -> Path:
    """Add the weights and state to `tmp`, make every file durable, rename it to `step-<step>`, marker last."""
    target = root / f"step-{step}"
    tensors: dict[str, torch.Tensor] = {}
    encoded = encode(state, tensors)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps(encoded))
    files = _files_under(tmp)
    _make_durable(tmp)
    if target.exists():  # an older write of the same step: an abandoned future, or one that never completed
        remove_checkpoint(target)
    os.replace(tmp, target)
    _fsync_dir(root)
    marker = {"step": step, "files": {n: {"bytes": (target / n).stat().st_size, "sha256": _sha256(target / n)}
                                      for n in files}}
    (target / f"{MARKER}.tmp").write_text(json.dumps(marker, indent=1))
    _fsync_file(target / f"{MARKER}.tmp")
    os.replace(target / f"{MARKER}.tmp", target / MARKER)
    _fsync_dir(target)
    clean_incomplete(root, keep=target)
    prune(root, keep_last_n)
    return target


def _make_durable(folder: Path) -> None:
    """fsync every file under `folder` and every folder holding one."""
    files = _files_under(folder)
    for name in files:
        _fsync_file(folder / name)
    for sub in {(folder / name).parent for name in files} | {folder}:
        _fsync_dir(sub)


def weight_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the modules' tensors as safetensors holds them: about what their saved folder needs on disk."""
    return sum(t.numel() * t.element_size() for m in modules if m is not None for t in m.state_dict().values())


@contextmanager
def atomic_folder(target: Path, what: str, run: Path | None = None, needed: int | None = None) -> Iterator[Path]:
    """Yield a fresh hidden `.tmp-<name>` beside `target` to write into; when the block ends, fsync it and rename
    it to `target` (a previous `target` is moved aside first and removed after). A failure, or a kill, leaves
    `target` as it was (or, killed between the two renames, absent with the old one in `.old-<name>`) and never
    half written; a failed write becomes `WriteFailed(what, ...)` (rlhflab.errors) with the temp folder removed."""
    tmp, old = target.parent / f".tmp-{target.name}", target.parent / f".old-{target.name}"
    try:
        with writing(what, target, run, needed):
            shutil.rmtree(tmp, ignore_errors=True)  # a kill's leftover
            tmp.mkdir(parents=True)
            yield tmp
            _make_durable(tmp)
            shutil.rmtree(old, ignore_errors=True)
            if target.exists():
                os.replace(target, old)
            try:
                os.replace(tmp, target)
            except OSError:
                if old.exists() and not target.exists():
                    os.replace(old, target)
                raise
            _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> dict:
    """The marker of a complete checkpoint, after checking every listed file's size and checksum."""
    if not path.is_dir():
        raise UserInputError("no checkpoint folder here", str(path), "pass RUN/checkpoints/step-N, or --resume latest")
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise UserInputError(f"checkpoint has no {MARKER} marker: it was never finished", str(path),
                             "resume from an earlier complete checkpoint, or --resume latest")
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        int(marker["step"])
        if not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                for e in files.values()):
            raise TypeError('"files" is not a map of {name: {"bytes", "sha256"}}')
    except (ValueError, KeyError, TypeError) as err:
        raise UserInputError(f"unreadable checkpoint marker ({err})", str(marker_path), _earlier_hint(path)) from err
    for name, expected in files.items():
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            raise UserInputError("checkpoint file is missing", str(file), _earlier_hint(path))
        if size != expected["bytes"]:
            raise UserInputError(f"checkpoint file is truncated or changed: {size} bytes, expected "
                                 f"{expected['bytes']}", str(file), _earlier_hint(path))
        if _sha256(file) != expected["sha256"]:
            raise UserInputError("checkpoint file is corrupt (sha256 differs from its marker)", str(file),
                                 _earlier_hint(path))
    return marker


def _earlier_hint(path: Path) -> str:
    earlier = [p for p in complete_checkpoints(path.parent) if p != path]
    if earlier:
        return f"resume from an earlier checkpoint: --resume {earlier[-1]}"
    return "no earlier complete checkpoint: start the run again with --overwrite"


def load_checkpoint(path: Path) -> tuple[int, dict[str, torch.Tensor], dict]:
    """(step, weights, state) of a verified checkpoint. Reads safetensors and JSON only: never pickle."""
    marker = verify(path)
    weights, tensors = _read_tensors(path / "model.safetensors"), _read_tensors(path / "state.safetensors")
    try:
        encoded = json.loads((path / "state.json").read_text())
    except ValueError as err:
        raise UserInputError(f"unreadable checkpoint state ({err})", str(path / "state.json")) from err
    return int(marker["step"]), weights, decode(encoded, tensors)


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise UserInputError(f"not a readable safetensors file ({err})", str(file), _earlier_hint(file.parent)) from err
