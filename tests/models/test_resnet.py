"""qkv.ResNet: the presets' sizes (torchvision's published parameter counts), grids, initialisation, the
residual blocks against their formula, bad input, and that it trains through the shared trainer."""

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import ConfigError
from qkv.models.resnet import ResidualBlock, ResNetConfig


@pytest.mark.parametrize("preset, params", [("resnet-18", 11_689_512), ("resnet-34", 21_797_672),
                                            ("resnet-50", 25_557_032)])
def test_presets_have_torchvisions_parameter_counts(preset, params):
    with torch.device("meta"):
        assert qkv.build(preset).num_parameters() == params


@pytest.mark.parametrize("preset, size, grid", [("resnet-18", 64, 2), ("resnet-18-cifar", 28, 4),
                                                ("resnet-8-cifar", 32, 8)])
def test_stems_and_stages_set_the_grid(preset, size, grid):
    m = qkv.build(preset, depths=[1] * len(qkv.build(preset).config.depths)).eval()
    out = m(torch.randn(2, 3, size, size))
    assert out.last_hidden_state.shape[-2:] == (grid, grid) and out.logits.shape == (2, m.config.num_labels)
    assert out.pooled.shape == (2, m.config.widths[-1])
    # the map is handed out in NCHW order whatever layout the convolutions ran in: a caller's view() works
    b, c, h, w = out.last_hidden_state.shape
    flat = out.last_hidden_state.view(b, c * h * w)  # fails on a channels_last map's strides
    torch.testing.assert_close(flat.view(b, c, h * w).mean(-1), out.pooled)


def _conv(x, cb, stride, pad):
    """conv (no bias) + BN in eval mode, written out: gamma (conv - mean) / sqrt(var + eps) + beta."""
    y = F.conv2d(x, cb.conv.weight, stride=stride, padding=pad)
    bn = cb.bn
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps))[None, :, None, None]
    return (y - bn.running_mean[None, :, None, None]) * scale + bn.bias[None, :, None, None]


def _randomise(m):
    with torch.no_grad():
        for name, t in m.state_dict().items():
            if name.endswith("running_var"):
                t.uniform_(0.5, 2)
            elif t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.3)


@pytest.mark.parametrize("block, stride_in_1x1",
                         [("basic", False), ("bottleneck", False), ("bottleneck", True)])
def test_residual_blocks_match_their_formula(block, stride_in_1x1):
    torch.manual_seed(0)
    cfg = ResNetConfig(block=block, stride_in_1x1=stride_in_1x1)
    b = ResidualBlock(8, 16, 2, cfg).eval()
    _randomise(b)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    b = b.double()
    br = b.branch
    if block == "basic":
        h = F.relu(_conv(x, br[0], 2, 1))
        h = _conv(h, br[1], 1, 1)
    else:
        s1, s3 = (2, 1) if stride_in_1x1 else (1, 2)
        h = F.relu(_conv(x, br[0], s1, 0))
        h = F.relu(_conv(h, br[1], s3, 1))
        h = _conv(h, br[2], 1, 0)
        assert br[0].conv.weight.shape == (4, 8, 1, 1)  # the inner width is the output width / 4
    want = F.relu(h + _conv(x, b.shortcut, 2, 0))
    torch.testing.assert_close(b(x), want)
    same = ResidualBlock(16, 16, 1, cfg).eval()
    _randomise(same)
    same = same.double()
    assert same.shortcut is None  # identity where width and grid are kept
    y = torch.randn(1, 16, 5, 5, dtype=torch.float64)
    h = y
    for i, cb in enumerate(same.branch):
        h = _conv(h, cb, 1, cb.conv.kernel_size[0] // 2)
        h = F.relu(h) if i < len(same.branch) - 1 else h
    torch.testing.assert_close(same(y), F.relu(h + y))


def test_kaiming_init_and_zero_init_residual():
    torch.manual_seed(0)
    m = qkv.build("resnet-18", zero_init_residual=False)
    w = m.stages[2][0].branch[0].conv.weight  # 3x3, 256 out: fan_out = 256 * 9
    assert abs(float(w.detach().std()) - math.sqrt(2 / (256 * 9))) < 0.05 * math.sqrt(2 / (256 * 9))
    assert all(float(blk.branch[-1].bn.weight.detach().min()) == 1.0 for st in m.stages for blk in st)
    z = qkv.build("resnet-8-cifar", zero_init_residual=True).eval()
    assert all(float(blk.branch[-1].bn.weight.detach().abs().max()) == 0.0 for st in z.stages for blk in st)
    x = torch.randn(2, 16, 8, 8).relu()
    torch.testing.assert_close(z.stages[0][0](x), x)  # each block starts as the identity (on ReLU outputs)


def test_bad_configs_and_inputs_are_clear_errors():
    with pytest.raises(ConfigError, match="stem"):
        qkv.build("resnet-18", stem="vgg")
    with pytest.raises(ConfigError, match="one entry per stage"):
        qkv.build("resnet-18", depths=[2, 2])
    with pytest.raises(ConfigError, match="multiples of bottleneck_reduction"):
        qkv.build("resnet-50", widths=[10, 20, 40, 80])
    m = qkv.build("resnet-8-cifar")
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, 3, H, W\)"):
        m(torch.randn(2, 1, 8, 8))
    with pytest.raises(ValueError, match="labels must be"):
        m(torch.randn(2, 3, 8, 8), labels=torch.zeros(2, 1, dtype=torch.long))


def test_save_load_and_a_few_training_steps(tmp_path):
    from qkv.train import Trainer

    torch.manual_seed(0)
    m = qkv.build("resnet-8-cifar", num_labels=3, n_channels=1)
    x = torch.randn(16, 1, 12, 12)
    y = torch.arange(16) % 3
    x = x + y[:, None, None, None].float()  # separable

    class Fixed:
        def batch(self, index, batch_size, split="train"):
            return {"pixel_values": x, "labels": y}

    before = m(x, labels=y).loss.item()
    Trainer(m,
            {"max_steps": 15, "lr": 1e-2, "batch_size": 16, "progress": False, "log_every": 5, "plot": False,
                "tensorboard": False, "save_every": 0, "out_dir": str(tmp_path / "run")}, Fixed()).fit()
    m.train()
    assert m(x, labels=y).loss.item() < before / 2
    m.eval()
    m.save_pretrained(tmp_path / "saved")
    back = qkv.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(back(x).logits, m(x).logits, rtol=0, atol=0)  # running statistics saved too
