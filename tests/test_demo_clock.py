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


def test_the_split_shows_a_stage_run_beside_the_others_with_its_own_seconds_and_its_wait():
    from rlhflab.demo.clock import describe_clock

    wall = {"setup": 2.0, "sft": 100.4, "rm": 50.0, "test_eval": 10.0, "headroom": 5.0, "rm_diagnosis": 20.0,
            "ppo_rm": 300.0, "ppo": 0.2, "total": 487.6}
    summary = {"wall_time_s": wall, "cpu_time_s": {"total": 900.0}, "load_average_1min": {"start": 1.9, "end": 2.04},
               "side_by_side": {"ppo": 412.3}, "stage_processes": 2}
    split, processes = describe_clock(summary)
    assert split == ("  sft 100 s, rm 50 s, test_eval 10 s, headroom 5 s, rm_diagnosis 20 s, ppo_rm 300 s, ppo 412 s "
                     "beside rm_diagnosis and ppo_rm (0 s waited after them; RUN/ppo.log); CPU 900 s; load average "
                     "1.9 -> 2.0")
    assert "2 processes" in processes
    alone = describe_clock({**summary, "side_by_side": {}, "stage_processes": 1,
                            "wall_time_s": {**wall, "ppo": 412.3}})  # one thread: the PPO ran in this process
    assert alone == ["  sft 100 s, rm 50 s, test_eval 10 s, headroom 5 s, rm_diagnosis 20 s, ppo_rm 300 s, ppo 412 s; "
                     "CPU 900 s; load average 1.9 -> 2.0"]
