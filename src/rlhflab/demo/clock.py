"""The demo's own clock: wall and CPU seconds of each part, and how fast and busy the machine was meanwhile."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import torch

# The reference work of matmul_speed: a demo-size layer's matmul (a micro-batch's tokens x hidden @ hidden x MLP)
REFERENCE_SHAPE = (1280, 96, 256)


def matmul_speed(seconds: float = 0.25) -> float:
    """GFLOP/s of one thread on REFERENCE_SHAPE matmuls, repeated for about `seconds`: the cores' speed now,
    comparable between machines and between hours of one machine (the demo's clock moves with it)."""
    rows, inner, cols = REFERENCE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=generator), torch.randn(inner, cols, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm-up
        done, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(10):
                torch.mm(a, b)
            done += 10
    finally:
        torch.set_num_threads(threads)
    return 2 * rows * inner * cols * done / elapsed / 1e9


class StageClock:
    """Wall and CPU seconds of each part of the demo (the demo's own clock and its split).

    CPU seconds are this process's, all threads, plus a child process's given to `add_cpu` (a stage run
    beside the others, counted under its part). On a machine others share, wall time grows with
    their load while CPU time moves much less, so the pair tells a slow machine from a slow demo;
    the 1-minute load average at start and end says how shared it was. A virtual machine's core can also be slower
    at one hour than at another with no load of its own to show for it (its host is shared): `matmul_gflops`, a
    fixed single-thread matmul timed at start and end (matmul_speed), says how fast the cores were."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.load_start = os.getloadavg()[0]
        self.elsewhere_cpu = 0.0  # CPU seconds of child processes (add_cpu)
        self.speed_start = matmul_speed()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, cpu = time.time(), time.process_time()
        yield
        self.wall[name] = self.wall.get(name, 0.0) + time.time() - wall
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu

    def add(self, name: str, wall: float, cpu: float) -> None:
        """Wall and CPU seconds of this process measured elsewhere for part `name` (a share of a longer span)."""
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu

    def add_cpu(self, name: str, seconds: float) -> None:
        """CPU seconds spent elsewhere (a stage run in a child process) for part `name` and the total."""
        self.cpu[name] = self.cpu.get(name, 0.0) + seconds
        self.elsewhere_cpu += seconds

    def summary(self, total_wall: float, total_cpu: float) -> dict:
        rounded = lambda parts, total: {**{k: round(v, 1) for k, v in parts.items()},  # noqa: E731
                                        "total": round(total, 1)}
        return {"wall_time_s": rounded(self.wall, total_wall),
                "cpu_time_s": rounded(self.cpu, total_cpu + self.elsewhere_cpu),
                "load_average_1min": {"start": round(self.load_start, 2), "end": round(os.getloadavg()[0], 2)},
                "matmul_gflops": {"start": round(self.speed_start, 1), "end": round(matmul_speed(), 1)}}


def describe_clock(summary: dict) -> list[str]:
    """The end of the demo's output: each part's wall seconds, CPU seconds, load and the cores' speed. A stage run
    beside the others (side_by_side: the checker's PPO in a second process) shows its own seconds, where it ran, and
    the wait for it after the stages it ran beside (its part of wall_time_s: often 0, which alone read as 'ppo took
    no time')."""
    beside = summary.get("side_by_side") or {}
    parts = {k: v for k, v in summary["wall_time_s"].items() if k not in ("total", "setup")}
    others = [k for k in parts if k in ("rm_diagnosis", "ppo_rm")] or ["the reward model's stages"]
    split = [f"{k} {beside[k]:.0f} s beside {' and '.join(others)} ({v:.0f} s waited after them; RUN/{k}.log)"
             if k in beside else f"{k} {v:.0f} s" for k, v in parts.items()]
    lines = []
    if summary.get("cpu_time_s"):  # CPU seconds and load say how busy the machine was
        load = summary.get("load_average_1min") or {}
        lines.append("  " + ", ".join(split) + f"; CPU {summary['cpu_time_s']['total']:.0f} s; load average "
                     f"{load.get('start', float('nan')):.1f} -> {load.get('end', float('nan')):.1f}")
    if summary.get("matmul_gflops"):  # the cores' own speed: the same demo takes longer on a slower hour
        speed = summary["matmul_gflops"]
        lines.append(f"  one core's speed (a fixed matmul, demo/clock.py): {speed['start']:.0f} GFLOP/s at the start, "
                     f"{speed['end']:.0f} at the end")
    if summary.get("stage_processes", 1) > 1:
        lines.append(f"  SFT and the reward model trained in {summary['stage_processes']} processes (torchrun, DDP, "
                     "one thread each, one launch; RUN/sft.log)")
    return lines
