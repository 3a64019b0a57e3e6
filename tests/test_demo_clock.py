"""The demo's own clock (demo/clock.py, StageClock): wall and CPU seconds per part, parts met twice add up."""

import time

from rlhflab.demo import StageClock


def test_parts_add_up_and_cpu_counts_work_not_sleep():
    clock = StageClock()
    with clock("eval"):
        time.sleep(0.05)
    with clock("train"):
        start = time.process_time()
        while time.process_time() - start < 0.2:  # CPU work (the summary keeps one decimal)
            sum(i * i for i in range(10_000))
    with clock("eval"):
        time.sleep(0.05)
    summary = clock.summary(total_wall=1.0, total_cpu=2.0)
    assert set(summary["wall_time_s"]) == {"eval", "train", "total"} and summary["wall_time_s"]["total"] == 1.0
    assert summary["wall_time_s"]["eval"] >= 0.1  # both visits
    assert summary["cpu_time_s"]["eval"] < 0.05 < summary["wall_time_s"]["eval"]  # sleeping costs no CPU
    assert summary["cpu_time_s"]["train"] >= 0.2 and summary["cpu_time_s"]["total"] == 2.0
    assert set(summary["load_average_1min"]) == {"start", "end"}
    assert set(summary["matmul_gflops"]) == {"start", "end"} and min(summary["matmul_gflops"].values()) > 0.1


def test_the_machine_speed_probe_times_one_thread_and_gives_the_threads_back(monkeypatch):
    import itertools

    import pytest
    import torch

    from rlhflab.demo import clock

    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(torch.get_num_threads()) or real_mm(a, b))
    ticks = itertools.count()
    monkeypatch.setattr(clock.time, "perf_counter", lambda: 0.01 * next(ticks))  # 10 ms between readings
    before = torch.get_num_threads()
    speed = clock.matmul_speed(seconds=0.05)
    assert torch.get_num_threads() == before and set(seen) == {1}
    assert len(seen) == 1 + 40  # warm-up, then rounds of 10 while 0.01 .. 0.04 s had passed; stopped at 0.05
    rows, inner, cols = clock.REFERENCE_SHAPE
    assert speed == pytest.approx(2 * rows * inner * cols * 40 / 0.05 / 1e9)


def test_cpu_spent_in_a_child_process_is_added_to_its_part_and_the_total():
    clock = StageClock()
    clock.add_cpu("ppo", 12.25)
    summary = clock.summary(total_wall=1.0, total_cpu=0.5)
    assert summary["cpu_time_s"]["ppo"] == 12.2 and summary["cpu_time_s"]["total"] == 12.8


def test_sft_and_the_rm_take_two_processes_only_on_a_cpu_with_every_core_of_at_least_two(monkeypatch):
    import rlhflab.demo as demo
    from rlhflab.config import DemoConfig

    monkeypatch.setattr(demo, "cores", lambda: 2)
    assert demo.stage_processes(DemoConfig(threads=0, device="cpu")) == 2
    assert demo.stage_processes(DemoConfig(threads=1, device="cpu")) == 1  # one thread asked: this process
    assert demo.stage_processes(DemoConfig(threads=0, device="cpu", stage_processes=3)) == 3  # as asked
    monkeypatch.setattr(demo, "cores", lambda: 1)
    assert demo.stage_processes(DemoConfig(threads=0, device="cpu")) == 1
