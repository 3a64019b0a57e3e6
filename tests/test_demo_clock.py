"""The demo's own clock (demo.StageClock): wall and CPU seconds per part, parts met twice add up."""

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


def test_a_finished_child_process_cpu_is_added_to_its_part_and_the_total():
    import subprocess
    import sys

    clock = StageClock()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                   check=True)
    clock.add_children_cpu("ppo")
    clock.add_children_cpu("ppo")  # nothing new finished: nothing added twice
    summary = clock.summary(total_wall=1.0, total_cpu=0.5)
    assert 0.3 <= summary["cpu_time_s"]["ppo"] < 1.5
    assert summary["cpu_time_s"]["total"] == round(0.5 + summary["cpu_time_s"]["ppo"], 1)
