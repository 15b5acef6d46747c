"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported anywhere in the pytest process, so it is
set here at import time (the root tests/conftest.py should set it too, since a test collected
earlier may import triton first).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
