"""Session 44, saving and loading converted models (the deploy step): every workflow's product through
``state_dict`` -> ``torch.save`` -> ``torch.load(weights_only=True)`` -> ``load_state_dict``, whole-model pickles in a
fresh process, and mismatched checkpoints.

A quantized module's codes, scales, zero points and grids mean something only together: a checkpoint holding some of
a module's keys but not all, or a float model's ``weight`` where the module holds codes, is refused naming the keys,
with ``strict=False`` too (``state_check.key_errors``); a strict load whose quantized modules miss keys raises before
anything loads (torch reports missing keys after it has loaded every other module).
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit as Q


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = Q.QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 5)
        self.dequant = Q.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.relu(self.conv(self.quant(x))), 1)
        return self.dequant(self.fc2(self.relu(self.fc(x))))


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8)).eval()


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net().eval()


def _data(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(4, 3, 6, 6, generator=g) * (1 + seed) for _ in range(2)]


X = torch.randn(3, 3, 6, 6, generator=torch.Generator().manual_seed(7))
XM = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))


def _static(seed: int) -> nn.Module:
    m = _net(seed)
    m.qconfig = Q.get_default_qconfig()
    p = Q.prepare(m)
    for x in _data(seed):
        p(x)
    return Q.convert(p)


def _fx(seed: int) -> nn.Module:
    p = Q.prepare_fx(_net(seed), Q.get_default_qconfig_mapping(), (X,))
    for x in _data(seed):
        p(x)
    return Q.convert_fx(p)


def _qat(seed: int) -> nn.Module:
    m = _net(seed).train()
    m.qconfig = Q.get_default_qat_qconfig()
    p = Q.prepare_qat(m)
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    for x in _data(seed):
        p(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return Q.convert(p.eval())


def _ptq(recipe: str):
    def build(seed: int) -> nn.Module:
        kw = {"iters": 4, "batch_size": 2} if recipe == "accurate" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q, _ = Q.quantize_ptq(_net(seed), _data(seed), recipe=recipe, progress=False, **kw)
        return q
    return build


KINDS = {
    "static": (_static, X), "fx": (_fx, X), "qat": (_qat, X),
    "dynamic": (lambda s: Q.quantize_dynamic(_mlp(s)), XM),
    "weight_only8": (lambda s: Q.quantize_weight_only(_mlp(s), bits=8, group_size=-1, skip=()), XM),
    "weight_only4": (lambda s: Q.quantize_weight_only(_mlp(s), bits=4, group_size=8, skip=()), XM),
    "ptq_default": (_ptq("default"), X), "ptq_balanced": (_ptq("balanced"), X), "ptq_accurate": (_ptq("accurate"), X),
}
FLOAT = {"static": _net, "fx": _net, "dynamic": _mlp, "weight_only8": _mlp, "weight_only4": _mlp}


def _rt(obj: object) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the round trips every workflow's product makes ----
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_state_dict_loads_into_a_model_built_by_the_same_workflow_bit_for_bit(kind):
    """The target is built by the same workflow on another float model and other calibration data (one batch of any
    data is what a deploy script needs: ``convert`` refuses an uncalibrated model, naming this way)."""
    build, x = KINDS[kind]
    src, dst = build(0), build(1)
    with torch.no_grad():
        ref = src(x)
        if kind not in ("dynamic",):  # (a dynamic model's float weights differ too, so do its outputs)
            assert not torch.equal(dst(x), ref)
        dst.load_state_dict(_rt(src.state_dict()))
        assert torch.equal(dst(x), ref)
        for route in (copy.deepcopy(dst), copy.deepcopy(dst).cpu()):
            assert torch.equal(route(x), ref)


def test_whole_model_pickles_load_in_a_fresh_process_and_weights_only_refuses_them(tmp_path):
    """``torch.save(qmodel)``: ``torch.load(weights_only=False)`` in a new process gives the same outputs bit for bit;
    ``weights_only=True`` refuses a pickled model (torch's rule for every ``nn.Module``: its pickle names classes and,
    for graph models, code) with torch's ``UnpicklingError``; a state_dict is the checkpoint that loads safely."""
    kinds = ["static", "fx", "qat", "dynamic", "weight_only4", "ptq_accurate"]
    # built and run in a fresh process too: this test process's earlier tests may have changed process-wide state
    # (a CI run once saw weight_only4 differ from a fresh process there, not in a process of its own)
    build = f"""
import sys, torch, warnings
sys.path.insert(0, {str(Path(__file__).parent)!r})
warnings.simplefilter("ignore")
from test_state_s44 import KINDS
for k in {kinds!r}:
    make, x = KINDS[k]
    q = make(0)
    with torch.no_grad():
        torch.save({{"x": x, "ref": q(x)}}, {str(tmp_path)!r} + f"/{{k}}.io")
    torch.save(q, {str(tmp_path)!r} + f"/{{k}}.pt")
"""
    made = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    code = f"""
import pickle, sys, torch, warnings
sys.path.insert(0, {str(Path(__file__).parent)!r})  # (the models' classes are this file's, as the builder's were)
import lowbit  # noqa: F401
warnings.simplefilter("ignore")
for k in {kinds!r}:
    io = torch.load({str(tmp_path)!r} + f"/{{k}}.io", weights_only=True)
    m = torch.load({str(tmp_path)!r} + f"/{{k}}.pt", weights_only=False)
    with torch.no_grad():
        print(k, "equal" if torch.equal(m(io["x"]), io["ref"]) else "DIFFERENT")
    try:
        torch.load({str(tmp_path)!r} + f"/{{k}}.pt")
        print(k, "weights_only loaded")
    except pickle.UnpicklingError:
        print(k, "weights_only refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for k in kinds:
        assert f"{k} equal" in out.stdout and f"{k} weights_only refused" in out.stdout, out.stdout


@pytest.mark.parametrize("convert", ["eager", "fx"])
def test_convert_without_calibration_names_the_way_to_build_a_load_target(convert):
    """torch.ao's docs build the model a checkpoint loads into by prepare + convert with no calibration; lowbit
    refuses an uncalibrated convert (a silent scale-1 model otherwise) and now says what to do instead."""
    m = _net(0)
    if convert == "eager":
        m.qconfig = Q.get_default_qconfig()
        with pytest.raises(RuntimeError, match=r"saw no data.*one batch of any data of the input's shape is enough"):
            Q.convert(Q.prepare(m))
    else:
        with pytest.raises(RuntimeError, match=r"saw no data.*one batch of any data of the input's shape is enough"):
            Q.convert_fx(Q.prepare_fx(m, Q.get_default_qconfig_mapping(), (X,)))


# ---- a float model's checkpoint into a converted model ----
@pytest.mark.parametrize("kind", list(FLOAT))
@pytest.mark.parametrize("strict", [True, False])
def test_a_float_checkpoint_is_refused_naming_the_float_weight_and_nothing_loads(kind, strict):
    """Before: ``strict=False`` loaded the float model's biases next to the int8 codes and returned (outputs changed,
    no error); ``strict=True`` raised torch's missing-keys error after loading them (the model was left changed)."""
    build, x = KINDS[kind]
    q = build(1)
    before = _snapshot(q)
    with torch.no_grad():
        y0 = q(x)
    sd = _rt(FLOAT[kind](0).state_dict())
    with pytest.raises(ValueError, match=r"(fc|0)[.]weight: a float weight of shape \(\d+, \d+\) where this "
                                         r"quantized (Linear|WeightOnlyLinear) holds (fc|0)[.]"
                                         r".*the checkpoint of a float model") as err:
        q.load_state_dict(sd, strict=strict)
    assert isinstance(err.value, RuntimeError)
    assert _same(_snapshot(q), before)
    with torch.no_grad():
        assert torch.equal(q(x), y0)


# ---- some of a module's keys ----
@pytest.mark.parametrize("kind,key", [("static", "fc.weight_scale"), ("fx", "conv.scale"),
                                      ("dynamic", "2.weight_zero_point"), ("weight_only4", "0.scales"),
                                      ("static", "quant.zero_point")])
def test_a_module_missing_some_of_its_keys_is_refused_with_strict_false(kind, key):
    """Before: ``strict=False`` loaded the module's other tensors (the codes of one model on the grid of another),
    listed the key in ``missing_keys`` and returned; outputs silently wrong (e.g. 'fc.weight_scale': the checkpoint's
    codes read with the old scales)."""
    build, x = KINDS[kind]
    src, q = build(0), build(1)
    before = _snapshot(q)
    sd = _rt(src.state_dict())
    del sd[key]
    module = key.rsplit(".", 1)[0]
    with pytest.raises(ValueError, match=rf"{module.replace('.', '[.]')}: the checkpoint holds .* but not "
                                         rf"{key.replace('.', '[.]')} \(\w+\): a quantized module loads its codes"):
        q.load_state_dict(sd, strict=False)
    assert _same(_snapshot(q), before)


def test_strict_false_still_loads_a_checkpoint_without_a_whole_module():
    """A checkpoint that leaves a whole quantized module out (a new head, say) loads the rest, as torch does."""
    src, q = _static(0), _static(1)
    sd = {k: v for k, v in _rt(src.state_dict()).items() if not k.startswith("fc2.")}
    res = q.load_state_dict(sd, strict=False)
    assert sorted(res.missing_keys) == sorted(k for k in src.state_dict() if k.startswith("fc2."))
    assert torch.equal(q.fc.weight_int8, src.fc.weight_int8) and not torch.equal(q.fc2.weight_int8, src.fc2.weight_int8)


# ---- strict key mismatches load nothing ----
def test_a_graph_mode_checkpoint_into_an_eager_model_loads_nothing():
    """Eager names its input stub 'quant', graph mode 'quantize_1': before, torch loaded every conv / linear of the
    other model, then raised 'Missing key(s)' (the eager model was left with the graph model's layers)."""
    src, q = _fx(0), _static(1)
    before = _snapshot(q)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: 'quant[.]scale', 'quant[.]zero_point' "
                                           r"\(Quantize\)\n\tUnexpected key\(s\) in state_dict: 'quantize_1[.]scale'"):
        q.load_state_dict(_rt(src.state_dict()))
    assert _same(_snapshot(q), before)
    res = q.load_state_dict(_rt(src.state_dict()), strict=False)  # (the layers only: the user asked for it)
    assert res.missing_keys == ["quant.scale", "quant.zero_point"]


def test_an_unexpected_key_of_a_quantized_module_loads_nothing_when_strict():
    src, q = _static(0), _static(1)
    before = _snapshot(q)
    sd = _rt(src.state_dict())
    sd["fc2.weight_scale_inv"] = torch.ones(5)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: 'fc2[.]weight_scale_inv' \(Linear\)"):
        q.load_state_dict(sd)
    assert _same(_snapshot(q), before)
    assert q.load_state_dict(sd, strict=False).unexpected_keys == ["fc2.weight_scale_inv"]
    with torch.no_grad():
        assert torch.equal(q(X), src(X))


def test_a_loaded_deep_copy_and_pickle_keep_all_or_nothing_loading():
    import pickle
    for q in (copy.deepcopy(_static(1)), pickle.loads(pickle.dumps(_static(1)))):
        before = _snapshot(q)
        sd = _rt(_static(0).state_dict())
        del sd["fc2.scale"]
        with pytest.raises(RuntimeError, match=r"fc2: the checkpoint holds .* but not fc2[.]scale"):
            q.load_state_dict(sd)
        assert _same(_snapshot(q), before)


@pytest.mark.parametrize("target,loaded", [("per_tensor_symmetric", "per_channel_symmetric"),
                                           ("per_tensor_symmetric", "per_channel_affine"),
                                           ("per_channel_symmetric", "per_channel_affine")])
def test_a_loaded_weight_grid_of_another_scheme_runs_as_its_source_and_relabels_the_layer(target, loaded):
    """A per-tensor weight grid is stored as (C,) equal rows, so a per-channel checkpoint loads into a per-tensor
    layer (and a symmetric one takes an affine checkpoint) and runs bit for bit as its source; before, the layer kept
    saying ``qscheme=per_tensor_symmetric`` over 4 different channel scales."""
    def build(seed: int, scheme: str) -> nn.Module:
        m = _net(seed)
        obs = Q.MinMaxObserver if scheme.startswith("per_tensor") else Q.PerChannelMinMaxObserver
        m.qconfig = Q.QConfig(activation=Q.MinMaxObserver,
                              weight=obs.with_args(qdtype=Q.qint8, qscheme=getattr(Q, scheme)))
        p = Q.prepare(m)
        for x in _data(seed):
            p(x)
        return Q.convert(p)
    src, q = build(0, loaded), build(1, target)
    assert q.conv.weight_qscheme.value == target and src.conv.weight_qscheme.value == loaded
    q.load_state_dict(_rt(src.state_dict()))
    with torch.no_grad():
        assert torch.equal(q(X), src(X))
    for name in ("conv", "fc", "fc2"):
        assert getattr(q, name).weight_qscheme.value == loaded, name
        assert f"qscheme={loaded}" in repr(getattr(q, name))
