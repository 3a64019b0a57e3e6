"""Peak resident memory of the calling process (stdlib only: the TRL child imports it from its own venv)."""

from __future__ import annotations

import resource
from pathlib import Path


def rss_mib() -> float:
    """Peak RSS of this process in MiB: VmHWM, the high-water mark of its own memory map. Not
    ru_maxrss: on Linux a child started by fork + exec inherits the parent's ru_maxrss, so it
    would read at least the (large) driver process's RSS."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
