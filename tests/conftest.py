"""Suite-wide settings. TRITON_INTERPRET must be set before anything imports triton, so kernels run
under the interpreter on machines without a GPU."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
