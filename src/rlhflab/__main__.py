"""`python -m rlhflab <stage> ...`: what the `rlhflab` command runs, so launchers that start a module work:

    torchrun --nproc_per_node 2 -m rlhflab sft ...
    accelerate launch -m rlhflab sft ...
"""

import sys

from rlhflab.cli import main

if __name__ == "__main__":
    sys.exit(main())
