"""Who writes a run folder, and what `--overwrite` does with the run already in it
(docs/reading-a-run.md "Checkpoints and resume").

Lock: the process that writes RUN (rank 0 of a multi-process run) holds `RUN/.lock`, a file locked with
flock(2) and holding its pid, host and start time. The kernel drops the lock when the process ends,
however it ends (SIGKILL, OOM), so a lock left behind is known to be stale: it is taken over with a note.
A second run on RUN while the first is alive is refused, naming the first one's pid. Where the file
system has no flock, the pid is checked instead (same host: alive or not). The lock is released (the
file removed) when the run ends; one process opens its runs one after another, so a run it opens again
(a resume after a failed run in a notebook) reuses the lock it holds.

Replacing: `--overwrite` on a folder that holds a run moves that run aside to `RUN.replaced-<time>` (a
sibling, one rename) and notes it in `RUN/.replacing.json`; the old run is deleted only when the new run's
first scheduled checkpoint is complete (or, with no checkpoints, when the run ends with its model written).
A run that fails or is killed before that leaves the old one there, and says where.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

from rlhflab.errors import UserInputError
from rlhflab.tracking import RUN_MARKERS, RunDir

log = logging.getLogger("rlhflab")

LOCK = ".lock"
REPLACING = ".replacing.json"
_held: dict[str, int] = {}  # resolved run folder -> the fd of its flock'ed .lock, in this process


def _key(path: Path) -> str:
    return str(path.resolve())


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system (or OS) has no flock."""
    try:
        import fcntl
    except ImportError:  # Windows: the recorded pid is judged instead
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        held = json.loads(os.read(fd, 4096) or b"{}")
        return held if isinstance(held, dict) else {}
    except ValueError:
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refuse(path: Path, holder: dict) -> UserInputError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return UserInputError(
        f"another run is writing this folder: process {holder.get('pid', '?')} on {holder.get('host', '?')} "
        f"(since {since})", str(path),
        "wait for it to end or stop it; start a second run with another --output_dir")


def lock_run(path: Path) -> None:
    """Hold RUN/.lock for this process (module doc): refuse a live holder, take over one left behind."""
    key = _key(path)
    if key in _held:
        return
    path.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        locked, holder = _flock(fd), _holder(fd)
        if locked is None:  # no flock here: judge the recorded process (one on another host cannot be checked)
            pid = holder.get("pid")
            locked = not pid or pid == os.getpid() or (holder.get("host") == socket.gethostname()
                                                       and not _alive(int(pid)))
        if not locked:
            os.close(fd)
            raise _refuse(path, holder)
        try:  # the file may have been removed (a run that ended) between open and flock: lock the new one
            same = os.stat(path / LOCK).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if holder.get("pid") and holder.get("pid") != os.getpid():
        log.warning("%s: taking over the lock left by process %s on %s, which has ended (killed or crashed)",
                    path, holder.get("pid"), holder.get("host"))
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    _held[key] = fd


def release_run(path: Path) -> None:
    """Remove RUN/.lock if this process holds it."""
    fd = _held.pop(_key(path), None)
    if fd is not None:
        with contextlib.suppress(FileNotFoundError):
            (path / LOCK).unlink()
        os.close(fd)


@contextlib.contextmanager
def releasing_locks() -> Iterator[None]:
    """Around one stage: the locks it took are released however it ends; a failure says where a run it was
    replacing is kept."""
    before = set(_held)
    try:
        yield
    except BaseException:
        for key in set(_held) - before:
            kept = replaced(Path(key))
            if kept:
                log.warning("%s", kept_message(Path(key), kept))
        raise
    finally:
        for key in set(_held) - before:
            release_run(Path(key))


def holds_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_MARKERS)


def replaced(path: Path) -> list[Path]:
    """The runs `--overwrite` moved aside for the run in `path`, not yet deleted."""
    try:
        return [Path(p) for p in json.loads((path / REPLACING).read_text())["replaced"]]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return []


def kept_message(path: Path, kept: list[Path]) -> str:
    return (f"the run that --overwrite replaced in {path} is kept at {', '.join(map(str, kept))} until this run's "
            f"first checkpoint is complete; to put it back: rm -r {path} && mv {kept[0]} {path}")


def set_aside(path: Path, read_inputs: bool = False) -> Path:
    """Move the run in `path` (locked by this process) to a sibling RUN.replaced-<time>; `path` is made again,
    empty and locked. `read_inputs`: the new run reads files in RUN/inputs/ (the API wrote them there), which
    are linked back. A run that itself was replacing one carries that one along."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    fd = _held.pop(_key(path))
    os.rename(path, aside)  # the lock moves with it, still held: no other run can slip in and write the old run
    try:
        lock_run(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            (aside / LOCK).unlink()
        os.close(fd)
    earlier = replaced(aside)
    (aside / REPLACING).unlink(missing_ok=True)
    if read_inputs and (aside / "inputs").is_dir():
        shutil.copytree(aside / "inputs", path / "inputs", copy_function=_link_or_copy)
    (path / REPLACING).write_text(json.dumps({"replaced": [*map(str, earlier), str(aside)]}) + "\n")
    log.warning("%s", kept_message(path, [*earlier, aside]))
    return aside


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def drop_replaced(path: Path) -> None:
    """Delete the runs this run replaced: its first checkpoint is complete (or it ended with its model)."""
    for old in replaced(path):
        shutil.rmtree(old, ignore_errors=True)
        log.info("removed %s, the run --overwrite replaced: this run has its first checkpoint", old)
    (path / REPLACING).unlink(missing_ok=True)


class OwnedRun(RunDir):
    """The run folder as the process that writes it holds it: closing it (the run ended, its model written)
    deletes a run it replaced and releases the lock."""

    def close(self) -> None:
        super().close()
        drop_replaced(self.path)
        release_run(self.path)
