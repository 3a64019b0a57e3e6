"""`python -m rlhflab <stage> ...`: what the `rlhflab` command runs, so launchers that start a module work:

    torchrun --nproc_per_node 2 -m rlhflab sft ...
    accelerate launch -m rlhflab sft ...
"""

import os
import sys

from rlhflab.cli import main

if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun: an uncaught error's message goes into its summary
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    sys.exit(main())
