import os

import torch

# Tests measure no speed; two threads keep them predictable on the 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# A run samples other work on the cores for a second at its start (harness.measure.busy);
# the suite's many small runs take a fifth of it. The tests of the sampler pass their own.
os.environ.setdefault("ATTNBENCH_BUSY_WINDOW_S", "0.2")
