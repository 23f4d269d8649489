"""The positional encodings the pretrained encoder-decoders need, against independent references:
T5's bucketed relative bias (transformers' T5Attention._relative_position_bucket), Marian's sinusoid layout
(transformers' MarianSinusoidalPositionalEmbedding) and BART's learned table read two rows on."""

import pytest
import torch

from qkv.nn.position import Learned, RelativeBias, Sinusoidal, build_position, relative_buckets

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_relative_buckets_equal_t5(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300).view(1, -1)
    ref = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                                max_distance=max_distance)
    assert torch.equal(relative_buckets(rel, bidirectional, num_buckets, max_distance), ref)


def test_relative_bias_reads_the_table_and_is_bottom_right_aligned():
    enc = RelativeBias(n_heads=3, num_buckets=8, max_distance=20)
    with torch.no_grad():
        enc.weight.copy_(torch.randn(8, 3))
    full = enc.bias(6, 6, causal=True)  # (1, H, 6, 6)
    assert full.shape == (1, 3, 6, 6)
    # the last 2 queries over 6 keys (a cached decoding step) see the last 2 rows of the full bias
    torch.testing.assert_close(enc.bias(2, 6, causal=True), full[:, :, -2:])
    # a query and a key at the same distance share a value; the encoder (bidirectional) separates before/after
    assert torch.equal(full[0, :, 3, 1], full[0, :, 5, 3])
    bi = enc.bias(6, 6, causal=False)
    assert not torch.equal(bi[0, :, 1, 3], bi[0, :, 3, 1])
    assert isinstance(build_position("relative", d_model=8, n_heads=3, max_len=4), RelativeBias)
    assert enc.max_len is None  # no absolute length limit


@pytest.mark.parametrize("d", [32, 6])
def test_sinusoidal_halves_equal_marian(d):
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    ref = MarianSinusoidalPositionalEmbedding(50, d).create_weight()
    torch.testing.assert_close(Sinusoidal(d, 50, layout="halves").table, ref, atol=1e-6, rtol=0)
    # the same function as Vaswani's interleaved table, channels permuted
    inter = Sinusoidal(d, 50).table
    torch.testing.assert_close(ref[:, : d // 2], inter[:, 0::2], atol=1e-6, rtol=0)
    torch.testing.assert_close(ref[:, d // 2:], inter[:, 1::2], atol=1e-6, rtol=0)


def test_learned_skip_reads_two_rows_on():
    enc = Learned(4, 10, skip=2)
    assert enc.weight.shape == (12, 4) and enc.max_len == 10
    with torch.no_grad():
        enc.weight.copy_(torch.arange(48.0).view(12, 4))
    out = enc.embed(torch.zeros(1, 3, 4), offset=5)
    assert torch.equal(out[0], enc.weight[7:10])
    with pytest.raises(ValueError, match="context is 10"):
        enc.embed(torch.zeros(1, 3, 4), offset=8)
