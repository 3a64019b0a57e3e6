"""Several online runs in one torchrun launch (tests/parallel/test_online_ranks.py): the process start and the
imports are paid once. Each argument is one run's JSON argument list, as after `rlhflab`:

    torchrun --standalone --nproc_per_node 2 tests/parallel/online_ranks_driver.py '["grpo", "--model", ...]' ...

Every run is trained as `rlhflab <stage> ARGS` trains it (with the monitor), without the HTML report.
"""

import importlib
import json
import sys

from rlhflab import parallel
from rlhflab.config import STAGES, parse_config
from rlhflab.eval import RunMonitor


def main() -> None:
    for spec in sys.argv[1:]:
        args = json.loads(spec)
        cfg = parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}")
        trainer = importlib.import_module(f"rlhflab.trainers.{args[0].replace('-', '_')}")
        trainer.train(cfg, monitor=RunMonitor.from_config(cfg))
    parallel.shutdown_world()


if __name__ == "__main__":
    main()
