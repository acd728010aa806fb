"""tessel's native one-row decode step (`tessel.kernels.decode_row`, `tessel.engine.native_row`): the
held layers of a W8A8 Llama on the int8 GEMV in one call.

Oracle: the model's own eager forward (tessel's modules: `W8A8Linear` on its GEMM path, RMSNorm,
rotary, `paged_decode_attention`) on the same weights and cache, layer by layer as
`LlamaModel.forward` runs them; and, through the engine, HF + compressed-tensors
(`tests/quant/test_cpu_graph_quantized.py` runs its one-row steps on this path). Shapes cover GQA and
plain multi-head attention, head dims whose columns leave a tail (80) and past the AVX-512 path's
registers (256: the portable loops), biases, contexts inside one block and across many, block sizes
other than 16, Qwen3's q/k norms, and a pipeline stage's part (no final norm: the stream it sends on).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessel.engine.native_row import NativeRow
from tessel.errors import TesselError
from tessel.kernels import cpu_features, decode_row, huge_pages, int8_gemv, native_build
from tessel.kernels.rope import rope_tables
from tessel.layers.attention import AttentionMetadata, DecodeGroup
from tessel.layers.linear import W8A8Linear, linear_form
from tessel.models.config import ModelConfig
from tessel.models.llama import LlamaForCausalLM, StepInputs

BASE = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def _isa() -> str | None:
    return int8_gemv.choose_gemv_isa() if int8_gemv.available() else None


pytestmark = pytest.mark.skipif(
    _isa() is None or not decode_row.available(), reason="no int8 GEMV kernel or no C++ compiler here"
)


def _w8a8(linear: torch.nn.Linear, g: torch.Generator, bias: bool) -> W8A8Linear:
    n, k = linear.out_features, linear.in_features
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) + 0.5) / (127 * k**0.5)
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    path = "fbgemm" if _isa() == "vnni" else "fp16codes"
    return W8A8Linear(weight, scale, b, path=path)


def _model(config: ModelConfig, block_size: int, blocks: int, seed: int) -> LlamaForCausalLM:
    """A random W8A8 model (every linear on the int8 GEMV) with a random cache of `blocks` blocks."""
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    bias = config.qkv_bias and child_name == "qkv_proj"
                    setattr(module, child_name, _w8a8(child, g, bias))
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.copy_(
                    1 + 0.2 * torch.randn(p.shape, generator=g)
                    if p.dim() == 1
                    else torch.randn(p.shape, generator=g)
                )
    for rotary in model.model.rotaries():
        rotary.build_tables()
    shape = (blocks, block_size, config.num_key_value_heads, config.head_dim)
    for layer in model.model.layers:
        layer.self_attn.attn.k_cache = torch.randn(shape, generator=g)
        layer.self_attn.attn.v_cache = torch.randn(shape, generator=g)
    return model


def _row(context: int, block_size: int, blocks: int, seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """One decode row at position context - 1 over a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks, generator=g)[: -(-context // block_size)].to(torch.int32)
    position = context - 1
    slot = int(table[position // block_size]) * block_size + position % block_size
    group = DecodeGroup(0, 1, table[None].clone(), torch.tensor([context], dtype=torch.int32))
    meta = AttentionMetadata(torch.tensor([slot]), 1, [group])
    return meta, torch.tensor([position])


def _caches(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (layer.self_attn.attn.k_cache.clone(), layer.self_attn.attn.v_cache.clone())
        for layer in model.model.layers
    ]


def _set_caches(model: LlamaForCausalLM, caches) -> None:
    for layer, (k, v) in zip(model.model.layers, caches, strict=True):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = k.clone(), v.clone()


def _assert_the_formula(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same formulas, the sums in another order: mostly equal to float32 rounding, but an
    activation code on a rounding tie may round the other way and move what follows it (seen: 3e-3
    of the largest value, through two later layers); an error in the step moves it by its whole size."""
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * float(expected.abs().max()))


def _compare(model: LlamaForCausalLM, meta: AttentionMetadata, positions: torch.Tensor, token: int) -> None:
    inner = model.model
    hidden = inner.embed(torch.tensor([token]))
    before = _caches(model)
    with torch.no_grad():
        expected = inner(StepInputs(positions, meta, input_ids=torch.tensor([token])))
    written = _caches(model)
    _set_caches(model, before)
    native = NativeRow.for_layers(
        list(inner.layers), inner.norm if inner.part.head else None, inner.rotary.rotary_dim
    )
    assert native is not None
    got = native(hidden, meta, rope_tables(positions, inner.rotary.cos, inner.rotary.sin))
    _assert_the_formula(got, expected)
    for (k, v), (k_want, v_want) in zip(_caches(model), written, strict=True):
        torch.testing.assert_close(k, k_want, rtol=1e-4, atol=1e-4)  # the new token's k/v stored too
        torch.testing.assert_close(v, v_want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("changes", "block_size", "context"),
    [
        ({}, 16, 1),  # GQA 6/2, the first token of a sequence
        ({}, 16, 37),  # across blocks, a partial last block
        ({}, 8, 70),
        ({"num_key_value_heads": 6}, 16, 16),  # multi-head attention, one full block
        ({"head_dim": 80, "num_attention_heads": 4}, 16, 33),  # a column tail (80 = 5 x 16)
        ({"head_dim": 40, "num_attention_heads": 4}, 16, 50),  # a masked last chunk of 16 columns
        (
            {"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
            16,
            19,
        ),  # 8 chunks in registers
        ({"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1}, 32, 45),  # portable loops
        ({"qkv_bias": True, "intermediate_size": 200}, 16, 20),  # Qwen2's q/k/v bias, K not a multiple of 64
        ({"num_hidden_layers": 3}, 4, 90),
        ({"num_attention_heads": 10, "head_dim": 32}, 16, 45),  # 5 query heads a kv head
        ({"num_attention_heads": 12, "num_key_value_heads": 1}, 8, 27),  # 12 query heads on one kv head
        ({"qk_norm": True, "num_hidden_layers": 3}, 16, 29),  # Qwen3's q/k norms, a norm per layer
        ({"qk_norm": True, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}, 16, 40),
    ],
)
def test_the_native_step_is_the_models_forward(changes: dict, block_size: int, context: int) -> None:
    config = dataclasses.replace(BASE, **changes)
    blocks = -(-context // block_size) + 3
    model = _model(config, block_size, blocks, seed=context)
    meta, positions = _row(context, block_size, blocks, seed=context)
    _compare(model, meta, positions, token=7)


def test_a_stage_before_the_last_returns_the_stream() -> None:
    """A pipeline stage's part (layers 1-2 of 3, no final norm) from the stream it received."""
    config = dataclasses.replace(BASE, num_hidden_layers=3)
    model = _model(config, 16, 6, seed=4)
    inner = model.model
    inner.part = dataclasses.replace(inner.part, layer_start=1, layer_end=3, embed=False, head=False)
    meta, positions = _row(40, 16, 6, seed=4)
    stream = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = inner(StepInputs(positions, meta, stream=stream))
    native = NativeRow.for_layers(list(inner.layers)[1:3], None, inner.rotary.rotary_dim)
    tables = rope_tables(positions, inner.rotary.cos, inner.rotary.sin)
    got = native(stream, meta, tables)
    _assert_the_formula(got, expected)


def test_layers_it_does_not_compute_keep_the_graphs(monkeypatch) -> None:
    """Partial rotary, a float linear, mixed epsilons: None (the compiled graphs keep the row);
    TESSEL_DECODE_ROW=off: None; a value other than on/off is refused."""
    model = _model(BASE, 16, 4, seed=1)
    layers, norm = list(model.model.layers), model.model.norm
    assert NativeRow.for_layers(layers, norm, BASE.head_dim) is not None
    assert NativeRow.for_layers(layers, norm, BASE.head_dim // 2) is None
    layers[1].post_attention_layernorm.eps = 1e-3
    assert NativeRow.for_layers(layers, norm, BASE.head_dim) is None
    layers[1].post_attention_layernorm.eps = norm.eps
    layers[0].mlp.down_proj = torch.nn.Linear(BASE.intermediate_size, BASE.hidden_size, bias=False)
    assert NativeRow.for_layers(layers, norm, BASE.head_dim) is None
    monkeypatch.setenv(decode_row.ENV_OVERRIDE, "off")
    assert not decode_row.enabled()
    monkeypatch.setenv(decode_row.ENV_OVERRIDE, "fast")
    with pytest.raises(TesselError, match="TESSEL_DECODE_ROW='fast'"):
        decode_row.enabled()


def test_bad_inputs_are_refused_not_read_past() -> None:
    """A context longer than the block table, a slot past the cache: errors, not reads past memory."""
    model = _model(BASE, 16, 4, seed=2)
    inner = model.model
    native = NativeRow.for_layers(list(inner.layers), inner.norm, inner.rotary.rotary_dim)
    meta, positions = _row(20, 16, 4, seed=2)
    tables = rope_tables(positions, inner.rotary.cos, inner.rotary.sin)
    hidden = inner.embed(torch.tensor([3]))
    meta.decode_groups[0].context_lens = torch.tensor([60], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="needs more blocks than the table"):
        native(hidden, meta, tables)
    meta, _ = _row(20, 16, 4, seed=2)
    meta.slot_mapping = torch.tensor([4 * 16])
    with pytest.raises(RuntimeError, match="past the cache"):
        native(hidden, meta, tables)


def test_built_for_this_cpu_in_the_cache(monkeypatch, tmp_path) -> None:
    """The library is compiled into $TESSEL_CACHE_DIR/native (nothing else left there) and keyed by
    this CPU's flags: it is built with -march=native, so another CPU sharing the cache builds its own."""
    compiler = native_build.cxx_compiler()
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    built = decode_row.build(compiler)
    assert built.parent == tmp_path / "native" and list(built.parent.iterdir()) == [built]
    assert decode_row.build(compiler) == built  # found, not compiled again
    key = native_build.library_key([decode_row.SOURCE], compiler, decode_row.flags())
    assert built.name == f"decode_row-{key}.so"
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    assert native_build.library_key([decode_row.SOURCE], compiler, decode_row.flags()) != key


def test_the_arch_override_is_checked_against_this_cpu(monkeypatch) -> None:
    """$TESSEL_NATIVE_ARCH: native by default; x86-64-v3 where the CPU has AVX2, FMA and F16C, and
    keyed without the CPU's flags (its code runs on any such CPU); refused where it does not, or
    for a name tessel does not know."""
    compiler = native_build.cxx_compiler() or "c++"
    monkeypatch.delenv(native_build.ARCH_OVERRIDE, raising=False)
    assert native_build.arch_flag(frozenset()) == "-march=native"
    monkeypatch.setenv(native_build.ARCH_OVERRIDE, "x86-64-v3")
    assert native_build.arch_flag(frozenset({"avx2", "fma", "f16c"})) == "-march=x86-64-v3"
    with pytest.raises(TesselError, match="lacks f16c, fma"):
        native_build.arch_flag(frozenset({"avx2"}))
    v3 = (native_build.arch_flag(frozenset({"avx2", "fma", "f16c"})), "-fopenmp-simd")
    key = native_build.library_key([decode_row.SOURCE], compiler, v3)
    assert key != native_build.library_key([decode_row.SOURCE], compiler, ("-march=native", "-fopenmp-simd"))
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    assert native_build.library_key([decode_row.SOURCE], compiler, v3) == key
    monkeypatch.setenv(native_build.ARCH_OVERRIDE, "skylake")
    with pytest.raises(TesselError, match="TESSEL_NATIVE_ARCH='skylake'"):
        native_build.arch_flag(frozenset())


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_features.cpu_flags(), reason="this CPU cannot run AVX2-only code"
)
def test_an_avx2_only_cpus_build_is_the_models_forward(tmp_path) -> None:
    """The operator as an AVX2-only CPU builds it (-march=x86-64-v3: no AVX-512, so AVX2's attention
    kernels, the portable loops past head dim 128, and AVX2's GEMV kernel) against the model's
    forward, in a process of its own (one process loads one build of the operator)."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "TESSEL_NATIVE_ARCH": "x86-64-v3",
        "TESSEL_INT8_GEMV": "avx2",
        "TESSEL_CACHE_DIR": str(tmp_path),
    }
    tests = f"{__file__}::test_the_native_step_is_the_models_forward"
    run = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        tests,
        f"{__file__}::test_a_stage_before_the_last_returns_the_stream",
    ]
    proc = subprocess.run(run, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "15 passed" in proc.stdout
    assert len(list((tmp_path / "native").glob("decode_row-*.so"))) == 1


def test_the_layers_weights_move_to_huge_pages_and_the_step_is_unchanged() -> None:
    """A stage of 2.2 MB of packed weights: the native step moves them, in the order it reads them,
    into one mapping on huge pages (where the kernel gives them) and still gives the forward."""
    config = dataclasses.replace(
        BASE, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_hidden_layers=1, head_dim=64
    )
    model = _model(config, 16, 4, seed=5)
    meta, positions = _row(30, 16, 4, seed=5)
    _compare(model, meta, positions, token=7)  # builds the native step (the move), then compares
    layer = model.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    packed = [linear_form(m).tensors[0] for m in linears]
    if huge_pages.enabled():
        assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
        starts = [t.data_ptr() for t in packed]
        assert starts == sorted(starts) and starts[0] % huge_pages.HUGE_PAGE_BYTES == 0
