import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/train/_toy.py (also used by the torchrun script)

from _toy import ToyLM, tiny_gpt  # noqa: E402


@pytest.fixture
def toy_data():
    return ToyLM()


@pytest.fixture
def make_gpt():
    return tiny_gpt


def base_cfg(tmp_path, **kw):
    from qkv.train import TrainConfig

    d = dict(max_steps=6, batch_size=4, lr=1e-3, warmup=2, out_dir=str(tmp_path / "run"), progress=False,
             tensorboard=False, plot=False, log_every=1)
    d.update(kw)
    return TrainConfig(**d)


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda **kw: base_cfg(tmp_path, **kw)
