"""Session 44 (glue44): small robustness / speed items session 43 left. Each test marked "failed before" did.

- ``prepare``'s output hook decides on the output's dtype, not on the observer's wording: a QAT ``QuantStub`` fed token
  ids / a bool mask raised ``FakeQuantize``'s bare "expects a floating-point tensor" (its words differ from the
  observers'), now the message naming the module, as ``prepare`` gives; a float output's ``TypeError`` is untouched;
- ``scaled_operand`` (the second operand of an add with ``alpha`` / a sub) hands out the same scaled-grid tensors for
  the same grid and alpha, so ``QFunctional.add``'s memo of its requantization constants hits (it missed on every
  call: a new scale tensor each time); codes bit-identical to the old per-call formula;
- ``examples.train`` and ``models.photo_crops`` use the one seed rule (``batches.check_seed``): ``np.int64(3)``
  was refused by both, ``True`` / ``1.5`` / ``"3"`` were ``ValueError`` there and ``TypeError`` everywhere else;
- under ``torch.compile(fullgraph=True)`` a wrong dtype at the ``Quantize`` stub, a wrong channel count at a conv and
  a wrong feature count at a Linear raise lowbit's own error when the compiled program runs (``lowbit::failed``),
  not dynamo's ``Unsupported: Observed exception`` at compile time; ``torch.export`` still refuses while tracing.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch
from torch import nn

import lowbit as Q
from lowbit import examples as E
from lowbit.algorithms.layerwise_step import check_seed
from lowbit.models import photos
from lowbit.nn.quantized.functional_modules import QFunctional, scaled_operand
from lowbit.qtensor import QTensor
from helpers import one_thread  # noqa: F401  (autouse fixture: this module runs on 1 thread)


# ---------------------------------------------------------------- 1. the output hook's dtype check

def _wrapped(qat: bool) -> nn.Module:
    m = Q.QuantWrapper(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3)))
    if qat:
        m.train()
        m.qconfig = Q.get_default_qat_qconfig()
        return Q.prepare_qat(m)
    m.eval()
    m.qconfig = Q.get_default_qconfig()
    return Q.prepare(m)


@pytest.mark.parametrize("qat", [False, True], ids=["prepare", "prepare_qat"])  # prepare_qat failed before
@pytest.mark.parametrize("ids", [torch.tensor([[1, 2, 3]]), torch.tensor([[True, False, True]])], ids=["int64", "bool"])
def test_integer_or_bool_output_into_an_observer_names_the_module(qat, ids):
    p = _wrapped(qat)
    what = "FakeQuantize" if qat else "HistogramObserver"
    with pytest.raises(TypeError, match=rf"module 'quant' \(QuantStub\) gives a {ids.dtype} tensor of shape \(1, 3\) "
                                        rf"to its {what}, which observes float activations only"):
        p(ids)


class _Picky(nn.Module):
    """An observer raising its own ``TypeError`` (any wording) for what it refuses."""

    def __init__(self, refuse_float: bool = False):
        super().__init__()
        self.refuse_float = refuse_float

    def forward(self, x):
        if self.refuse_float or not x.is_floating_point():
            raise TypeError(f"_Picky wants something else than {x.dtype}")
        return x


def _hooked(obs: nn.Module) -> nn.Module:
    from lowbit.workflow.hooks import _observe_output

    m = nn.Identity()
    m.activation_post_process = obs
    m.register_forward_hook(_observe_output)
    return m


def test_any_wording_of_an_integer_refusal_names_the_module():  # failed before: _Picky's own words came out
    with pytest.raises(TypeError, match=r"gives a torch.int32 tensor of shape \(2,\) to its _Picky, which observes "
                                        "float activations only"):
        _hooked(_Picky())(torch.tensor([1, 2], dtype=torch.int32))


def test_a_float_outputs_type_error_is_left_as_it_is():
    with pytest.raises(TypeError, match=r"^_Picky wants something else than torch.float32$"):
        _hooked(_Picky(refuse_float=True))(torch.ones(2))
    assert torch.equal(_hooked(_Picky())(torch.ones(2)), torch.ones(2))  # a float output passes


def test_an_observer_that_takes_integers_keeps_them():
    obs = Q.RecordingObserver()
    ids = torch.tensor([3, 1])
    assert torch.equal(_hooked(obs)(ids), ids) and torch.equal(obs.get_tensor_value()[0], ids)


# ---------------------------------------------------------------- 2. scaled_operand's grid memo

def _old_scaled_operand(x: QTensor, alpha: float) -> QTensor | torch.Tensor:
    """Session 43's ``scaled_operand``, a new scale tensor per call: the oracle of the codes."""
    scale = x.scale * abs(alpha)
    if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        return x.dequantize() * alpha
    q, z = x.int_repr(), x.zero_point
    if alpha < 0:
        m = x.qdtype.quant_min + x.qdtype.quant_max
        q, z = (m - q.to(torch.int16)).to(q.dtype), m - z
    return QTensor._trusted(q, scale, z, x.qdtype, x.axis)


QDTYPES = {"quint8": Q.quint8, "qint8": Q.qint8, "quint8[0,127]": Q.quint8.with_range(0, 127),
           "qint8[-127,127]": Q.qint8.with_range(-127, 127)}


@pytest.mark.parametrize("qd", list(QDTYPES))
@pytest.mark.parametrize("alpha", [0.5, -0.75, -1.0, 2.0, -3.0, 1e-3, 2, -2, 1e-45, -7.3e39])
def test_add_with_alpha_codes_are_bit_identical_to_the_per_call_formula(qd, alpha):
    qdtype, g = QDTYPES[qd], torch.Generator().manual_seed(zlib.crc32(repr((qd, alpha)).encode()))
    for trial in range(3):
        sa, sb = [float(torch.empty(()).uniform_(-7, -3, generator=g).exp()) for _ in range(2)]
        za, zb, zo = [int(torch.randint(qdtype.quant_min, qdtype.quant_max + 1, (), generator=g)) for _ in range(3)]
        shape = [(4096,), (2, 8, 5, 5), (3, 7)][trial]
        qa = Q.quantize_per_tensor(torch.randn(shape, generator=g), sa, za, qdtype)
        qb = Q.quantize_per_tensor(torch.randn(shape, generator=g) * 0.7, sb, zb, qdtype)
        so = (sa + sb * min(abs(alpha), 10.0)) * 1.3
        qf = QFunctional(so, zo, qdtype)
        for _ in range(3):  # first call fills the memos, the next ones read them
            try:
                want = QFunctional(so, zo, qdtype).add(qa, _old_scaled_operand(qb, alpha))
            except RuntimeError as e:  # |alpha| · s past float32: float alpha · b, inf · 0 = NaN, refused alike
                with pytest.raises(RuntimeError, match=re.escape(str(e))):
                    qf.add(qa, scaled_operand(qb, alpha, qf))
                continue
            got = qf.add(qa, scaled_operand(qb, alpha, qf))  # (the grid kept on qf, as a converted graph passes it)
            assert torch.equal(got.int_repr(), want.int_repr())
            assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)
            y, y_old = scaled_operand(qb, alpha, qf), _old_scaled_operand(qb, alpha)
            assert type(y) is type(y_old)
            if isinstance(y, QTensor):
                assert torch.equal(y.int_repr(), y_old.int_repr()) and torch.equal(y.scale, y_old.scale)
                assert torch.equal(y.zero_point, y_old.zero_point) and y.qdtype == y_old.qdtype
            else:
                assert torch.equal(y, y_old)


@pytest.mark.parametrize("alpha", [0.5, -1.0, -0.75])
def test_add_with_alpha_reads_its_requantization_constants_once(alpha):  # failed before: one memo entry per call
    qa = Q.quantize_per_tensor(torch.randn(2, 4, 6, 6), 0.02, 128, Q.quint8)
    qb = Q.quantize_per_tensor(torch.randn(2, 4, 6, 6), 0.03, 120, Q.quint8)
    qf = QFunctional(0.05, 125)
    first = scaled_operand(qb, alpha, qf)  # (procstate45: the grid memo is qf's, the converted graph's third argument)
    outs = [qf.add(qa, scaled_operand(qb, alpha, qf)) for _ in range(5)]
    assert scaled_operand(qb, alpha, qf).scale is first.scale
    assert scaled_operand(qb, alpha, qf).zero_point is first.zero_point
    assert len(qf._memo) == 1
    assert all(torch.equal(o.int_repr(), outs[0].int_repr()) for o in outs)


def test_scaled_grid_follows_in_place_writes():
    qb, qf = Q.quantize_per_tensor(torch.randn(8), 0.03, 120, Q.quint8), QFunctional(0.05, 125)
    y = scaled_operand(qb, -0.5, qf)
    y.scale.mul_(4)  # the handed-out grid written: made again
    assert float(scaled_operand(qb, -0.5, qf).scale) == pytest.approx(0.015)
    qb.scale.mul_(2)  # the input grid written: made again
    y2 = scaled_operand(qb, -0.5, qf)
    assert float(y2.scale) == pytest.approx(0.03) and int(y2.zero_point) == 255 - 120
    assert torch.equal(y2.dequantize(), -0.5 * qb.dequantize())


# ---------------------------------------------------------------- 3. one seed rule for examples / photos

def _train(seed):
    torch.manual_seed(0)
    m = E.SmallCNN(channels=(4, 4), hidden=8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    return E.train(m, x, y, epochs=1, batch_size=16, seed=seed)


def _crops(seed):
    if not photos.photos_available():
        pytest.skip("scikit-image's photos are not installed")
    return photos.photo_crops(2, seed=seed, size=16)


ENTRIES = {"train": _train, "photo_crops": _crops}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("seed", [np.int64(3), np.uint8(3), torch.tensor(3)], ids=["np.int64", "np.uint8", "tensor"])
def test_numpy_and_tensor_int_seeds_are_the_int(entry, seed):  # failed before: ValueError
    run = ENTRIES[entry]
    a, b = run(seed), run(3)
    if entry == "train":
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("seed, exc, shown", [(True, TypeError, "seed=True"), (1.5, TypeError, "seed=1.5"),
                                              ("3", TypeError, "seed='3'"), (None, TypeError, "seed=None"),
                                              (2**64, ValueError, "seed=18446744073709551616")])
def test_bad_seeds_are_refused_as_everywhere_else(entry, seed, exc, shown):  # 9 of 10 failed before (ValueError, no "train:")
    run = {"train": _train, "photo_crops": lambda s: photos.photo_crops(2, seed=s, size=16)}[entry]
    with pytest.raises(exc, match=rf"^{entry}: {shown}"):
        run(seed)
    with pytest.raises(exc, match=rf"^{entry}: {shown}"):  # the very error of the one rule
        check_seed(entry, seed)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_negative_seed_is_in_the_one_rules_range(entry):
    """``check_seed`` takes ``[-2**63, 2**64)``, torch.Generator's range (a negative seed is a valid generator seed),
    for quantize_ptq / reconstruct / tune_biases / distill alike: -1 is not refused here either."""
    assert check_seed(entry, -1) == -1
    a, b = ENTRIES[entry](-1), ENTRIES[entry](-1)
    if entry == "train":
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    else:
        assert torch.equal(a, b)


def test_check_seed_lives_below_the_examples_and_keeps_its_old_import_path():
    from lowbit.batches import check_seed as low_home

    assert low_home is check_seed


# ---------------------------------------------------------------- 4. refusals under torch.compile(fullgraph=True)

def _converted() -> tuple[nn.Module, torch.Tensor]:
    import copy
    import warnings

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(8, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Q.prepare_fx(copy.deepcopy(m), Q.get_default_qconfig_mapping(), example_inputs=(x,))
        p(x)
        return Q.convert_fx(p), x


BAD_INPUTS = {  # what eager raises; before, fullgraph=True gave torch._dynamo.exc.Unsupported: Observed exception
    "int64": (lambda x: x.long(), TypeError, "Quantize expects a float tensor or a QTensor, got Tensor of dtype "
                                             "torch.int64"),
    "uint8": (lambda x: x.to(torch.uint8), TypeError, "got Tensor of dtype torch.uint8"),
    "channels": (lambda x: torch.randn(2, 5, 8, 8), ValueError, r"ConvReLU2d: expects input of shape \(N, 3, \*2 "
                                                                r"spatial dims\) or unbatched, got \(2, 5, 8, 8\)"),
    "channels, unbatched": (lambda x: torch.randn(5, 8, 8), ValueError, r"or unbatched, got \(5, 8, 8\)"),
    "features": (lambda x: x[0], ValueError, r"Linear: input of shape \(4, 36\) does not end in in_features=144"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_fullgraph_compiled_model_raises_lowbits_own_refusal(bad):  # failed before: dynamo's Unsupported
    qm, x = _converted()
    make, exc, msg = BAD_INPUTS[bad]
    with pytest.raises(exc, match=msg):  # eager: the oracle
        qm(make(x))
    torch._dynamo.reset()
    cm = torch.compile(qm, fullgraph=True, backend="eager")
    assert torch.equal(cm(x), qm(x))
    with pytest.raises(exc, match=msg):
        cm(make(x))
    assert torch.equal(cm(x), qm(x))  # a good input after it: the same codes


def test_inductor_keeps_the_first_refusal():
    """A refused conv's stand-in result feeds the next layer, which refuses too (its input is not the shape it takes):
    the first refusal raises, not the later one (``lowbit::failed`` reads the refused input: ordered, never dropped)."""
    qm, x = _converted()
    torch._dynamo.reset()
    cm = torch.compile(qm, fullgraph=True)
    with pytest.raises(ValueError, match=r"ConvReLU2d: .* got \(5, 8, 8\)"):
        cm(torch.randn(5, 8, 8))


def test_export_still_refuses_while_tracing():
    qm, x = _converted()
    with pytest.raises(TypeError, match="Quantize expects a float tensor or a QTensor, got FakeTensor of dtype "
                                        "torch.int64"):
        torch.export.export(qm, (x.long(),))
    with pytest.raises(ValueError, match=r"ConvReLU2d: .* got \(2, 5, 8, 8\)"):
        torch.export.export(qm, (torch.randn(2, 5, 8, 8),))


def test_a_wrong_rank_raises_lowbits_refusal_on_run():
    """A rank no layer takes: the conv goes on tracing on one sample of a shape it takes (refuse44; before: dynamo's
    "Observed exception")."""
    qm, x = _converted()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^ConvReLU2d: .* or unbatched, got \(1, 2, 3, 8, 8\)$"):
        torch.compile(qm, fullgraph=True, backend="eager")(torch.randn(1, 2, 3, 8, 8))


# ---------------------------------------------------------------- 5. compiler_disabled without torch's private API

_FALLBACK_SCRIPT = """
import json, torch
import torch._dynamo  # (the fallback imports it with lowbit: loaded first, its own set-up untouched)
import torch._C._dynamo.eval_frame as ef
kept = ef.set_code_exec_strategy
def gone(*args):
    raise TypeError("a torch without set_code_exec_strategy")
ef.set_code_exec_strategy = gone  # (what compile_state reads at import)
from lowbit import compile_state
ef.set_code_exec_strategy = kept
seen = []
def inner(x):
    seen.append(torch.compiler.is_compiling())
    return x.sin() + 1
disabled = compile_state.compiler_disabled(inner, reason="lowbit s44: eager only")
f = lambda x: disabled(x.cos()) * 2
x = torch.linspace(-1, 1, 5)
out = torch.compile(f, backend="eager")(x)
explained = torch._dynamo.explain(f)(x)
print(json.dumps({"fallback": compile_state.compiler_disabled.__name__ == "<lambda>", "same": bool(torch.equal(out, f(x))),
                  "compiled_inside": any(seen), "breaks": explained.graph_break_count,
                  "reason": str(explained.break_reasons[0].reason)}))
"""


def test_compiler_disabled_falls_back_to_the_public_decorator():
    """torch 2.13 has no public way to mark a function's frames skipped without importing dynamo (``import lowbit``
    would pay ~1.5 s): ``torch.compiler.disable`` and ``set_stance`` both ``import torch._dynamo``. Without the
    private ``set_code_exec_strategy`` ``compiler_disabled`` is ``torch.compiler.disable`` itself; held here, eager
    and compiled."""
    import json

    from helpers import fresh_python

    done = fresh_python(_FALLBACK_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["fallback"] and got["same"] and not got["compiled_inside"] and got["breaks"] == 1
    assert "lowbit s44: eager only" in got["reason"]
