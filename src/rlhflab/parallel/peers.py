"""When a collective fails because another process of the job ended: which rank, how, and where this one was.

A rank that is killed (SIGKILL, the kernel's out-of-memory killer) says nothing; the ranks still running
only see their transport give up ("Connection reset by peer" from gloo) in whatever collective they were in.
So every rank records each rank's host and pid when the process group starts (`record_peers`), and a rank
whose collective fails looks its peers on the same host up in /proc (`describe_peer_loss`): a process that
is gone, or a zombie whose exit status (/proc/PID/stat field 52) says which signal ended it. The launcher
reaps its dead workers within a tenth of a second (torchrun's --monitor-interval), so the status is not
always still there to read; the rank is named either way. Peers on other hosts cannot be looked up from here:
the message says so and points at the launcher's own summary, which names the rank and its exit code.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from pathlib import Path

import torch.distributed as dist

_PEERS: list[tuple[str, int]] = []  # rank -> (host, pid), filled once the process group is joined
# what gloo / NCCL / the store say when the other end of a connection is gone
TRANSPORT_MARKS = ("/gloo/", "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator", "TCPStore")
# the part of the transport's message worth repeating
SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused", "Timed out")
WAIT_FOR_EXIT_S = 1.0  # a peer still exiting (its sockets closed first) becomes a zombie within this


def record_peers() -> None:
    """Every rank's (host, pid), gathered once after the process group is joined (one small collective)."""
    if len(_PEERS) == dist.get_world_size():
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
    _PEERS[:] = [tuple(p) for p in everyone]


def is_transport_error(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, is a collective or the store losing a peer."""
    for e in _chain(err):
        if isinstance(e, getattr(dist, "DistError", ())) or any(m in str(e) for m in TRANSPORT_MARKS):
            return True
    return False


def describe_peer_loss(err: BaseException) -> str | None:
    """One line for an error that is a peer process gone (None for any other error): who ended, how, and
    where this rank was waiting for it."""
    if not (dist.is_available() and dist.is_initialized()) or not is_transport_error(err):
        return None
    rank, size = dist.get_rank(), dist.get_world_size()
    where = waiting_in(err)
    said = next((s for e in _chain(err) for s in SYMPTOMS if s in str(e)), None)
    return (f"{ended_peers(rank, size)}, while rank {rank} waited for it{f' in {where}' if where else ''}"
            f"{f' ({said})' if said else ''}")


def ended_peers(rank: int, size: int) -> str:
    """'rank 1 of 2 (pid 22385 on this host) was killed by SIGKILL (...)', or why it is not known."""
    host = socket.gethostname()
    local = {r: pid for r, (h, pid) in enumerate(_PEERS) if h == host and r != rank}
    deadline = time.monotonic() + WAIT_FOR_EXIT_S
    while True:
        ended = {r: how for r, pid in local.items() if (how := exit_status(pid)) is not None}
        if ended or time.monotonic() > deadline:
            break
        time.sleep(0.02)  # a peer that closed its sockets is still exiting
    if not _PEERS:
        return f"a peer of rank {rank} of {size} ended or became unreachable (the launcher's summary names it)"
    if ended:
        return "; ".join(f"rank {r} of {size} (pid {local[r]} on this host) {how}" for r, how in sorted(ended.items()))
    elsewhere = sorted({h for r, (h, _) in enumerate(_PEERS) if h != host})
    if elsewhere:
        return (f"a rank on another host ({', '.join(elsewhere)}) ended or became unreachable (killed: SIGKILL or "
                "out of memory? the launcher's summary names the rank and its exit code)")
    return (f"a peer of rank {rank} of {size} ended or became unreachable, though every rank on this host still "
            "runs (the launcher's summary names the rank that failed)")


def exit_status(pid: int) -> str | None:
    """How process `pid` ended, from /proc: None while it runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ("ended (the launcher already collected its exit status; no message of its own: killed by "
                "SIGKILL or the out-of-memory killer?)")
    if fields[0] not in "ZX":
        return None
    status = int(fields[-1]) if len(fields) >= 50 else 0  # field 52: the status waitpid would return
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        oom = " (the kernel's out-of-memory killer sends it too)" if name == "SIGKILL" else ""
        return f"was killed by {name}{oom}"
    return f"exited with code {os.WEXITSTATUS(status)} (its own message above says why)"


def waiting_in(err: BaseException) -> str | None:
    """The innermost rlhflab frame outside parallel/ of the traceback: 'trainers/dpo.py:207 (train_step)'."""
    ours = [f for f in traceback.extract_tb(err.__traceback__) if f"{os.sep}rlhflab{os.sep}" in f.filename
            and f"{os.sep}rlhflab{os.sep}parallel{os.sep}" not in f.filename]
    if not ours:
        return None
    last = ours[-1]
    return f"{last.filename.rsplit(f'{os.sep}rlhflab{os.sep}', 1)[1]}:{last.lineno} ({last.name})"


def _chain(err: BaseException) -> list[BaseException]:
    """`err`, what it was raised from, and the failures a distributed checkpoint wraps (per rank)."""
    seen, todo = [], [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # rank -> (exception, its traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return seen
