"""Suite-wide settings. TRITON_INTERPRET must be set before anything imports triton, so kernels run
under the interpreter on machines without a GPU."""
import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """`bench speedup` freezes the heap as specd does (kvd/gc_pauses.py); in the one pytest
    process that would keep every later test's cycles out of the collector, so each test ends unfrozen."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
