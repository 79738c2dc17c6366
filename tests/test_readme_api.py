"""The README's API lines run as written: every top-level statement of its ```python blocks (parsed from README.md
at collection time, not copied here) runs, in order, in one namespace whose placeholders (``model``,
``calib_batches``, ``x``, ``groups``, ``eval_fn``, ``llm`` ...) a prelude binds to tiny concrete objects. Each
statement is one test (``line<N>``: its README line); where a comment makes a claim that is cheap to check (return
shapes, "report lists what stayed float", "recipe='default': prepare_fx/convert_fx", "dynamic batch", "bit for
bit" ...), a check keyed by a fragment of the statement runs around it. Files go to a temporary directory. Lines
that need the ``onnx`` or ``llm`` extras are skipped with the reason when those are missing. The CLI usage line is
checked against ``lowbit quantize``'s parser."""

from __future__ import annotations

import ast
import copy
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import lowbit as Q

README = Path(__file__).resolve().parents[1] / "README.md"


def _statements() -> list[tuple[int, str, ast.stmt]]:
    """``(README line, source, node)`` of every top-level statement of the README's ```python blocks."""
    text = README.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, m.start(1)) + 1
        block = m.group(1)
        for node in ast.parse(block).body:
            out.append((first + node.lineno - 1, ast.get_source_segment(block, node) or "", node))
    return out


STATEMENTS = _statements()
_LLM_NAMES = {"llm", "hf_causal_lm", "batches"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _needs(node: ast.stmt, src: str) -> tuple[str, str] | None:
    """The optional package a statement needs: (module, reason) or None."""
    if _names(node) & _LLM_NAMES:
        return "transformers", "the README's LLM lines need transformers (the llm extra)"
    if "to_onnx" in src:
        return "onnx", "to_onnx needs onnx (the onnx extra)"
    return None


# ---------------------------------------------------------------- prelude: the placeholders


class Net(nn.Module):
    """conv1 / bn1 / relu1, conv2, fc1 / relu_fc as the README names them; stubs for the eager lines."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = Q.QuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.conv2, self.relu2, self.pool = nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2)
        self.fc1, self.relu_fc, self.fc2 = nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)
        self.dequant = Q.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu2(self.conv2(self.relu1(self.bn1(self.conv1(self.quant(x)))))))
        return self.dequant(self.fc2(self.relu_fc(self.fc1(torch.flatten(x, 1)))))


def _tiny_llm(seed: int, tied: bool) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prelude() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.bn1.running_mean.uniform_(-0.2, 0.2)
        model.bn1.running_var.uniform_(0.5, 1.5)
    model.eval()
    calib_batches = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    x = calib_batches[0].clone()
    with torch.no_grad():
        ref = model(x)

    def eval_fn(m: nn.Module) -> float:  # higher is better: minus the output MSE against the float model
        with torch.no_grad():
            y = m(x)
        return -float((y.dequantize() if hasattr(y, "dequantize") else y).sub(ref).pow(2).mean())

    ns: dict[str, Any] = {
        "model": model, "calib_batches": calib_batches, "calib": calib_batches, "x": x,
        "groups": [["conv1", "bn1", "relu1"], ["fc1", "relu_fc"]], "eval_fn": eval_fn,
        "qconfig_mapping": Q.get_default_qconfig_mapping(),
        "fused_model": Q.fuse_modules(copy.deepcopy(model), [["conv1", "bn1", "relu1"]]),
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ns
    g = torch.Generator().manual_seed(3)
    ns.update(llm=_tiny_llm(1, tied=False), hf_causal_lm=_tiny_llm(2, tied=True),
              batches=[torch.randint(0, 64, (1, 32), generator=g) for _ in range(2)])
    return ns


# ---------------------------------------------------------------- checks of the comments' claims
# Each is a generator keyed by a fragment of exactly one statement: before ``yield`` runs before the statement,
# after it after. A fragment that matches no statement, or several, fails test_every_check_has_its_line.

Check = Callable[[dict[str, Any]], Iterator[None]]
CHECKS: dict[str, Check] = {}


def check(fragment: str) -> Callable[[Check], Check]:
    def deco(fn: Check) -> Check:
        CHECKS[fragment] = fn
        return fn
    return deco


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same_state(m: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


def _float(y: Any) -> torch.Tensor:
    return y.dequantize() if hasattr(y, "dequantize") else y


@check("fused_model = Q.fuse_modules(model.eval()")
def _fuse(ns: dict[str, Any]) -> Iterator[None]:
    before = _state(ns["model"])
    yield
    assert ns["fused_model"] is not ns["model"] and _same_state(ns["model"], before)  # a fused copy
    assert isinstance(ns["fused_model"].bn1, nn.Identity) and isinstance(ns["model"].bn1, nn.BatchNorm2d)


@check("Q.convert(prepared, return_report=True)")
def _convert(ns: dict[str, Any]) -> Iterator[None]:
    yield
    from lowbit.mappings import ConvertReport

    report = ns["report"]
    assert isinstance(report, ConvertReport) and isinstance(ns["qmodel"], nn.Module)
    assert {"conv1", "conv2", "fc1", "fc2"} <= set(report.converted)
    assert "left float" in str(report)  # "report lists what stayed float" ...
    # ... and names a layer that did: the same model with fc2 excluded
    prepared = Q.prepare(ns["fused_model"], Q.QConfigMapping().set_global(Q.get_default_qconfig())
                         .set_module_name("fc2", None).set_module_name("dequant", None))
    for b in ns["calib_batches"]:
        prepared(b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, r2 = Q.convert(prepared, return_report=True)
    assert "conv1" in r2.converted and "fc2" not in r2.converted


@check('Q.quantize_ptq(model, calib_batches, recipe="accurate")')
def _ptq(ns: dict[str, Any]) -> Iterator[None]:
    before = _state(ns["model"])
    yield
    qmodel, report = ns["qmodel"], ns["report"]
    assert isinstance(qmodel, fx.GraphModule) and _same_state(ns["model"], before)  # graph mode, model unchanged
    steps = [s for s, _ in report.steps]
    assert steps[:1] == ["fuse"] and {"calibrate", "round", "correct bias", "convert"} <= set(steps)
    assert steps.index("calibrate") < steps.index("round") < steps.index("correct bias") < steps.index("convert")
    assert "AdaRound alone (500 steps each)" in dict(report.steps)["round"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q_default, r_default = Q.quantize_ptq(ns["model"], ns["calib_batches"], recipe="default", progress=False)
        _, r_bal = Q.quantize_ptq(ns["model"], ns["calib_batches"], recipe="balanced", progress=False)
    assert isinstance(q_default, fx.GraphModule)  # recipe="default": prepare_fx / convert_fx, no rounding step
    assert [s for s, _ in r_default.steps] == ["fuse", "calibrate", "convert"]
    bal = dict(r_bal.steps)  # "balanced": quadratic rounding, no AdaRound, bias correction
    assert "AdaRound alone" not in bal["round"] and "0 by the quadratic search" not in bal["round"]
    assert "correct bias" in bal and "equalize" not in bal


@check("print(report)")
def _print_report(ns: dict[str, Any]) -> Iterator[None]:
    yield
    text = str(ns["report"])  # what each step changed, per layer
    assert all(name in text for name in ("conv1", "conv2", "fc1", "fc2")) and "calibrate" in text


@check("qmodel = Q.convert_fx(prepared)")
def _convert_fx(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["qmodel"], fx.GraphModule)
    torch.manual_seed(0)  # graph mode: no QuantStub needed
    plain = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3)).eval()
    p = Q.prepare_fx(plain, Q.get_default_qconfig_mapping(), example_inputs=(ns["x"],))
    p(ns["x"])
    y = Q.convert_fx(p)(ns["x"])
    assert isinstance(y, torch.Tensor) and y.shape == (4, 3)


@check("Q.prepare_qat(Q.fuse_modules_qat(model.train(), groups))")
def _qat(ns: dict[str, Any]) -> Iterator[None]:
    yield
    qat = ns["qat"]  # train, then Q.convert(qat.eval())
    qat(ns["x"]).sum().backward()
    q = Q.convert(qat.eval())
    assert _float(q(ns["x"])).shape == (4, 3)


@check("Q.get_lsq_qat_qconfig()")
def _lsq(ns: dict[str, Any]) -> Iterator[None]:
    yield
    qat = ns["qat"]
    qat(ns["x"])  # the observers set the first grids, then the README's comment: learned after enable_param_learning
    qat.apply(Q.fake_quant.enable_param_learning)
    qat(ns["x"]).sum().backward()
    learned = [n for n, p in qat.named_parameters() if p.grad is not None and ("scale" in n or "zero_point" in n)]
    assert any("scale" in n for n in learned) and any("zero_point" in n for n in learned)


@check("dyn = Q.quantize_dynamic(model)")
def _dyn(ns: dict[str, Any]) -> Iterator[None]:
    yield
    import lowbit.nn.quantized.dynamic as nnqd

    assert isinstance(ns["dyn"].fc2, nnqd.Linear)
    for float_mod in (nn.LSTM(4, 4), nn.GRU(4, 4), nn.RNNCell(4, 4), nn.LSTMCell(4, 4), nn.GRUCell(4, 4)):
        assert type(Q.quantize_dynamic(nn.Sequential(float_mod))[0]).__module__.startswith("lowbit.")


@check("reduce_range=True")
def _dyn7(ns: dict[str, Any]) -> Iterator[None]:
    yield
    act = Q.get_dynamic_qconfig(reduce_range=True).activation()
    assert act.quant_max - act.quant_min == 127  # 7-bit
    assert _float(ns["dyn7"](ns["x"])).shape == (4, 3)


@check('backend="x86"')
def _dyn_ao(ns: dict[str, Any]) -> Iterator[None]:
    yield
    import torch.ao.quantization as tq

    if "x86" not in torch.backends.quantized.supported_engines:
        return
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ao = tq.quantize_dynamic(nn.Sequential(copy.deepcopy(ns["model"].fc1)).eval(), {nn.Linear})
        h = torch.randn(5, 16)
        assert torch.equal(ns["dyn_ao"].fc1(h), ao(h))  # torch.ao's x86 dynamic Linear, bit for bit
    finally:
        torch.backends.quantized.engine = engine


@check("mix = Q.QConfigMapping()")
def _mix(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["mix"], Q.QConfigMapping)  # graph mode takes the mixed static/dynamic mapping
    p = Q.prepare_fx(copy.deepcopy(ns["model"]).eval(), ns["mix"], example_inputs=(ns["x"],))
    p(ns["x"])
    assert Q.convert_fx(p)(ns["x"]).shape == (4, 3)


def _runs(lm: nn.Module, ns: dict[str, Any]) -> None:
    with torch.no_grad():
        logits = lm(ns["batches"][0]).logits
    assert logits.shape == (1, 32, 64) and bool(torch.isfinite(logits).all())


@check("Q.quantize_weight_only(llm")
def _weight_only(ns: dict[str, Any]) -> Iterator[None]:
    from lowbit.nn.quantized.weight_only import WeightOnlyLinear

    yield
    llm = ns["llm"]
    wol = [m for m in llm.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(wol) == 14 and all(m.bits == 4 and m.group_size == 128 for m in wol)  # 7 Linears a block, head float
    assert isinstance(llm.lm_head, nn.Linear)
    _runs(llm, ns)


@check("Q.quantize_llm(hf_causal_lm, batches)")
def _llm(ns: dict[str, Any]) -> Iterator[None]:
    yield
    llm = ns["llm"]
    assert isinstance(llm, nn.Module) and llm is not ns["hf_causal_lm"]
    assert type(ns["hf_causal_lm"].lm_head) is nn.Linear  # the caller's model is not changed
    kinds = {type(m).__name__ for m in llm.modules()}
    assert "TiedEmbedding" in kinds  # tied int8 head
    _runs(llm, ns)


@check("Q.quantize_w8a8(hf_causal_lm, batches)")
def _w8a8(ns: dict[str, Any]) -> Iterator[None]:
    yield
    w8a8 = ns["w8a8"]
    assert isinstance(w8a8, nn.Module)
    assert not any(type(m) is nn.Linear for m in w8a8.model.layers.modules())
    _runs(w8a8, ns)


@check('to_onnx(qmodel, (x,), "model.onnx")')
def _onnx(ns: dict[str, Any]) -> Iterator[None]:
    yield
    import onnx

    m = onnx.load("model.onnx")  # QDQ, opset 17, dynamic batch
    assert {o.version for o in m.opset_import if o.domain in ("", "ai.onnx")} == {17}
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in m.graph.node}
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    try:
        import onnxruntime as ort
    except ImportError:
        return
    sess = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {sess.get_inputs()[0].name: torch.randn(3, 1, 8, 8).numpy()})
    assert out.shape == (3, 3)


@check("print(compare(model, qmodel, x))")
def _compare(ns: dict[str, Any]) -> Iterator[None]:
    before = _state(ns["model"])
    yield
    from lowbit.debug import compare

    text = str(compare(ns["model"], ns["qmodel"], ns["x"]))  # per-layer SQNR, max error
    assert "SQNR" in text and "max abs err" in text and "fc1" in text and _same_state(ns["model"], before)


@check("sensitivity(model, qconfig_mapping, calib, eval_fn, tolerance=0.5)")
def _sensitivity(ns: dict[str, Any]) -> Iterator[None]:
    yield
    mapping, table = ns["mapping"], ns["table"]
    assert isinstance(mapping, Q.QConfigMapping)
    assert [r.drop for r in table.rows] == sorted((r.drop for r in table.rows), reverse=True)  # worst first
    assert table.met_tolerance and set(table.float_layers) <= {r.name for r in table.rows}
    # the same call on fresh copies of calib: the earlier lines' prepared(x) must not have changed the batches
    from lowbit.debug import sensitivity

    _, fresh = sensitivity(ns["model"], ns["qconfig_mapping"], [b.clone() for b in ns["calib"]], ns["eval_fn"],
                           tolerance=0.5)
    assert [(r.name, r.metric) for r in fresh.rows] == [(r.name, r.metric) for r in table.rows]


@check('Q.get_calibration_qconfig(activation="entropy", weight="mse")')
def _calib_qconfig(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["qc"], Q.QConfig)


@check("Q.best_of_ranges(model, calib)")
def _best_of(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["mapping"], Q.QConfigMapping) and ns["choices"]


@check("Q.smooth_quant(model, calib, alpha=0.5)")
def _smooth(ns: dict[str, Any]) -> Iterator[None]:
    before = _state(ns["model"])
    yield
    assert isinstance(ns["smoothed"], nn.Module) and ns["smoothed"] is not ns["model"]
    assert _same_state(ns["model"], before)


@check("Q.fuse_dequantize(qmodel)")
def _fuse_dq(ns: dict[str, Any]) -> Iterator[None]:
    with torch.no_grad():
        y0 = ns["qmodel"](ns["x"])
    yield
    from lowbit.nn.quantized.linear_float_out import LinearFloatOut

    names = [n for n, m in ns["qmodel"].named_modules() if isinstance(m, LinearFloatOut)]
    assert names == ["fc2"]  # the int8 Linear read only by the dequantize returns float
    with torch.no_grad():
        assert (ns["qmodel"](ns["x"]) - y0).abs().max() < 0.05


@check("max_float_layers=3")
def _amp(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["mapping"], Q.QConfigMapping) and len(ns["table"].float_layers) <= 3


@check('search="fast"')
def _amp_fast(ns: dict[str, Any]) -> Iterator[None]:
    yield
    assert isinstance(ns["mapping"], Q.QConfigMapping) and ns["table"].view == "float"


@check('Q.equalize(fused_model, [["conv1", "conv2"]])')
def _equalize(ns: dict[str, Any]) -> Iterator[None]:
    fm = ns["fused_model"]
    w0 = fm.conv2.weight.detach().clone()
    with torch.no_grad():
        y0 = fm(ns["x"])
    yield
    with torch.no_grad():
        y1 = fm(ns["x"])
    assert not torch.equal(fm.conv2.weight, w0) and torch.allclose(y1, y0, atol=1e-5)  # in place, same function


@check("print(layer_sensitivity(model, qc, calib")
def _layer_sens(ns: dict[str, Any]) -> Iterator[None]:
    yield
    from lowbit.debug import layer_sensitivity

    rows = layer_sensitivity(ns["model"], ns["qc"], ns["calib"], mode="fx").rows
    assert [r.drop for r in rows] == sorted((r.drop for r in rows), reverse=True)  # worst first


@check("torch.export.export(qmodel, (x,)")
def _export(ns: dict[str, Any]) -> Iterator[None]:
    yield
    x2 = torch.randn(7, 1, 8, 8)  # dynamic batch
    with torch.no_grad():
        assert torch.equal(ns["ep"].module()(x2), ns["qmodel"](x2))


@check('torch.export.save(ep, "qmodel.pt2")')
def _save(ns: dict[str, Any]) -> Iterator[None]:
    yield
    loaded = torch.export.load("qmodel.pt2").module()  # later: torch.export.load("qmodel.pt2").module()
    with torch.no_grad():
        assert torch.equal(loaded(ns["x"]), ns["qmodel"](ns["x"]))


# ---------------------------------------------------------------- the run


def _checks_for(src: str) -> list[Check]:
    return [fn for frag, fn in CHECKS.items() if frag in src]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, str]]:
    """Runs every statement once, in order; ``{README line: (outcome, detail)}``, outcome ``ok``, ``skip``, ``fail``."""
    import importlib.util

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict[int, tuple[str, str]] = {}
    try:
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
            mp.chdir(tmp_path_factory.mktemp("readme"))
            mp.setenv("TQDM_DISABLE", "1")
            warnings.simplefilter("ignore")
            ns = _prelude()
            for line, src, node in STATEMENTS:
                need = _needs(node, src)
                if need is not None and importlib.util.find_spec(need[0]) is None:
                    results[line] = ("skip", need[1])
                    continue
                gens = [fn(ns) for fn in _checks_for(src)]
                try:
                    for g in gens:
                        next(g)
                    exec(compile(ast.Module(body=[node], type_ignores=[]), f"README.md:{line}", "exec"), ns)
                    for g in gens:
                        next(g, None)
                    results[line] = ("ok", "")
                except Exception:
                    results[line] = ("fail", f"README.md line {line}:\n{src}\n\n{traceback.format_exc()}")
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("line", [line for line, _, _ in STATEMENTS], ids=[f"line{line}" for line, _, _ in STATEMENTS])
def test_readme_line_runs(readme_run: dict[int, tuple[str, str]], line: int) -> None:
    outcome, detail = readme_run[line]
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome == "ok", detail


def test_readme_has_the_blocks_this_file_expects():
    srcs = [src for _, src, _ in STATEMENTS]
    assert len(srcs) >= 35 and any("Q.quantize_ptq" in s for s in srcs) and any("torch.export.save" in s for s in srcs)


def test_every_check_has_its_line():
    for frag in CHECKS:
        hits = [line for line, src, _ in STATEMENTS if frag in src]
        assert len(hits) == 1, f"check {frag!r} matches README lines {hits} (expected exactly one)"


# ---------------------------------------------------------------- the CLI usage line


def _cli_line(command: str) -> str:
    """The usage line: ``lowbit quantize`` in the prose, ``lowbit quantize-llm`` in the python block's comment."""
    text = README.read_text(encoding="utf-8")
    if command == "quantize":
        i = text.index("`lowbit quantize ")
        return text[i + 1:text.index("`", i + 1)]
    m = re.search(r"# CLI: (lowbit quantize-llm [^\n]*?) ->", text)
    assert m, "README's python block has no '# CLI: lowbit quantize-llm ... ->' comment"
    return m.group(1)


def _subparser(name: str) -> Any:
    import argparse

    from lowbit.cli.command import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["quantize", "quantize-llm"])
def test_readme_cli_flags_exist(command: str) -> None:
    line = _cli_line(command)
    parser = _subparser(command)
    flags = {s: a for a in parser._actions for s in a.option_strings}
    named = re.findall(r"(--[a-z][a-z-]*)(?: ([A-Za-z0-9_.|/-]+))?", line)
    assert named, line
    for flag, value in named:
        assert flag in flags, f"README's {command} line names {flag}, which `lowbit {command} --help` lacks"
        choices = flags[flag].choices
        if choices is not None and value and "|" in value:
            missing = set(value.split("|")) - set(choices)
            assert not missing, f"{flag} {value}: {sorted(missing)} not among {list(choices)}"
    if command == "quantize" and "qat" in dict(named).get("--method", ""):
        assert "--calib-labels" in line, "--method qat needs --calib-labels (cli.command), which the line omits"
    # the flags parse together as the line shows them (one choice of each)
    if command == "quantize":
        argv = ["--model", "pkg.module:factory"]
        for flag, value in named:
            if flag != "--model":
                argv += [flag, value.split("|")[0]] if value else [flag]
        parser.parse_args(argv)
