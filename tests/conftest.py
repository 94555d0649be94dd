import os

import pytest
import torch

# Tests measure no speed; two threads keep them predictable on the 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none on this machine")


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)
