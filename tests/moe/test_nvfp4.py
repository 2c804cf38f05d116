"""NVFP4 reference quantizer/dequantizer: the format as ModelOpt writes it, bit for bit."""
import pytest
import torch

from ember.kernels import nvfp4


def test_e2m1_rounding_matches_the_modelopt_intervals():
    x = torch.tensor([0.0, 0.1, 0.25, 0.26, 0.5, 0.74, 0.75, 1.0, 1.25, 1.26, 1.5, 1.75, 2.0, 2.5, 2.51,
                      3.0, 3.5, 4.0, 5.0, 5.01, 6.0, 7.0, 1e6])
    want = [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 2.0, 3.0,
            3.0, 4.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    got = nvfp4.e2m1_to_float(nvfp4.round_e2m1(x))
    assert got.tolist() == want
    assert nvfp4.e2m1_to_float(nvfp4.round_e2m1(-x)).tolist() == [-v for v in want]


def test_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)


def test_dequantize_is_code_times_block_scale_times_tensor_scale():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    scales = torch.tensor([[2.0, 0.375]]).to(torch.float8_e4m3fn)
    s2 = torch.tensor(0.5)
    w = nvfp4.dequantize(nvfp4.pack_e2m1(codes), scales, s2)
    vals = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    want = torch.tensor([v * 2.0 * 0.5 for v in vals] + [v * 0.375 * 0.5 for v in vals]).view(1, 32)
    assert torch.equal(w, want)
    assert torch.signbit(w[0, 8]) and torch.signbit(w[0, 24])


def _representable(n_rows: int, n_blocks: int, seed: int):
    """Codes, E4M3 scales and a power-of-two tensor scale whose dequantized tensor ModelOpt's formulas reproduce:
    each block holds a +-6 (code 7 or 15), and one block carries the maximum scale 448."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n_rows, n_blocks, 16), generator=g, dtype=torch.uint8)
    codes[..., 0] = torch.where(torch.rand(n_rows, n_blocks, generator=g) < 0.5, 7, 15).to(torch.uint8)
    finite = torch.arange(0, 0x7F, dtype=torch.uint8)  # every non-negative finite E4M3 byte except 0
    finite = finite[finite.view(torch.float8_e4m3fn).float() > 0]
    sbytes = finite[torch.randint(0, finite.numel(), (n_rows, n_blocks), generator=g)]
    sbytes[0, 0] = 0x7E  # 448
    scales = sbytes.view(torch.float8_e4m3fn)
    return codes.flatten(-2), scales, torch.tensor(2.0**-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_representable_tensors_round_trip_bit_exactly(seed):
    codes, scales, s2 = _representable(24, 6, seed)
    w = nvfp4.dequantize(nvfp4.pack_e2m1(codes), scales, s2)
    q = nvfp4.quantize(w)
    assert q.weight_scale_2.item() == s2.item()
    assert torch.equal(q.weight_scale.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(nvfp4.unpack_e2m1(q.weight), codes)  # -0 (code 8) included
    assert (codes == 8).any()


def test_quantize_dequantize_quantize_is_a_fixed_point_and_close():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * 0.05
    q1 = nvfp4.quantize(w)
    d1 = q1.dequantize()
    q2 = nvfp4.quantize(d1)
    assert torch.equal(q2.weight, q1.weight)
    assert torch.equal(q2.weight_scale.view(torch.uint8), q1.weight_scale.view(torch.uint8))
    assert torch.allclose(q2.weight_scale_2, q1.weight_scale_2, rtol=1e-6)
    assert ((d1 - w).norm() / w.norm()).item() < 0.15  # 4-bit elements: ~10% relative error


def test_modelopt_scale_formulas():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 32, generator=g)
    q = nvfp4.quantize(w)
    s2 = w.abs().amax() / (6 * 448)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.item() == pytest.approx(s2.item(), rel=1e-7)
    blk = (w.view(8, 2, 16).abs().amax(-1) / (6 * s2)).to(torch.float8_e4m3fn)
    assert torch.equal(q.weight_scale.view(torch.uint8), blk.view(torch.uint8))
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (8, 16) and q.weight_scale.shape == (8, 2)


def test_zero_and_underflowing_blocks_dequantize_to_zero():
    w = torch.zeros(2, 48)
    w[0, :16] = 1000.0
    w[0, 16:32] = 1e-9  # its e4m3 scale underflows to 0
    q = nvfp4.quantize(w)
    d = q.dequantize()
    assert q.weight_scale.float()[0, 2].item() == 1.0  # an all-zero block gets scale 1.0
    assert torch.equal(d[0, 16:], torch.zeros(32)) and torch.equal(d[1], torch.zeros(48))
    assert torch.allclose(d[0, :16], w[0, :16])


def test_input_dimension_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 40))


def test_activation_quantization_round_trips_within_fp4_error():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=g)
    s = nvfp4.tensor_scale(x.abs().amax())
    q, sc = nvfp4.quantize_activations(x, s)
    d = nvfp4.dequantize_activations(q, sc, s)
    assert q.shape == (5, 32) and sc.shape == (5, 4)
    assert ((d - x).norm() / x.norm()).item() < 0.15
