"""PyTorch 2: converted models (eager convert, convert_fx, quantize_dynamic, quantize_weight_only) under
``torch.compile(fullgraph=True)`` and ``torch.export`` (dynamic batch; save -> load in a fresh process),
bit-identical to eager; and the converted forward takes the fast kernels where they exist (``kernels.counts``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import kernels
from lowbit.examples import SmallCNN
from lowbit.kernels import conv_small, onednn
from lowbit.nn.quantized.functional_modules import FloatFunctional
from helpers import ConvNet as _ConvNet, threads

SRC = str(Path(Q.__file__).resolve().parent.parent)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def _eager_converted(backend: str | None = None) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = Q.fuse_modules(SmallCNN(channels=(4, 8), hidden=16).eval(), SmallCNN.fusion_groups())
    p = Q.prepare(m, Q.get_default_qconfig(backend))
    p(torch.randn(16, 1, 28, 28))
    return Q.convert(p), torch.randn(5, 1, 28, 28)


def _fx_converted() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    p = Q.prepare_fx(_ConvNet().eval(), Q.get_default_qconfig_mapping(), (x,))
    p(torch.randn(16, 3, 8, 8))
    return Q.convert_fx(p), torch.randn(5, 3, 8, 8)


def _dynamic(**recipe: object) -> tuple[nn.Module, torch.Tensor]:
    """``quantize_dynamic`` on the default per-token u8 recipe, or on ``get_dynamic_qconfig(**recipe)``."""
    torch.manual_seed(0)
    spec = {nn.Linear: Q.get_dynamic_qconfig(**recipe)} if recipe else None  # type: ignore[arg-type]
    return Q.quantize_dynamic(_MLP().eval(), spec), torch.randn(5, 7, 32)


def _eager_activations() -> tuple[nn.Module, torch.Tensor]:
    """An unfused ``nn.ReLU`` after a quantized Linear (``QTensor.relu``) and the table activations (Hardswish,
    Sigmoid, LeakyReLU, ELU): each read its grid into Python, which ``torch.export`` refused (data-dependent guard)."""
    torch.manual_seed(0)
    m = nn.Sequential(Q.QuantStub(), nn.Linear(32, 32), nn.ReLU(), nn.Hardswish(), nn.Linear(32, 32), nn.Sigmoid(),
                      nn.Linear(32, 16), nn.LeakyReLU(0.1), nn.ELU(), Q.DeQuantStub()).eval()
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(64, 32))
    return Q.convert(p), torch.randn(5, 32)


class _Functional(nn.Module):
    """Every ``FloatFunctional`` op after convert; ``cat`` compared its inputs' grids with the output's (a data-dependent
    branch ``torch.export`` refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.f = FloatFunctional()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        a, b = self.c1(x), self.c2(x)
        return self.dequant(self.f.cat([self.f.mul(a, b), self.f.add_scalar(a, 0.5), self.f.mul_scalar(b, 2.0),
                                        self.f.add_relu(a, b)], dim=1))


def _eager_functional() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    p = Q.prepare(_Functional().eval(), Q.get_default_qconfig())
    p(torch.randn(16, 3, 8, 8))
    return Q.convert(p), torch.randn(5, 3, 8, 8)


def _weight_only(bits: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Q.quantize_weight_only(_MLP().eval(), bits=bits, group_size=32 if bits == 4 else -1), torch.randn(5, 32)


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.bag = nn.Embedding(20, 8), nn.EmbeddingBag(20, 8, mode="sum")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.emb(ids).flatten(1), self.bag(ids)], 1)  # (no float reduction for inductor to reorder)


def _embeddings() -> tuple[nn.Module, torch.Tensor]:
    """An 8-bit Embedding and a 4-bit EmbeddingBag (their index checks read values: skipped while traced)."""
    torch.manual_seed(0)
    m = _Tables().eval()
    m.emb.qconfig, m.bag.qconfig = Q.get_embedding_qconfig(8), Q.get_embedding_qconfig(4)
    return Q.convert(Q.prepare(m)), torch.randint(0, 20, (5, 7))


MODELS = {"eager_convert": _eager_converted, "embeddings": _embeddings, "eager_convert_x86": lambda: _eager_converted("x86"),
          "eager_activations": _eager_activations, "eager_functional": _eager_functional,
          "convert_fx": _fx_converted, "dynamic": _dynamic,
          "dynamic_u7_per_token": lambda: _dynamic(reduce_range=True),
          "dynamic_x86_recipe": lambda: _dynamic(backend="x86"),
          "weight_only_int4": lambda: _weight_only(4), "weight_only_int8": lambda: _weight_only(8)}


_one_thread = threads(1, "function", "_one_thread")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_compile_fullgraph_matches_eager(kind: str) -> None:
    model, x = MODELS[kind]()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        ref, got = model(x), compiled(x)
    assert torch.equal(ref, got), f"{kind}: compiled output differs from eager (max {(ref - got).abs().max()})"


_LOAD = """
import sys, torch, lowbit
for name in sys.argv[2:]:
    ep = torch.export.load(f"{sys.argv[1]}/{name}.pt2")
    torch.save(ep.module()(torch.load(f"{sys.argv[1]}/{name}.x.pt")), f"{sys.argv[1]}/{name}.y.pt")
"""


def test_export_dynamic_batch_save_load_fresh_process(tmp_path: Path) -> None:
    """Every model kind exports with a dynamic batch (traced at 3, run at 5) through ``torch.ops.lowbit``
    ops; the saved programs, loaded in a fresh process that imports lowbit, give the eager outputs."""
    refs = {}
    for kind, build in MODELS.items():
        model, x = build()
        batch = torch.export.Dim("batch", min=1, max=1024)
        ep = torch.export.export(model, (x[:3],), dynamic_shapes=({0: batch},))
        names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert kind == "embeddings" or any(n.startswith("lowbit.") for n in names), f"{kind}: {names}"  # (tables: aten)
        with torch.no_grad():
            refs[kind] = model(x)
        assert torch.equal(ep.module()(x), refs[kind]), f"{kind}: the exported program differs from eager"
        torch.export.save(ep, tmp_path / f"{kind}.pt2")
        torch.save(x, tmp_path / f"{kind}.x.pt")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path), *refs], check=True, env=env, timeout=300)
    for kind, ref in refs.items():
        assert torch.equal(torch.load(tmp_path / f"{kind}.y.pt"), ref), f"{kind}: the loaded program differs"


@pytest.mark.skipif(not onednn.available(), reason="torch built without oneDNN quantized ops (non-x86 build)")
@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "avx2_split"])
def test_converted_forward_takes_the_fast_kernels(vnni: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with oneDNN, no converted layer of a static, fx or dynamic model falls back to the reference
    kernel; both ISA paths are pinned by ``has_vnni``: VNNI, one exact call per layer; AVX2, the exact 7-bit splits
    of ``kernels.avx2`` (a Linear stacks its activation codes' two halves into one call, or runs fbgemm for few rows;
    a conv splits its constant weights once, packed at the first call, and makes one call on the unmodified codes,
    a depthwise conv two)."""
    monkeypatch.setattr(onednn, "has_vnni", lambda: vnni)
    for kind in ("eager_convert", "eager_convert_x86", "convert_fx", "dynamic", "dynamic_u7_per_token",
                 "dynamic_x86_recipe"):
        model, x = MODELS[kind]()
        kernels.counts.clear()
        with torch.no_grad():
            model(x)
        ran = dict(kernels.counts)
        assert not any(b == "reference" for b, _ in ran), f"{kind}: fell back to the reference kernel: {ran}"
        assert sum(n for (b, _), n in ran.items() if b == "onednn") >= 2, f"{kind}: {ran}"


def test_compiled_model_counts_its_kernels() -> None:
    """The custom ops call back into the dispatcher: a compiled model is counted (and pinnable) like eager."""
    model, x = _eager_converted()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(x)
        kernels.counts.clear()
        with kernels.use_backend("reference"):
            ref = compiled(x)
    assert kernels.counts[("reference", "conv")] == 3 and kernels.counts[("reference", "linear")] == 2
    with torch.no_grad(), kernels.use_backend("reference"):
        assert torch.equal(ref, model(x))


def test_compiled_linear_takes_the_eager_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled static Linear runs the eager module's plan (``kernels.plan``), with or without VNNI (pinned by
    ``has_vnni``; the generic dispatcher only without oneDNN), with eager's codes either way."""
    model, x = _eager_converted("x86")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    for vnni in (False, True):
        monkeypatch.setattr(onednn, "has_vnni", lambda v=vnni: v)
        monkeypatch.setattr(onednn, "shares_routes", lambda: True)  # (AVX-512 VNNI: the plan runs with VNNI too)
        with torch.no_grad():
            ref = model(x)
            got = compiled(x)
        assert torch.equal(ref, got), f"has_vnni={vnni}: compiled differs from eager"
        cache = Q.pt2.weight_cache(model.fc1.weight_int8)
        plan = cache["pt2.linear_plan"][1]
        assert (plan is None) == (not onednn.available()), f"has_vnni={vnni}: plan {plan}"


def test_compiled_conv_and_pool_take_the_eager_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled static conv runs the eager module's plan (``kernels.conv_plan``) where one is made (VNNI, pinned;
    without VNNI these random weights need the split: the generic dispatcher), and max pooling stays one opaque
    ``lowbit::max_pool2d_codes`` op (inlined, inductor fused its window reads into the flatten's index order);
    eager's codes either way."""
    model, x = _eager_converted()
    for vnni in (True, False):
        monkeypatch.setattr(onednn, "has_vnni", lambda v=vnni: v)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        with torch.no_grad():
            assert torch.equal(compiled(x), model(x)), f"has_vnni={vnni}: compiled differs from eager"
        hit = Q.pt2.weight_cache(model.conv2.weight_int8).get("pt2.conv_plan")
        if onednn.available():
            weight, out = model.conv2._prepared()  # a small window takes the native pass on any CPU (no split)
            safe = onednn.saturation_safe(model.conv2.weight_int8)  # (these weights: not safe)
            small = conv_small.takes(weight, model.conv2._spec, out, not (vnni or safe))
            planned = vnni or safe or small
            assert hit is not None and (hit[1] is not None) == planned, f"has_vnni={vnni}: {hit}"
    gm = torch.export.export(model, (x,)).graph_module
    pools = [n for n in gm.graph.nodes if str(n.target) == "lowbit.max_pool2d_codes.default"]
    assert len(pools) == 2, gm.graph
    q = torch.randint(0, 256, (2, 3, 6, 7), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    y = torch.ops.lowbit.max_pool2d_codes(q, [2, 2], [2, 2])
    assert torch.equal(y, torch.nn.functional.max_pool2d(q.float(), 2).to(torch.uint8))
    with pytest.raises(ValueError, match="max_pool2d_codes: kernel_size=\\[2, 2\\].*not covered"):
        torch.ops.lowbit.max_pool2d_codes(q.contiguous(), [2, 2], [2, 2])  # NCHW codes: not this op's case


def test_traced_convs_emit_the_compact_op_and_the_legacy_op_still_runs() -> None:
    """Traced convs are one ``lowbit::qconv_cfg`` each (the grids and geometry as one string: ~5 µs of dispatcher
    boxing instead of ~13); ``lowbit::qconv`` (programs exported before session 21) gives the same codes; a config
    string that is not ``conv_config``'s raises naming it."""
    from lowbit.compile_state import conv_config, qdtype_key

    model, x = _eager_converted()
    ep = torch.export.export(model, (x,))
    targets = [str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count("lowbit.qconv_cfg.default") == 3 and "lowbit.qconv.default" not in targets
    conv, spec = model.conv2, model.conv2._spec
    with torch.no_grad():
        xq = model.pool(model.conv1(model.quant(x)))
    weight, out = conv._prepared()
    keys = (qdtype_key(xq.qdtype), qdtype_key(weight.qdtype), qdtype_key(out.qdtype))
    geometry = (list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups, spec.transposed, [0, 0])
    args = (xq.int_repr(), xq.scale, xq.zero_point)
    wargs = (weight.int_repr(), weight.scale, weight.zero_point)
    legacy = torch.ops.lowbit.qconv(*args, keys[0], *wargs, keys[1], conv.bias, out.scale_t, out.zero_point_t, keys[2],
                                    True, *geometry)
    compact = torch.ops.lowbit.qconv_cfg(*args, *wargs, conv.bias, out.scale_t, out.zero_point_t,
                                         conv_config(*keys, True, *geometry))
    assert torch.equal(legacy, compact) and torch.equal(compact, conv(xq).int_repr())
    with pytest.raises(ValueError, match=r"config='quint8:0:255\|1'"):
        torch.ops.lowbit.qconv_cfg(*args, *wargs, conv.bias, out.scale_t, out.zero_point_t, "quint8:0:255|1")


def test_compiled_and_exported_static_models_refuse_nan_as_eager_does() -> None:
    """Eager raises on a NaN input (int8 codes cannot hold it); so do the compiled and exported programs instead of
    turning the NaN into finite codes: the stub's opaque ``lowbit::quantize_codes`` (eager's pass, its error) where
    ``lowbit.native`` is built, else the traced graph's ``_assert_async``."""
    model, x = _eager_converted()
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="holds 1 NaN"):
        model(bad)
    torch._dynamo.reset()
    runners = {"export": torch.export.export(model, (x,)).module(), "compile": torch.compile(model, fullgraph=True)}
    for name, run in runners.items():
        assert torch.equal(run(x), model(x)), name
        with pytest.raises(RuntimeError, match="holds (1 )?NaN values"):
            run(bad)


def test_compiled_graph_mode_models_raise_their_own_run_time_errors() -> None:
    """A ``convert_fx`` model compiled with ``fullgraph=True`` raises eager's NaN error, not dynamo's "Attempt to trace
    generator" from torch.fx's error wrapper (``fx/call.py``), also after ``copy.deepcopy`` and ``fuse_dequantize``'s
    recompile; the outputs stay eager's, and GraphModules lowbit did not build keep torch.fx's wrapper."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 2)).eval()
    x = torch.randn(2, 3, 8, 8)
    p = Q.prepare_fx(m, Q.get_default_qconfig_mapping(), (x,))
    p(x)
    q = Q.convert_fx(p)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    fused = copy.deepcopy(q)
    assert Q.fuse_dequantize(fused) == ["3"]  # (in place: the Linear now returns float, recompiled)
    for name, model in {"convert_fx": q, "deepcopy": copy.deepcopy(q), "fuse_dequantize": fused}.items():
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True)
        assert torch.equal(run(x), model(x)), name
        with pytest.raises(RuntimeError, match="holds 1 NaN values"):
            run(bad)
    plain = torch.fx.symbolic_trace(m)
    assert type(type(plain).__dict__["_wrapped_call"]).__name__ == "_WrappedCall"


def test_traced_stub_op_keeps_no_grid_alive() -> None:
    """``lowbit::quantize_codes`` keeps its grid numbers per scale tensor (``weight_cache``) without holding the scale
    itself: once a model's buffers are gone, so is the entry (a cached module holding them kept every one alive)."""
    import gc
    import weakref

    from lowbit.pt2.kernel_ops import _CACHES

    before, refs = len(_CACHES), []
    for i in range(20):
        s, z = torch.tensor(0.02 + i / 1000), torch.tensor(128)
        x = torch.randn(3, 5)
        got = torch.ops.lowbit.quantize_codes(x, s, z, "quint8:0:255")
        assert torch.equal(got, Q.quantize_per_tensor(x, s, z, Q.quint8).int_repr())
        s.mul_(2)  # (an in-place change of the grid: the next call sees it)
        assert torch.equal(torch.ops.lowbit.quantize_codes(x, s, z, "quint8:0:255"),
                           Q.quantize_per_tensor(x, s, z, Q.quint8).int_repr())
        refs.append(weakref.ref(s))
        del s, z
    gc.collect()
    assert not any(r() is not None for r in refs) and len(_CACHES) <= before  # (other tests' entries may go too)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_exported_program_frees_its_weights(kind: str) -> None:
    """Once an exported program and its model are gone, so are their tensors: the ops' caches (plans, packs, a
    weight-only module) hold a second tensor object on the weight's storage (``cached_weight``), never the weight
    that keys them; before, ``qlinear``, ``dynamic_linear`` and ``weight_only_linear`` entries kept their own key, and
    with it every weight, alive for the life of the process."""
    import gc
    import weakref

    from lowbit.pt2.kernel_ops import _CACHES

    gc.collect()
    before = set(_CACHES)
    model, x = MODELS[kind]()
    program = torch.export.export(model, (x,)).module()
    assert torch.equal(program(x), model(x))
    assert set(_CACHES) - before or kind == "embeddings", "no op cached anything: the test would prove nothing"
    refs = [weakref.ref(t) for m in (model, program) for t in [*m.buffers(), *m.parameters()]]
    del model, program
    gc.collect()  # (one: a weight freed inside it drops its cache, whose entries hold no reference cycle)
    assert [r() for r in refs if r() is not None] == []
    assert not set(_CACHES) - before


def test_op_cache_follows_a_data_swap() -> None:
    """``weight.data = other`` swaps the storage without a version bump: the op's cached plan is rebuilt on the new
    codes (``cached_weight`` compares the storage), as a fresh program on them computes."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 16), dtype=torch.uint8)
    w = torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    grids = (torch.tensor(0.02), torch.tensor(3), "quint8:0:255")

    def run(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.lowbit.qlinear(x, *grids, weight, torch.full((8,), 0.01), torch.zeros(8, dtype=torch.int64),
                                        "qint8:-128:127", None, torch.tensor(0.05), torch.tensor(7), "quint8:0:255",
                                        False)
    first = run(w)
    other = torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    w.data = other.clone()
    assert torch.equal(run(w), run(other)) and not torch.equal(run(w), first)


@pytest.mark.parametrize("args,error,match", [
    ((torch.arange(4), 0.1, 3, "quint8:0:255"), TypeError, "float tensor"),
    ((torch.randn(4), 0.1, 3, "bogus"), ValueError, "qdtype key 'bogus'"),
    ((torch.randn(4), 0.0, 3, "quint8:0:255"), ValueError, "scale=0.0"),
    ((torch.randn(4), float("nan"), 3, "quint8:0:255"), ValueError, "scale=nan"),
    ((torch.randn(4), -0.1, 3, "quint8:0:255"), ValueError, "must be a positive finite float"),
    ((torch.randn(4), 0.1, 300, "quint8:0:255"), ValueError, "zero_point=300"),
    ((torch.randn(4), [0.1, 0.2], 3, "quint8:0:255"), ValueError, r"shapes \(2,\) and \(\)"),
    ((torch.tensor([1.0, float("nan")]), 0.1, 3, "quint8:0:255"), RuntimeError, "holds 1 NaN"),
])
def test_quantize_codes_op_names_bad_values(args: tuple, error: type, match: str) -> None:
    """``lowbit::quantize_codes`` called by hand (a traced stub never sends these): each wrong value raises naming it,
    as ``Quantize`` does; an empty input gives empty codes."""
    x, s, z, key = args
    with pytest.raises(error, match=match):
        torch.ops.lowbit.quantize_codes(x, torch.tensor(s), torch.tensor(z), key)
    empty = torch.ops.lowbit.quantize_codes(torch.randn(0, 3), torch.tensor(0.1), torch.tensor(3), "quint8:0:255")
    assert empty.shape == (0, 3) and empty.dtype == torch.uint8
