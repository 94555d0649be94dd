import os

import torch

# Tests measure no speed; two threads keep them predictable on the 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))
