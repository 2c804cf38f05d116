"""Triton fused MoE, NVFP4 and block-FP8 GEMMs (interpreter on CPU, fp16 activations) against the torch
references."""
import pytest
import torch
import triton
import triton.language as tl

from ember.kernels import fp8_block, moe, nvfp4
from ember.kernels.fp8_block import FP8BlockTensor
from ember.kernels import moe_reference as ref
from ember.kernels.nvfp4 import NVFP4Tensor

# Interpreter-sized tiles; hidden sizes below are deliberately not multiples of BLOCK_K / BLOCK_N.
CFG = moe.GemmConfig(block_m=16, block_n=64, block_k=64)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def every_value_at_every_word_position(values: torch.Tensor, rows: int, cols: int,
                                       g: torch.Generator) -> torch.Tensor:
    """A uint8 ``[rows, cols]`` weight in which each of the four byte positions of the 4-byte words the kernels'
    decodes read holds every one of ``values`` (shuffled), so a decode wrong at any position for any byte shows."""
    out = torch.empty(rows, cols, dtype=torch.uint8)
    for pos in range(4):
        count = out[:, pos::4].numel()
        reps = -(-count // values.numel())
        out[:, pos::4] = torch.cat([values[torch.randperm(values.numel(), generator=g)]
                                    for _ in range(reps)])[:count].view(rows, -1)
        assert out[:, pos::4].unique().numel() == values.numel()
    return out


def quantize_stack(w: torch.Tensor, parts: int) -> NVFP4Tensor:
    """Per-expert NVFP4 of ``[E, N, K]``; with ``parts=2`` gate and up rows share one tensor scale (ModelOpt)."""
    e, n, k = w.shape
    q = [nvfp4.quantize(w[i]) for i in range(e)]
    s2 = torch.stack([x.weight_scale_2 for x in q])
    return NVFP4Tensor(
        torch.stack([x.weight for x in q]),
        torch.stack([x.weight_scale for x in q]),
        s2.unsqueeze(1).expand(e, parts).contiguous() if parts == 2 else s2,
    )


def make_case(e: int, k: int, m: int, h: int, i: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).half()
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    tw, ti = ref.topk_routing(torch.randn(m, e, generator=g), k, renormalize=seed % 2 == 0)
    return x, w13, w2, tw, ti


def test_align_block_size_matches_the_documented_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, num_post = moe.moe_align_block_size(ids, 4, 5)
    assert num_post.item() == 16
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4]
    assert sorted_ids.numel() >= 12 + 5 * 3


@pytest.mark.parametrize(
    "e,k,m,h,i",
    [(8, 2, 300, 80, 48), (64, 8, 23, 48, 32), (128, 1, 1, 112, 32), (128, 8, 9, 48, 16)],
)
def test_fused_moe_fp16_matches_reference(e, k, m, h, i):
    x, w13, w2, tw, ti = make_case(e, k, m, h, i, seed=e + k + m)
    w13, w2 = w13.half(), w2.half()
    got = moe.fused_moe(x, w13, w2, tw, ti, config=CFG)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), tw, ti)
    assert got.dtype == torch.float16 and got.shape == (m, h)
    assert rel_err(got, want) < 2e-3


@pytest.mark.parametrize("e,k,m,h,i", [(8, 1, 137, 80, 48), (64, 2, 40, 48, 32), (128, 8, 3, 48, 16)])
def test_fused_moe_nvfp4_w4a16_matches_dequantized_reference(e, k, m, h, i):
    x, w13, w2, tw, ti = make_case(e, k, m, h, i, seed=3 * e + k + m)
    q13, q2 = quantize_stack(w13, 2), quantize_stack(w2, 1)
    got = moe.fused_moe_nvfp4(x, q13, q2, tw, ti, config=CFG)
    want = ref.fused_moe_nvfp4(x.float(), q13, q2, tw, ti)
    assert rel_err(got, want) < 2e-3
    # and the quantized layer is still the same layer, up to 4-bit error
    assert rel_err(got, ref.fused_moe(x.float(), w13, w2, tw, ti)) < 0.25


def test_the_combine_adds_a_shared_expert_in_the_same_launch():
    """Qwen2-MoE / Qwen3-Next: ``sigmoid(gate) * shared`` joins the routed experts' sum in float32 before the one
    rounding to the activation dtype."""
    x, w13, w2, tw, ti = make_case(8, 2, 13, 80, 48, seed=5)
    g = torch.Generator().manual_seed(6)
    gate, value = torch.randn(13, 1, generator=g).half(), torch.randn(13, 80, generator=g).half()
    routed = moe.fused_moe(x, w13.half(), w2.half(), tw, ti, config=CFG)
    got = moe.fused_moe(x, w13.half(), w2.half(), tw, ti, config=CFG, shared=(gate, value))
    want = routed.float() + torch.sigmoid(gate.float()) * value.float()
    assert got.dtype == torch.float16 and rel_err(got, want) < 1e-3
    assert rel_err(got, routed) > 0.1  # the shared term is there


def test_gate_and_up_may_carry_different_tensor_scales():
    x, w13, w2, tw, ti = make_case(8, 2, 20, 48, 32, seed=11)
    w13[:, 32:] *= 7.0  # up rows much larger: a separate weight_scale_2 for up
    gate = quantize_stack(w13[:, :32].contiguous(), 1)
    up = quantize_stack(w13[:, 32:].contiguous(), 1)
    q13 = NVFP4Tensor(torch.cat((gate.weight, up.weight), 1), torch.cat((gate.weight_scale, up.weight_scale), 1),
                      torch.stack((gate.weight_scale_2, up.weight_scale_2), 1))
    q2 = quantize_stack(w2, 1)
    got = moe.fused_moe(x, q13, q2, tw, ti, config=CFG)
    assert rel_err(got, ref.fused_moe_nvfp4(x.float(), q13, q2, tw, ti)) < 2e-3


@pytest.mark.parametrize("m,n,k", [(1, 40, 80), (37, 72, 48)])
def test_nvfp4_linear_matches_reference(m, n, k):
    g = torch.Generator().manual_seed(m)
    w = nvfp4.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(2, m, k, generator=g).half()
    bias = torch.randn(n, generator=g)
    got = moe.nvfp4_linear(x, w, bias, config=CFG)
    assert got.shape == (2, m, n)
    assert rel_err(got, ref.nvfp4_linear(x.float(), w, bias)) < 2e-3


@pytest.mark.parametrize("split", [2, 3, 8], ids=["split2", "split3-uneven", "split8-some-empty"])
def test_split_k_linears_sum_their_partials_to_the_unsplit_result(split):
    """Split K (decode-size dense linears on a GPU): each program takes a run of K steps and the partials are summed
    with the bias by one more launch; 3 splits of 5 K steps are uneven, 8 leave some splits without a step."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(split)
    n, k = 72, 320  # 5 K steps of 64
    x = torch.randn(3, k, generator=g).half()
    bias = torch.randn(n, generator=g)
    w = nvfp4.quantize(torch.randn(n, k, generator=g))
    one = moe.nvfp4_linear(x, w, bias, config=CFG)
    got = moe.nvfp4_linear(x, w, bias, config=replace(CFG, split_k=split))
    assert got.dtype == torch.float16 and got.shape == (3, n)
    assert rel_err(got, one) < 1e-3 and rel_err(got, ref.nvfp4_linear(x.float(), w, bias)) < 2e-3
    f = fp8_block.quantize(torch.randn(n, k, generator=g), (16, 32))
    want = moe.block_fp8_linear(x, f, bias, config=moe.block_fp8_config(CFG))
    assert rel_err(moe.block_fp8_linear(x, f, bias, config=moe.block_fp8_config(replace(CFG, split_k=split))),
                   want) < 1e-3
    eye = torch.eye(k, dtype=torch.float16)  # x = I: one product per output, so the split sum is exact
    assert torch.equal(moe.nvfp4_linear(eye, w, config=replace(CFG, split_k=split)),
                       w.dequantize().T.to(torch.float16))


def _stacks(weights: str, w13: torch.Tensor, w2: torch.Tensor, seed: int):
    """``(w13, w2, config, extra fused_moe arguments)`` of one weight format: fp16 stacks, NVFP4, block FP8 (32 x 32
    blocks, with its K-step limit) or MXFP4 with gpt-oss's biases and clamped GLU."""
    from ember.kernels import mxfp4

    if weights == "fp16":
        return w13.half(), w2.half(), CFG, {}
    if weights == "nvfp4":
        return quantize_stack(w13, 2), quantize_stack(w2, 1), CFG, {}
    if weights == "block-fp8":
        return fp8_block.quantize(w13, (32, 32)), fp8_block.quantize(w2, (32, 32)), moe.block_fp8_config(CFG), {}
    g = torch.Generator().manual_seed(seed)
    e, n2, h = w13.shape[0], w13.shape[1], w2.shape[1]
    return mxfp4.quantize(w13), mxfp4.quantize(w2), CFG, dict(
        b13=torch.randn(e, n2, generator=g) * 0.1, b2=torch.randn(e, h, generator=g) * 0.1, swiglu=(7.0, 1.702))


@pytest.mark.parametrize("weights,split", [("fp16", 3), ("nvfp4", 2), ("nvfp4", 8), ("block-fp8", 3),
                                           ("mxfp4-bias-clamped-glu", 2), ("mxfp4-bias-clamped-glu", 3)])
def test_split_k_fused_moe_equals_the_unsplit_launches(weights, split):
    """A decode-size MoE may split K in both GEMMs: the gate/up partials are summed before the GLU (one more
    launch), the down partials join the routed pairs in the combine; biases are added once. H = 320 is 5 K steps of
    64 (3 splits are uneven, 8 leave some empty), I = 96 two steps with a partial one."""
    from dataclasses import replace

    x, w13, w2, tw, ti = make_case(8, 4, 5, 320, 96, seed=split)
    s13, s2, cfg, kw = _stacks(weights, w13, w2, seed=1)
    one = moe.fused_moe(x, s13, s2, tw, ti, config=cfg, **kw)
    got = moe.fused_moe(x, s13, s2, tw, ti, config=replace(cfg, split_k=split), **kw)
    assert got.dtype == torch.float16 and got.shape == one.shape
    assert rel_err(got, one) < 1e-3
    if kw:
        want = ref.fused_moe(x.float(), s13, s2, tw, ti, b13=kw["b13"], b2=kw["b2"],
                             activation=lambda t: ref.clamped_swiglu(t, 7.0, 1.702))
    else:
        want = ref.fused_moe(x.float(), s13 if weights != "fp16" else w13, s2 if weights != "fp16" else w2, tw, ti)
    assert rel_err(got, want) < 2e-3


@pytest.mark.parametrize("weights,split", [("nvfp4", 1), ("nvfp4", 3), ("block-fp8", 1), ("fp16", 2),
                                           ("mxfp4-bias-clamped-glu", 1)])
def test_one_program_per_routed_pair_equals_the_sorted_tiles(weights, split, monkeypatch):
    """``block_m`` 1 (decode sizes with few pairs per expert): each program takes one routed pair and its expert
    straight from the top-k IDs, products summed on FMA units, no routing sort launched; the same MoE as the sorted
    16-row tiles, also with K split. Two tokens share expert 3 (two programs read its weights)."""
    from dataclasses import replace

    x, w13, w2, tw, _ = make_case(16, 2, 3, 320, 96, seed=7)
    ti = torch.tensor([[3, 9], [3, 0], [15, 4]])
    s13, s2, cfg, kw = _stacks(weights, w13, w2, seed=2)
    tiles = moe.fused_moe(x, s13, s2, tw, ti, config=cfg, **kw)
    aligned = []
    align = moe.moe_align_block_size
    monkeypatch.setattr(moe, "moe_align_block_size", lambda *a: aligned.append(a) or align(*a))
    got = moe.fused_moe(x, s13, s2, tw, ti, config=replace(cfg, block_m=1, split_k=split), **kw)
    assert aligned == [] and got.dtype == torch.float16
    assert rel_err(got, tiles) < 1e-3


def test_decode_sizes_with_few_pairs_per_expert_take_one_program_per_pair(monkeypatch):
    """On a GPU, packed experts: Qwen3-30B-A3B (E=128, top-8) runs one program per pair up to M=4 (32 pairs for
    128 experts), 16-row tiles from M=5; Qwen3-Next (E=512, top-10) up to M=12; bf16 experts and the CPU never."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(moe, "_interpreting", lambda: False)
    monkeypatch.setattr(moe, "_num_sms", lambda device: 132)
    assert moe.default_config(4, 128, 8, cuda, nvfp4=True).block_m == 1
    assert moe.default_config(5, 128, 8, cuda, nvfp4=True).block_m == 16
    assert moe.default_config(12, 512, 10, cuda, nvfp4=True).block_m == 1
    assert moe.default_config(1, 128, 8, cuda).block_m == 16
    assert moe.default_config(1, 128, 8, torch.device("cpu"), nvfp4=True).block_m == 16
    pair = moe.default_config(1, 128, 8, cuda, nvfp4=True)
    assert moe.moe_splits(1, 8, 128, 2048, 768, pair, cuda) == (2, 1)  # 8 pairs x 24 column tiles, 16 K steps


def test_decode_moe_splits_k_where_few_experts_leave_the_gpu_idle(monkeypatch):
    """Qwen3-30B-A3B's layer (E=128, H=2048, I=768, top-8) at the NVFP4 decode tile on 132 SMs: at M=1 the gate/up
    GEMM's 192 programs of 16 K steps split in two; the down GEMM's 512 programs of 6 steps do not; by M=16 the
    routed pairs touch enough experts to fill the GPU; prefill tiles and the CPU never split."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(moe, "_interpreting", lambda: False)
    monkeypatch.setattr(moe, "_num_sms", lambda device: 132)
    decode = moe.default_config(16, 128, 8, cuda, nvfp4=True)  # the 16-row decode tile
    assert (decode.block_m, decode.block_n, decode.block_k) == (16, 32, 128)
    assert moe.moe_splits(1, 8, 128, 2048, 768, decode, cuda) == (2, 1)
    assert moe.moe_splits(1, 1, 16, 5120, 8192, decode, cuda) == (2, 2)  # Llama 4 Scout: one expert per token
    assert moe.moe_splits(16, 8, 128, 2048, 768, decode, cuda) == (1, 1)
    assert moe.moe_splits(1, 8, 128, 2048, 768, moe.default_config(512, 128, 8, cuda, nvfp4=True), cuda) == (1, 1)
    assert moe.moe_splits(1, 8, 128, 2048, 768, decode, torch.device("cpu")) == (1, 1)


def test_decode_linears_split_k_until_the_gpu_is_busy(monkeypatch):
    """The GPU's choice for a 4096 x 4096 linear at M=1 on 132 SMs: 128 N tiles of 32 K steps split 4 ways (512
    programs of 8 steps); a wide gate/up projection already fills the GPU; prefill sizes never split."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(moe, "_interpreting", lambda: False)
    monkeypatch.setattr(moe, "_num_sms", lambda device: 132)
    assert moe.linear_config(1, cuda, 4096, 4096).split_k == 4
    assert moe.linear_config(16, cuda, 4096, 12288).split_k == 4
    assert moe.linear_config(1, cuda, 24576, 4096).split_k == 1
    assert moe.linear_config(1, cuda, 4096, 512).split_k == 1  # 4 K steps: nothing to split
    assert moe.linear_config(64, cuda, 4096, 4096).split_k == 1
    assert moe.linear_config(1, torch.device("cpu"), 4096, 4096).split_k == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16-16-bit-decode"])
def test_w4a16_tile_decode_is_exact_for_every_code_and_scale(dtype):
    """x = I: the kernel's output is its dequantized weight tile, bit for bit (nibble order, 16-wide scale groups,
    subnormal E4M3 scales, -0 codes, ragged N and K tiles); fp16 activations take the 16-bit decode, whose tile is
    the weights times 2**-14 until the epilogue."""
    g = torch.Generator().manual_seed(3)
    n, k = 72, 96
    packed = every_value_at_every_word_position(torch.arange(256, dtype=torch.uint8), n, k // 2, g)
    scales = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = NVFP4Tensor(packed, scales, torch.tensor(0.75))
    got = moe.nvfp4_linear(torch.eye(k, dtype=dtype), w, config=CFG)
    assert got.dtype == dtype
    assert torch.equal(got, w.dequantize().T.to(dtype))
    # a weight that is a view 2 bytes into wider rows (not 4-byte aligned) decodes the same
    wide = torch.zeros(n, k // 2 + 8, dtype=torch.uint8)
    wide[:, 2:2 + k // 2] = packed
    view = NVFP4Tensor(wide[:, 2:2 + k // 2], scales, torch.tensor(0.75))
    assert torch.equal(moe.nvfp4_linear(torch.eye(k, dtype=dtype), view, config=CFG), got)


@triton.jit
def _decode_words_kernel(words_ptr, out_ptr, scale, N: tl.constexpr, UNSCALE: tl.constexpr):
    w = tl.load(words_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    parts = moe._e2m1_words(w, tl.full((N,), scale, tl.float32), tl.float32, UNSCALE)
    for j in tl.static_range(8):
        tl.store(out_ptr + tl.arange(0, N) * 8 + j, parts[j])


@pytest.mark.parametrize("unscale", [False, True], ids=["e4m3-scale-folded", "e8m0-scale"])
def test_e2m1_word_decode_is_exact_for_every_byte_at_every_position(unscale):
    """The word-wide decode: 4 bytes -> 8 elements in K order, each exactly its code's value times the scale (times
    2**-14 where the E4M3 path folds 2**14 into its scale); an E8M0 scale of 2**120 does not overflow."""
    g = torch.Generator().manual_seed(5)
    packed = torch.stack([torch.randperm(256, generator=g) for _ in range(4)], dim=1).to(torch.uint8)  # [256, 4]
    scale = 2.0 ** 120 if unscale else 3.5
    out = torch.empty(256 * 8)
    _decode_words_kernel[(1,)](packed.view(torch.int32).view(-1), out, scale, N=256, UNSCALE=unscale)
    want = nvfp4.e2m1_to_float(nvfp4.unpack_e2m1(packed)).reshape(-1).double() * scale
    if not unscale:
        want = want * 2.0 ** -14
    assert torch.equal(out.double(), want)
    assert torch.equal(torch.signbit(out), torch.signbit(want.float()))  # -0 codes keep their sign


@triton.jit
def _decode_words_16_kernel(words_ptr, out_ptr, scale16_ptr, N: tl.constexpr):
    w = tl.load(words_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    parts = moe._e2m1_words_16(w, tl.load(scale16_ptr + tl.arange(0, N)))
    for j in tl.static_range(8):
        tl.store(out_ptr + tl.arange(0, N) * 8 + j, parts[j])


@triton.jit
def _bits_16_kernel(words_ptr, out_ptr, N: tl.constexpr, BF16: tl.constexpr):
    w = tl.load(words_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    pairs = moe._e2m1_bits_16(w, BF16)
    for j in tl.static_range(4):
        tl.store(out_ptr + tl.arange(0, N) * 4 + j, pairs[j].to(tl.int32, bitcast=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_e2m1_16_bit_word_decode_is_exact_for_every_byte_scale_and_position(dtype):
    """The 16-bit decode (fp16/bf16 activations): each code is exactly its value times its E4M3 block scale times
    2**-14, for every byte at every word position and scales from the smallest subnormal E4M3 (2**-9) to 448; the
    bf16 form reads the codes as bf16 subnormals times 2**-126 and multiplies by the scale times 2**112 (no
    overflow at 448). The interpreter's bf16 arithmetic is wrong (as its bf16 ``tl.dot``), so the bf16 bits the
    kernel builds are multiplied here by torch, and the whole kernel by the interpreter only in fp16; the device
    check runs the bf16 GEMM on x = I."""
    g = torch.Generator().manual_seed(6)
    packed = torch.stack([torch.randperm(256, generator=g) for _ in range(4)], dim=1).to(torch.uint8)  # [256, 4]
    e4m3 = torch.tensor([1, 2, 7, 8, 0x38, 0x3D, 0x55, 0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scale = e4m3[torch.randint(0, 8, (256,), generator=g)]  # one scale per word: 2**-9 ... 448
    scale16 = (scale * (2.0 ** 112 if dtype == torch.bfloat16 else 1.0)).to(dtype)
    want = nvfp4.e2m1_to_float(nvfp4.unpack_e2m1(packed)).double() * scale.double()[:, None] * 2.0 ** -14
    pairs = torch.empty(256, 4, dtype=torch.int32)
    _bits_16_kernel[(1,)](packed.view(torch.int32).view(-1), pairs, N=256, BF16=dtype == torch.bfloat16)
    halves = pairs.view(dtype).view(256, 4, 2).transpose(1, 2).reshape(256, 8)  # element 4h + j: pair j, half h
    got = halves * scale16[:, None]
    assert torch.equal(got.double(), want)
    assert torch.equal(torch.signbit(got), torch.signbit(want.float()))  # -0 codes keep their sign
    if dtype == torch.float16:
        out = torch.empty(256 * 8, dtype=dtype)
        _decode_words_16_kernel[(1,)](packed.view(torch.int32).view(-1), out, scale16, N=256)
        assert torch.equal(out.view(256, 8), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_moe_nvfp4_w4a16_activation_dtypes(dtype):
    x, w13, w2, tw, ti = make_case(16, 4, 29, 80, 48, seed=21)
    q13, q2 = quantize_stack(w13, 2), quantize_stack(w2, 1)
    got = moe.fused_moe_nvfp4(x.to(dtype), q13, q2, tw, ti, w4a4=False, config=CFG)
    assert got.dtype == dtype
    assert rel_err(got, ref.fused_moe_nvfp4(x.float(), q13, q2, tw, ti)) < 2e-3


def test_routing_softmax_topk_and_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = ref.topk_routing(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w, p[:, [1, 2]])
    wn, _ = ref.topk_routing(logits, 2, renormalize=True)
    assert torch.allclose(wn.sum(-1), torch.ones(1)) and torch.allclose(wn, p[:, [1, 2]] / p[:, [1, 2]].sum())


def test_w4a4_is_gated_to_blackwell_where_the_probe_passes():
    assert not moe.w4a4_available(torch.device("cpu"))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        dev = torch.device("cuda:0")
        assert moe.w4a4_available(dev) == (cap >= (10, 0) and moe.dot_scaled_nvfp4_works(str(dev)))
        if cap < (10, 0):
            assert not moe.dot_scaled_nvfp4_works(str(dev))  # never probed (compiled) below sm_100


def test_probe_diagnostics_stay_out_of_the_log(capfd):
    """A failing compile prints MLIR from C++ straight to file descriptor 2; the probe's block swallows it."""
    import os

    with moe._quiet_stderr():
        os.write(2, b"module { tt.func ... }\n")
        print("reproducer", file=__import__("sys").stderr)
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "tt.func" not in err and "reproducer" not in err and "after" in err


@pytest.mark.skipif(not moe.dot_scaled_nvfp4_works("cuda" if torch.cuda.is_available() else "cpu"),
                    reason="this Triton (or its interpreter) does not compute NVFP4 (e4m3/16) dot_scaled correctly")
def test_fused_moe_w4a4_matches_fake_quant_reference():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w13, w2, tw, ti = make_case(8, 2, 20, 64, 32, seed=5)
    q13, q2 = quantize_stack(w13, 2), quantize_stack(w2, 1)
    to = lambda t: NVFP4Tensor(t.weight.to(dev), t.weight_scale.to(dev), t.weight_scale_2.to(dev))  # noqa: E731
    got = moe.fused_moe_nvfp4(x.to(dev), to(q13), to(q2), tw.to(dev), ti.to(dev), w4a4=True, config=CFG)
    want = ref.fused_moe_nvfp4_w4a4(x.float(), q13, q2, tw, ti)
    assert rel_err(got.cpu(), want) < 2e-2


def test_tile_configs_are_keyed_by_tokens_not_routed_pairs(monkeypatch):
    """vLLM's tables are keyed by the batch's token count M; a top-8 decode of 8 tokens must not get M=64's tiles."""
    seen = []
    table = moe._table_config
    monkeypatch.setattr(moe, "_table_config", lambda m, device: seen.append(m) or table(m, device))
    x, w13, w2, tw, ti = make_case(8, 4, 5, 48, 16, seed=2)
    moe.fused_moe(x, w13.half(), w2.half(), tw, ti)
    assert seen == [5]
    cuda = torch.device("cuda")
    assert moe.default_config(8, 128, 8, cuda) == moe.default_config(8, 128, 1, cuda)
    assert moe.default_config(8, 128, 8, cuda).block_m == 16


def _align_reference(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """The routing as plain Python: each expert's pairs in order, padded with the sentinel ``M*k`` to ``block_m``."""
    flat = topk_ids.reshape(-1).tolist()
    n = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == e]
        pairs += [n] * (-len(pairs) % block_m)
        sorted_ids += pairs
        expert_ids += [e] * (len(pairs) // block_m)
    return sorted_ids, expert_ids


@pytest.mark.parametrize("seed", range(6))
def test_align_block_size_matches_plain_routing_without_host_syncs(seed):
    from tests.kernels.host_sync import count_host_syncs

    g = torch.Generator().manual_seed(seed)
    e = (4, 8, 64, 128)[seed % 4]
    k = (1, 2, 8)[seed % 3]
    m = int(torch.randint(1, 40, (1,), generator=g))
    block_m = (16, 64)[seed % 2]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int()
    if seed == 5:
        ids[:] = ids[0]  # every token routed to the same k experts: the longest groups
    with count_host_syncs() as calls:
        sorted_ids, expert_ids, num_post = moe.moe_align_block_size(ids, block_m, e)
    assert calls == []
    cap = -(-(m * k + e * (block_m - 1)) // block_m) * block_m
    assert sorted_ids.shape == (cap,) and expert_ids.shape == (cap // block_m,) and num_post.shape == (1,)
    want_ids, want_experts = _align_reference(ids, block_m, e)
    total = int(num_post)
    assert total == len(want_ids)
    assert sorted_ids[:total].tolist() == want_ids and expert_ids[:total // block_m].tolist() == want_experts
    assert (sorted_ids[total:] == m * k).all() and (expert_ids[total // block_m:] == e - 1).all()


@pytest.mark.parametrize("align", ["triton", "torch"])
@pytest.mark.parametrize("e,k,m,block_m", [(128, 8, 300, 16), (256, 8, 128, 64), (8, 1, 1025, 16), (64, 2, 1, 16)])
def test_both_alignments_put_every_pair_in_its_experts_group_at_prefill_sizes(align, e, k, m, block_m):
    """The one-launch kernel (here under the interpreter) and the torch formulation, past one CHUNK of pairs (1025 and
    2400 of them) and with 256 experts: each expert's padded group holds exactly its pairs (the order inside a group
    is free: on a GPU it is the atomics' order), the blocks name their experts, and padding is the sentinel."""
    from ember.kernels import moe_align

    g = torch.Generator().manual_seed(e + m)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    fn = moe_align.align_triton if align == "triton" else moe_align.align_torch
    sorted_ids, expert_ids, num_post = fn(ids, block_m, e)
    want_ids, want_experts = _align_reference(ids, block_m, e)
    total = int(num_post)
    assert total == len(want_ids) and sorted_ids.shape == (moe_align.capacity(m * k, e, block_m),)
    assert expert_ids[:total // block_m].tolist() == want_experts
    assert (expert_ids[total // block_m:] == e - 1).all() and (sorted_ids[total:] == m * k).all()
    got_blocks = sorted_ids[:total].view(-1, block_m).tolist()
    want_blocks = torch.tensor(want_ids).view(-1, block_m).tolist()
    for expert in range(e):
        got = sorted(i for b, x in zip(got_blocks, want_experts) if x == expert for i in b)
        assert got == sorted(i for b, x in zip(want_blocks, want_experts) if x == expert for i in b)


def test_fused_moe_host_side_has_no_sync_and_static_launches(monkeypatch):
    """Everything fused_moe does around its two GEMM launches (routing, alignment, buffers) reads nothing back from
    the device, and launch shapes depend only on (M, k, E): MoE layers can be captured in CUDA graphs."""
    from tests.kernels.compile_check import _Recorder
    from tests.kernels.host_sync import count_host_syncs

    launches: list = []
    monkeypatch.setattr(moe, "_moe_gemm_kernel", _Recorder("gemm", moe._moe_gemm_kernel, launches))
    grids = []
    for seed in (0, 1):
        x, w13, w2, _, _ = make_case(16, 4, 7, 48, 32, seed=seed)
        q13, q2 = quantize_stack(w13, 2), quantize_stack(w2, 1)
        logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(seed))
        with count_host_syncs() as calls:
            tw, ti = ref.topk_routing(logits, 4, renormalize=True)
            moe.fused_moe(x, q13, q2, tw, ti, config=CFG)
        assert calls == []
        grids.append([(grid, [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args])
                      for _, _, args, _, grid in launches[-2:]])
    assert len(launches) == 4 and grids[0] == grids[1]


@pytest.mark.parametrize("family", ["gpt_oss_mxfp4", "deepseek_v3"])
def test_gpt_oss_and_deepseek_moe_paths_read_nothing_from_the_device(family):
    """gpt-oss (softmax over the top-k logits, biased MXFP4 experts, clamped GLU) and DeepSeek-V3 (grouped sigmoid
    routing with its correction bias) route and dispatch without a host read, like Qwen3-MoE: their MoE layers may be
    captured in CUDA graphs on the Triton path (`ModelRunner.graph_blocker`)."""
    from ember.kernels import mxfp4
    from tests.kernels.host_sync import count_host_syncs

    x, w13, w2, _, _ = make_case(8, 2, 5, 64, 32, seed=3)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 8, generator=g)
    with count_host_syncs() as calls:
        if family == "gpt_oss_mxfp4":
            q13, q2 = mxfp4.quantize(w13), mxfp4.quantize(w2)
            b13, b2 = torch.randn(8, 64, generator=g) * 0.1, torch.randn(8, 64, generator=g) * 0.1
            tw, ti = ref.topk_softmax_routing(logits, 2)
            out = moe.fused_moe(x.float(), q13, q2, tw, ti, config=CFG, b13=b13, b2=b2, swiglu=(7.0, 1.702))
        else:
            tw, ti = ref.grouped_topk_routing(logits, torch.randn(8, generator=g), 2, 4, 2, True, 2.5)
            out = moe.fused_moe(x, w13.half(), w2.half(), tw, ti, config=CFG)
    assert calls == []
    assert torch.isfinite(out).all()


def quantize_fp8_stack(w: torch.Tensor, block: tuple[int, int]) -> FP8BlockTensor:
    """Per-expert block FP8 of ``[E, N, K]``; gate and up rows of ``w13`` are separate blocks when ``I % bn == 0``."""
    return fp8_block.quantize(w, block)


@pytest.mark.parametrize("e,k,m,h,i,block", [
    (8, 2, 137, 80, 48, (16, 32)),   # H=80: a partial K block in w13; I=48 of 32-wide K blocks: partial in w2
    (64, 8, 9, 112, 32, (32, 48)),   # blocks wider than the 64-wide tiles' remainders
    (8, 2, 20, 48, 128, (128, 128)),  # DeepSeek's block, larger than the interpreter's tiles
])
def test_fused_moe_block_fp8_w8a16_matches_dequantized_reference(e, k, m, h, i, block):
    x, w13, w2, tw, ti = make_case(e, k, m, h, i, seed=5 * e + k + m)
    q13, q2 = quantize_fp8_stack(w13, block), quantize_fp8_stack(w2, block)
    assert q13.weight.dtype == torch.float8_e4m3fn
    got = moe.fused_moe(x, q13, q2, tw, ti, config=CFG)
    want = ref.fused_moe(x.float(), q13, q2, tw, ti)
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3
    assert rel_err(got, ref.fused_moe(x.float(), w13, w2, tw, ti)) < 0.05  # e4m3 rounding, no more


@pytest.mark.parametrize("block,k", [((16, 24), 100), ((32, 128), 100), ((1, fp8_block.CHANNEL), 98)],
                         ids=["per-element-scales", "one-k-block-per-tile", "per-channel-k-not-whole-words"])
def test_block_fp8_tile_decode_is_exact_for_every_byte_and_block(block, k):
    """x = I in fp32: the kernel's output is the dequantized weight, bit for bit: every finite e4m3 byte (subnormals
    and -0 included) at every position of the 4-byte words the kernel reads, each element scaled by its own block's
    scale, ragged N and K against the tiles (and K not a whole number of words)."""
    g = torch.Generator().manual_seed(4)
    n = 72
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = every_value_at_every_word_position(finite, n, k, g)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 4 + 0.01
    w = FP8BlockTensor(codes.view(torch.float8_e4m3fn), scale, block)
    got = moe.block_fp8_linear(torch.eye(k), w, config=CFG)
    assert torch.equal(got, w.dequantize().T)


def test_block_fp8_k_blocks_must_hold_whole_words():
    """The kernel reads 4 e4m3 bytes per word and one scale per word: a K block of 6 is refused by name, not run."""
    w = fp8_block.quantize(torch.randn(32, 24), (16, 6))
    with pytest.raises(ValueError, match=r"multiple of 4 elements, got \(16, 6\)"):
        moe.block_fp8_linear(torch.randn(2, 24), w, config=CFG)


def test_block_fp8_w13_must_split_gate_and_up_on_a_block_row():
    x, w13, w2, tw, ti = make_case(4, 2, 5, 48, 24, seed=1)
    with pytest.raises(ValueError, match="up half"):
        moe.fused_moe(x, quantize_fp8_stack(w13, (16, 16)), quantize_fp8_stack(w2, (16, 16)), tw, ti, config=CFG)
