"""Shared fixtures: every test starts from the same random state, so failures reproduce.

Tests use tiny tensors, for which intra-op threads cost far more than they bring (on the shared 2-core
CI machine a 2-layer forward took 0.3 s with 2 threads and 3 ms with 1); parallelism comes from
`pytest -n 2` instead.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
