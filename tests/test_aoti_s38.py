"""AOTInductor sweep (session 38): converted models through ``torch.export`` -> ``aoti_compile_and_package`` ->
``aoti_load_package`` (same process, a fresh process with and without ``import lowbit``), bit-identical to eager; and the
ops' caches under AOTI's inlined constants (a 1-d constant of <= 8 values is a fresh buffer on every call).

The two AOTI tests compile C++ (~10-30 s each on one thread): marked ``slow`` (``-m "not slow"`` leaves them out)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit as Q
from helpers import ConvNet, fresh_python
from lowbit.examples import SmallCNN
from lowbit.nn.quantized import weight_only
from lowbit.pt2 import kernel_ops

U8, I8 = "quint8:0:255", "qint8:-128:127"


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts of what a cache miss of the ops runs: the weight checks, the conv / Linear plans (packed weights) and
    the weight-only module (its int4 pack)."""
    calls: Counter = Counter()

    def counted(name: str, f):
        def wrap(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return wrap
    for name in ("check_weight", "conv_plan", "linear_plan"):
        monkeypatch.setattr(kernel_ops, name, counted(name, getattr(kernel_ops, name)))
    init = weight_only.WeightOnlyLinear.__init__

    def counted_init(self, *a, **k):
        calls["WeightOnlyLinear"] += 1
        init(self, *a, **k)
    monkeypatch.setattr(weight_only.WeightOnlyLinear, "__init__", counted_init)
    return calls


def _layers() -> dict[str, tuple]:
    """One small layer per op that keeps a per-weight cache, as ``(op, arguments, index of its weight, indices of its grid
    and bias)``: 4 output
    channels, per-channel grids, so AOTI inlines the grids and the bias."""
    torch.manual_seed(0)
    s, z = torch.tensor(0.05), torch.tensor(3)
    ws, wz, b = torch.rand(4) * 0.01 + 0.002, torch.zeros(4, dtype=torch.int64), torch.randn(4)
    xc = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    wc = torch.randint(-127, 128, (4, 3, 3, 3), dtype=torch.int8)
    xl, wl = torch.randint(0, 256, (5, 16), dtype=torch.uint8), torch.randint(-127, 128, (4, 16), dtype=torch.int8)
    wo = Q.quantize_weight_only(nn.Sequential(nn.Linear(16, 4)).eval(), bits=4, group_size=8)[0]
    return {
        "qconv_cfg": (torch.ops.lowbit.qconv_cfg, [xc, s, z, wc, ws, wz, b, s, z, f"{U8}|{I8}|{U8}|1|1,1|1,1|1,1|1|0|0,0"],
                      3, (4, 5, 6)),
        "qlinear": (torch.ops.lowbit.qlinear, [xl, s, z, U8, wl, ws, wz, I8, b, s, z, U8, False], 4, (5, 6, 8)),
        "dynamic_linear": (torch.ops.lowbit.dynamic_linear, [torch.randn(5, 16), wl, ws, wz, I8, b], 1, (2, 3, 5)),
        "weight_only_linear": (torch.ops.lowbit.weight_only_linear,
                               [torch.randn(5, 16), wo.qweight, wo.scales, wo.zero_points, wo.bias,
                                [16, 4, 4, 8, int(wo.symmetric), 0], wo.kernel], 1, (2, 3, 4)),
    }


@pytest.mark.parametrize("op_name", ["qconv_cfg", "qlinear", "dynamic_linear", "weight_only_linear"])
def test_ops_keep_their_plans_for_fresh_grid_tensors_of_equal_values(op_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTInductor inlines a 1-d constant of <= 8 values (the per-channel grid and bias of a layer with <= 8 output
    channels) as a kernel that fills a fresh buffer on every call. The ops keyed their caches on those tensors'
    identities, so each call of an AOTI program checked the weight again and built its plan again (the conv's oneDNN
    pack, the weight-only module and its int4 pack): SmallCNN(4, 8) ran 540 µs per batch-5 call instead of 290. Fresh
    tensors with the values of the held grid now reuse it; other values still build anew (and give their numbers)."""
    op, args, w, grid = _layers()[op_name]
    ref = op(*args)
    calls = _counting(monkeypatch)

    def call_with_fresh_grid(scale_by: float = 1.0) -> torch.Tensor:
        fresh = list(args)
        for i in grid:
            fresh[i] = args[i].clone() * (scale_by if args[i].is_floating_point() else 1)
        return op(*fresh)

    for _ in range(2):
        assert torch.equal(call_with_fresh_grid(), ref)
    calls.clear()
    for _ in range(3):
        assert torch.equal(call_with_fresh_grid(), ref)
    assert not calls, f"{op_name} rebuilt {dict(calls)} for grid tensors of the same values"
    other = call_with_fresh_grid(2.0)  # another grid: its own numbers, those of a weight seen for the first time
    first_seen = list(args)
    first_seen[w] = args[w].clone()
    for i in grid:
        first_seen[i] = args[i] * (2.0 if args[i].is_floating_point() else 1)
    assert torch.equal(other, op(*first_seen)) and not torch.equal(other, ref)


def _aoti(model: nn.Module, x: torch.Tensor, path: Path) -> object:
    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(model, (x[:3],), dynamic_shapes=({0: batch},))
    return torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=str(path)))


def _bit_exact_without_rebuilds(runner: object, model: nn.Module, x: torch.Tensor,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``runner`` (an AOTI package) gives ``model``'s eager outputs bit for bit at batches ``len(x)`` and 1, and after
    its second call makes no weight check, plan or weight-only module again."""
    calls = _counting(monkeypatch)
    for _ in range(2):
        assert torch.equal(runner(x), model(x)) and torch.equal(runner(x[:1]), model(x[:1]))
    calls.clear()
    assert torch.equal(runner(x), model(x))
    assert not calls, f"the AOTI program rebuilt {dict(calls)}"


@pytest.mark.slow
def test_aoti_eager_converted_cnn_in_process_and_in_fresh_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager-converted SmallCNN (4 and 8 channels: AOTI inlines their grids) through AOTInductor with a dynamic batch
    (traced at 3, run at 5 and 1): the eager codes bit for bit, no conv plan built after the second call; a fresh
    process that imports lowbit runs the package to the same outputs; one that does not cannot load it, and torch's
    error names the missing ``lowbit::`` op (at load, before any input is read: no silent output)."""
    torch.manual_seed(0)
    m = Q.fuse_modules(SmallCNN(channels=(4, 8), hidden=16).eval(), SmallCNN.fusion_groups())
    p = Q.prepare(m, Q.get_default_qconfig())
    p(torch.randn(16, 1, 28, 28))
    model, x = Q.convert(p), torch.randn(5, 1, 28, 28)
    runner = _aoti(model, x, tmp_path / "cnn.pt2")
    _bit_exact_without_rebuilds(runner, model, x, monkeypatch)
    torch.save((x, model(x)), tmp_path / "ref.pt")
    # one fresh process for both: the load without lowbit first (it must fail naming the op), then `import lowbit`
    # and the same package runs (before: one process each, a second torch import for the same two checks)
    script = ("import sys, torch\n"
              "assert 'lowbit' not in sys.modules\n"
              "x, ref = torch.load(sys.argv[1] + '/ref.pt')\n"
              "for step in ('0', '1'):\n"
              "    if step == '1':\n        import lowbit\n"
              "    try:\n        r = torch._inductor.aoti_load_package(sys.argv[1] + '/cnn.pt2')\n"
              "    except RuntimeError as e:\n        print(step, 'ERROR', repr(str(e)))\n"
              "    else:\n        print(step, 'EQUAL', torch.equal(r(x), ref))\n")
    # torch's package loader extracts into $TMPDIR/aotinductor_XXXXXX and removes that folder when the loader is
    # destroyed, but the load without lowbit throws inside its constructor and the second loader is never destroyed
    # at interpreter exit: both folders stayed behind in /tmp (~1.8 MB each, every run). The fresh process's TMPDIR is
    # this test's tmp_path, which pytest cleans up.
    (tmp_path / "tmp").mkdir()
    with monkeypatch.context() as env:  # (only the child's environment: this process's TMPDIR is back right after)
        env.setenv("TMPDIR", str(tmp_path / "tmp"))
        done = fresh_python(script, str(tmp_path))
    out = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert out.keys() == {"0", "1"}, done.stdout + done.stderr
    assert out["1"] == "EQUAL True", done.stdout + done.stderr
    assert out["0"].startswith("ERROR") and "lowbit::" in out["0"], done.stdout + done.stderr


class _Mixed(nn.Module):
    """A graph-converted static conv net (8 channels) feeding a dynamic Linear (10 -> 8) and int4 / int8 weight-only
    Linears (8 -> 4 -> 4): every lowbit op kind with inlined grids or biases in one program."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        x = torch.randn(4, 3, 8, 8)

        prepared = Q.prepare_fx(ConvNet().eval(), Q.get_default_qconfig_mapping(), (x,))
        prepared(torch.randn(16, 3, 8, 8))
        self.static = Q.convert_fx(prepared)
        self.dynamic = Q.quantize_dynamic(nn.Sequential(nn.Linear(10, 8)).eval())
        self.int4 = Q.quantize_weight_only(nn.Sequential(nn.Linear(8, 4)).eval(), bits=4, group_size=8)
        self.int8 = Q.quantize_weight_only(nn.Sequential(nn.Linear(4, 4)).eval(), bits=8, group_size=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(self.int4(torch.relu(self.dynamic(self.static(x)))))


@pytest.mark.slow
def test_aoti_graph_converted_dynamic_and_weight_only_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph-converted static, dynamic and weight-only (int4 / int8) Linears in one AOTI program with a dynamic batch:
    the eager outputs bit for bit at batches 5 and 1; no weight check, plan or weight-only module made again after the
    second call."""
    model = _Mixed().eval()
    x = torch.randn(5, 3, 8, 8)
    runner = _aoti(model, x, tmp_path / "mixed.pt2")
    _bit_exact_without_rebuilds(runner, model, x, monkeypatch)
