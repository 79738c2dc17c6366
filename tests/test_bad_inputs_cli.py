"""Property-based bad inputs at the CLI's, the distributed helpers' and weight-only's entry points:
every draw ends in a documented safe result or a clear error naming the value — never garbage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit as Q
from lowbit.cli import CLIError
from lowbit.cli.inputs import check_data, check_labels
from lowbit.cli.output import MARKER, OutputFolder, strict_json

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | FLOATS | st.text(max_size=5),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                       max_leaves=12)


def _finite_only(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite_only(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite_only(v) for v in o]
    return o


@settings(max_examples=30, deadline=None)
@given(JSONISH)
def test_report_json_is_always_strict(obj):
    def reject(token):
        raise ValueError(token)
    assert json.loads(strict_json(obj), parse_constant=reject) == _finite_only(obj)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(FLOATS, min_size=0, max_size=24), cols=st.sampled_from([1, 2, 3]))
def test_calibration_data_is_finite_or_a_clear_error(values, cols):
    n = len(values) // cols
    x = torch.tensor(values[: n * cols], dtype=torch.float32).reshape(n, cols)
    try:
        out = check_data(x, "--calib d.pt")
    except CLIError as e:
        assert str(e).startswith("--calib d.pt: ") and ("NaN or Inf" in str(e) or "holds no samples" in str(e))
        assert n == 0 or not bool(torch.isfinite(x).all())
    else:
        assert n > 0 and bool(torch.isfinite(out).all()) and torch.equal(out, x)


@settings(max_examples=40, deadline=None)
@given(labels=st.lists(st.integers(-3, 6), min_size=1, max_size=12), two_d=st.booleans(), as_float=st.booleans())
def test_labels_are_valid_class_indices_or_a_clear_error(labels, two_d, as_float):
    y = torch.tensor(labels, dtype=torch.float32 if as_float else torch.int64)
    y = y.reshape(-1, 1) if two_d else y
    try:
        out = check_labels(y, "--labels y.pt", n=len(labels), classes=4)
    except CLIError as e:
        assert str(e).startswith("--labels y.pt: ")
        assert two_d or min(labels) < 0 or max(labels) >= 4
    else:
        assert not two_d and out.dtype == torch.int64 and out.tolist() == labels


@settings(max_examples=25, deadline=None)
@given(names=st.lists(st.sampled_from(["model_ptq.pt", "report.json", "report_sqnr.png", "notes.txt", "data.pt",
                                       "report.md", MARKER, "x.py"]), max_size=5, unique=True))
def test_out_folder_never_loses_foreign_files(tmp_path_factory, names):
    out = tmp_path_factory.mktemp("out") / "o"
    out.mkdir()
    for n in names:
        (out / n).write_text(n)
    ours = all(n in ("model_ptq.pt", "report.json", "report_sqnr.png", "report.md", MARKER) for n in names)
    try:
        with OutputFolder(out) as folder:
            (folder.staging / "report.md").write_text("new")
            folder.commit()
    except CLIError as e:
        assert not ours and MARKER not in names and "lowbit did not write" in str(e)
        assert sorted(p.name for p in out.iterdir()) == sorted(names)         # untouched
    else:
        assert ours or MARKER in names
        assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "report.md"])
    assert not [p for p in Path(out.parent).iterdir() if p.name.startswith(".lowbit-")]


@settings(max_examples=20, deadline=None)
@given(row=st.integers(0, 7), col=st.integers(0, 15), bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       layer=st.sampled_from([0, 2]))
def test_weight_only_names_the_non_finite_layer(row, col, bad, layer):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        m[layer].weight[row % m[layer].out_features, col % m[layer].in_features] = bad
    with pytest.raises(ValueError, match=f"layer '{layer}' has 1 NaN/Inf weight values"):
        Q.quantize_weight_only(m, bits=4, group_size=8, method="rtn")


def test_distributed_helpers_reject_non_modules():
    for bad in (None, {}, [nn.Linear(2, 2)]):
        with pytest.raises(TypeError, match="sync_observers: model must be an nn.Module"):
            Q.sync_observers(bad)


def test_16bit_images_keep_their_range(tmp_path):
    np = pytest.importorskip("numpy")
    Image = pytest.importorskip("PIL.Image")
    from lowbit.cli.inputs import _load_images

    a = (np.arange(16).reshape(4, 4) * 4000).astype(np.uint16)  # up to 60000
    for name in ("a.png", "b.png"):
        Image.fromarray(a).save(tmp_path / name)
    x = _load_images(tmp_path, "--calib")
    assert x.shape == (2, 1, 4, 4)  # were clipped to 1.0 above pixel 255 (convert("L"))
    assert torch.allclose(x[0, 0], torch.from_numpy(a.astype("float32")) / 65535.0)
