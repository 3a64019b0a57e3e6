"""The one exception type for user mistakes, and the exceptions the CLI turns into exit codes (stop signal,
a write that failed).

Every bad path, malformed row, unknown config key or oversized prompt raises
`UserInputError` with what was wrong, where, and what to do about it.
Torch-free on purpose: `rlhflab.cli` imports this, and `rlhflab report` / `--help` must not load torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Iterator

# docs/reading-a-run.md "Checkpoints and resume": 130 SIGINT / 143 SIGTERM (step finished, checkpoint written);
# 4 a second signal while the first was handled (out at once, last complete checkpoint untouched);
# 5 a checkpoint, model folder or history file could not be written (disk full, I/O error);
# 6 another process of the job ended (killed, out of memory, its own error): this one stopped too.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
ABORTED_EXIT_CODE = 4
WRITE_FAILED_EXIT_CODE = 5
PEER_LOST_EXIT_CODE = 6


class UserInputError(ValueError):
    """A mistake in something the user supplied (file, row, config key, model)."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        parts = [what if where is None else f"{where}: {what}"]
        if fix:
            parts.append(f"-> {fix}")
        super().__init__(" ".join(parts))


class StageFailed(RuntimeError):
    """A stage run in a child process (the demo's stages side by side) stopped; the message says where its log is.
    `exit_code`: what the CLI returns (the child's own when it says a write failed, else 1)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):
        return type(self), (str(self), self.exit_code)


class Interrupted(Exception):
    """A stop signal arrived; the step in progress finished and `checkpoint` holds the run's state."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)
        run = checkpoint.parent.parent
        super().__init__(f"{signal.Signals(signum).name} after step {step}: checkpoint {checkpoint}; "
                         f"continue with --resume latest --output_dir {run}")


class WriteFailed(Exception):
    """Writing `what` at `path` failed (a full disk, an I/O error): the run stopped, and nothing complete was touched.

    Its message is one line: what, where, the operating system's reason, the space it needed (`needed` bytes,
    when known) beside what is free, the run's last complete checkpoint and the command that resumes from it.
    `stage` is the `rlhflab` command that resumes `run` (filled in by whoever knows it: `run_stage`, the CLI,
    the demo); without it, or without a complete checkpoint, the message says to start again.
    """

    def __init__(self, what: str, path: str | Path, reason: str, run: str | Path | None = None,
                 needed: int | None = None, stage: str | None = None):
        self.what, self.path, self.reason = what, Path(path), reason
        self.run = Path(run) if run is not None else None
        self.needed, self.stage = needed, stage
        super().__init__(what, str(path), reason)

    def __reduce__(self):  # crosses to the other ranks (parallel.World.from_main) with every field
        return _rebuild_write_failed, (self.__dict__,)

    def __str__(self) -> str:
        space, free = "", _free_bytes(self.path)  # now: after the partial write was removed
        if self.needed is not None:
            space = f" (needed about {_size(self.needed)}"
            space += f", {_size(free)} free)" if free is not None else ")"
        elif free is not None:
            space = f" ({_size(free)} free)"
        return f"could not write {self.what} to {self.path}: {self.reason}{space}; {self.how_to_go_on()}"

    def last_checkpoint(self) -> Path | None:
        """The run's newest checkpoint with its COMPLETE marker (rlhflab.checkpoint.folder's rule, read here
        without torch)."""
        root = self.run / "checkpoints" if self.run is not None else None
        if root is None or not root.is_dir():
            return None
        done = [(int(m.group(1)), p) for p in root.iterdir()
                if (m := re.match(r"^step-(\d+)$", p.name)) and (p / "COMPLETE").is_file()]
        return max(done)[1] if done else None

    def how_to_go_on(self) -> str:
        checkpoint = self.last_checkpoint()
        if checkpoint is None or self.stage is None:
            where = f"last complete checkpoint {checkpoint}" if checkpoint else "no complete checkpoint"
            return f"{where}; free space, then start the run again (--overwrite)"
        return (f"last complete checkpoint {checkpoint}; free space, then resume with: rlhflab {self.stage} "
                f"--config {self.run / 'config.yaml'} --resume latest --output_dir {self.run}")


def _rebuild_write_failed(fields: dict) -> WriteFailed:
    err = WriteFailed.__new__(WriteFailed)
    err.__dict__.update(fields)
    Exception.__init__(err, fields["what"], str(fields["path"]), fields["reason"])
    return err


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing folder); None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def write_error_reason(err: BaseException) -> str | None:
    """The operating system's reason when `err` is a failed write (an OSError, or safetensors' error that
    wraps one: 'I/O error: No space left on device (os error 28)'), else None."""
    if isinstance(err, WriteFailed):
        return None
    if isinstance(err, OSError):
        number = err.errno if err.errno is not None else next(iter(err.args), None)  # OSError(ENOSPC) alone too
        return _os_reason(number) if isinstance(number, int) else str(err)
    if type(err).__name__ == "SafetensorError":  # by name: importing safetensors here would be layer-0 weight
        code = re.search(r"(?:code: |os error )(\d+)", str(err))  # 'IoError(Os { code: 28 ..' / '(os error 28)'
        if code:
            return _os_reason(int(code.group(1)))
        if "IoError" in str(err) or "I/O error" in str(err):
            return str(err)
    return None


def _os_reason(number: int) -> str:
    name = errno.errorcode.get(number)
    return f"{os.strerror(number)} ({name or f'errno {number}'})"


@contextlib.contextmanager
def writing(what: str, path: str | Path, run: str | Path | None = None,
            needed: int | None = None) -> Iterator[None]:
    """Turn a failed write inside the block into `WriteFailed(what, path, ...)`; other errors pass unchanged."""
    try:
        yield
    except Exception as err:
        reason = write_error_reason(err)
        if reason is None:
            raise
        raise WriteFailed(what, path, reason, run, needed) from err
