"""Stand-ins for open_run's unit tests (checkpoint/test_resume_units.py, checkpoint/test_state_units.py): a callback
that is a report_to backend too, recording its rows, and a world of two ranks without a process group."""

from rlhflab.callbacks import Callback


class Rows(Callback):
    """A callback and a report_to backend: the rows it was sent, after ("opened", folder) as a backend."""

    def __init__(self, path=None):
        self.rows = [("opened", path)] if path else []

    def on_log(self, logs, step):
        self.rows.append((step, logs))

    log = on_log  # as a backend (tracking.RunDir's sinks)

    def close(self):
        pass


def recorder_backend(monkeypatch) -> list:
    """report_to=recorder: every Rows backend a run folder opens, listed."""
    from rlhflab import tracking

    opened = []
    monkeypatch.setitem(tracking.SINKS, "recorder", lambda path: opened.append(Rows(path)) or opened[-1])
    monkeypatch.setattr(tracking, "_installed", lambda name: True)
    return opened


class RankOf2:
    """A world of 2 ranks without a process group: rank 0 computes what it would broadcast (kept in `sent`), rank 1
    is handed `sent`."""

    world_size, distributed = 2, True

    def __init__(self, rank, sent=None):
        self.rank, self.sent = rank, sent

    @property
    def is_main(self):
        return self.rank == 0

    def from_main(self, compute):
        if self.rank == 0:
            self.sent = compute()
        return self.sent
