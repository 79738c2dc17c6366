"""Generate ``docs/torch_ao_names.md``: every public torch.ao quantization name and lowbit's equivalent.

The names come from the installed torch (``torch.ao.quantization.__all__``, the public functions of
``torch.ao.quantization.quantize_fx`` and the ``torch.ao.nn.*`` families), so nothing is missed; each
must have an entry in ``EQUIV`` — a lowbit dotted name (importable: ``tests/test_torch_ao_names.py``
imports every one) with a note, or ``None`` with the reason lowbit has none. Run::

    PYTHONPATH=src python tools/torch_ao_names.py          # rewrites docs/torch_ao_names.md
    PYTHONPATH=src python tools/torch_ao_names.py --check  # exit 1 if the file is stale
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import warnings
from pathlib import Path

FAMILIES = ["quantized", "quantized.dynamic", "qat", "qat.dynamic", "intrinsic", "intrinsic.qat",
            "intrinsic.quantized", "intrinsic.quantized.dynamic", "quantized.reference", "sparse"]
OUT = Path(__file__).resolve().parents[1] / "docs" / "torch_ao_names.md"

TS = ("TorchScript: lowbit deploys through ONNX (`lowbit.export.to_onnx`) and `torch.export` "
      "(docs/design.md)")
SPARSE = "lowbit has no sparse kernels"
ALIAS = "a typing alias"
REF_RNN = ("no reference recurrent layers: lowbit quantizes RNNs dynamically only "
           "(`lowbit.nn.quantized.dynamic`)")
ONEDNN_FUSION = ("oneDNN-only fusion; add it with `register_fusion_pattern` (pattern, fuser, quantized class)")


def _q(name: str) -> str:
    return f"torch.ao.quantization.{name}"


# torch.ao name -> (lowbit dotted name or None, note / reason)
EQUIV: dict[str, tuple[str | None, str]] = {
    # -- classes --
    _q("DeQuantStub"): ("lowbit.DeQuantStub", ""),
    _q("QuantStub"): ("lowbit.QuantStub", ""),
    _q("QuantWrapper"): ("lowbit.QuantWrapper", ""),
    _q("FakeQuantize"): ("lowbit.FakeQuantize", ""),
    _q("FakeQuantizeBase"): ("lowbit.FakeQuantize", "the base class of lowbit's fake-quant modules"),
    _q("FixedQParamsFakeQuantize"): ("lowbit.FixedQParamsFakeQuantize", ""),
    _q("FusedMovingAvgObsFakeQuantize"): ("lowbit.FusedMovingAvgObsFakeQuantize", ""),
    _q("FixedQParamsObserver"): ("lowbit.FixedQParamsObserver", ""),
    _q("HistogramObserver"): ("lowbit.HistogramObserver", ""),
    _q("MinMaxObserver"): ("lowbit.MinMaxObserver", ""),
    _q("MovingAverageMinMaxObserver"): ("lowbit.MovingAverageMinMaxObserver", ""),
    _q("MovingAveragePerChannelMinMaxObserver"): ("lowbit.MovingAveragePerChannelMinMaxObserver", ""),
    _q("PerChannelMinMaxObserver"): ("lowbit.PerChannelMinMaxObserver", ""),
    _q("NoopObserver"): ("lowbit.NoopObserver", ""),
    _q("PlaceholderObserver"): ("lowbit.PlaceholderObserver", ""),
    _q("RecordingObserver"): ("lowbit.RecordingObserver", ""),
    _q("ObserverBase"): ("lowbit.ObserverBase", ""),
    _q("UniformQuantizationObserverBase"): ("lowbit.ObserverBase", "lowbit has one observer base class"),
    _q("AffineQuantizedObserverBase"): ("lowbit.ObserverBase", "lowbit has one observer base class"),
    _q("ReuseInputObserver"): (None, "graph mode gives grid-preserving ops (view, max-pool, relu, ...) their "
                                     "input's grid by op class (`lowbit.fx.patterns`), no observer needed"),
    _q("QConfig"): ("lowbit.QConfig", ""),
    _q("QConfigDynamic"): ("lowbit.QConfig", "torch.ao's deprecated alias; `get_dynamic_qconfig()`"),
    _q("QConfigMapping"): ("lowbit.QConfigMapping", ""),
    _q("QConfigAny"): (None, ALIAS + "; lowbit annotates `QConfig | None`"),
    _q("ObserverOrFakeQuantize"): (None, ALIAS + "; lowbit annotates `ObserverBase | FakeQuantize`"),
    _q("Pattern"): (None, ALIAS + " of torch.ao's fx patterns; lowbit's patterns are tuples of module types "
                          "(`lowbit.fusion_registry`)"),
    _q("MatchAllNode"): (None, "a wildcard of torch.ao's fx pattern matcher; lowbit patterns match exact "
                               "module types (`lowbit.fusion_registry`)"),
    _q("QuantType"): (None, "an enum; lowbit's custom-config setters take `quant_type` as 'static'/'qat' "
                            "or any enum with that `.name`"),
    # torchao's affine-quantization primitives re-exported by torch.ao.quantization
    _q("Granularity"): ("lowbit.QScheme", "per-tensor / per-channel schemes"),
    _q("PerTensor"): ("lowbit.per_tensor_affine", ""),
    _q("PerAxis"): ("lowbit.per_channel_affine", "per-channel along `ch_axis`"),
    _q("PerGroup"): ("lowbit.quantize_weight_only", "group-wise weights: `group_size=`"),
    _q("PerRow"): ("lowbit.per_channel_symmetric", "per output row (axis 0) weights"),
    _q("PerToken"): ("lowbit.nn.quantized.dynamic.quantize_per_token", "per-token activations"),
    _q("PerBlock"): (None, "2-D block-wise grids are not supported (group-wise rows are: `quantize_weight_only`)"),
    _q("MappingType"): ("lowbit.QScheme", "symmetric / affine"),
    _q("ZeroPointDomain"): ("lowbit.per_channel_affine_float_qparams", "float zero points; integer ones are "
                                                                       "every other scheme"),
    _q("TorchAODType"): ("lowbit.QDtype", "`qint4`, `quint4`, `qint8`, ... (`QDtype.with_range`)"),
    _q("get_block_size"): (None, "block sizes belong to torchao's affine tensors; lowbit grids are per "
                                 "tensor, channel, token or group"),
    # -- workflows --
    _q("prepare"): ("lowbit.prepare", "`observer_non_leaf_module_list`, `prepare_custom_config_dict` as torch.ao"),
    _q("prepare_qat"): ("lowbit.prepare_qat", "`mapping` as torch.ao"),
    _q("convert"): ("lowbit.convert", "`mapping`, `convert_custom_config_dict`, `is_reference` as torch.ao; "
                   "`remove_qconfig`, `use_precomputed_fake_quant` as keywords"),
    _q("quantize"): ("lowbit.quantize_api.quantize", "`lowbit.quantize` is the tensor function"),
    _q("quantize_qat"): ("lowbit.quantize_qat", ""),
    _q("quantize_dynamic"): ("lowbit.quantize_dynamic", ""),
    _q("propagate_qconfig_"): ("lowbit.propagate_qconfig_", ""),
    _q("qconfig_equals"): ("lowbit.qconfig_equals", ""),
    _q("add_quant_dequant"): ("lowbit.QuantWrapper", "wrap modules with `QuantWrapper`, or use graph mode "
                                                     "(no stubs)"),
    _q("swap_module"): (None, "`mapping[type(mod)].from_float(mod)` is the swap; `convert` does it"),
    _q("fuse_modules"): ("lowbit.fuse_modules", ""),
    _q("fuse_modules_qat"): ("lowbit.fuse_modules_qat", ""),
    _q("fuse_conv_bn"): ("lowbit.fuse.fuse_known_modules", "`fuse_known_modules([conv, bn], is_qat)`"),
    _q("fuse_conv_bn_relu"): ("lowbit.fuse.fuse_known_modules", "`fuse_known_modules([conv, bn, relu], is_qat)`"),
    _q("fuse_convtranspose_bn"): ("lowbit.fuse.fuse_known_modules", "inference only"),
    _q("fuse_linear_bn"): ("lowbit.fuse.fuse_known_modules", ""),
    _q("get_fuser_method"): ("lowbit.fusion_registry.find_fusion_pattern", "user patterns; built-ins in "
                                                                           "`fuse_known_modules`"),
    _q("get_fuser_method_new"): ("lowbit.fusion_registry.find_fusion_pattern", ""),
    _q("enable_observer"): ("lowbit.enable_observer", ""),
    _q("disable_observer"): ("lowbit.disable_observer", ""),
    _q("enable_fake_quant"): ("lowbit.enable_fake_quant", ""),
    _q("disable_fake_quant"): ("lowbit.disable_fake_quant", ""),
    _q("get_observer_state_dict"): ("lowbit.get_observer_state_dict", ""),
    _q("load_observer_state_dict"): ("lowbit.load_observer_state_dict", ""),
    _q("default_eval_fn"): (None, "a test helper (runs `(data, target)` pairs); calibrate with a loop or "
                                  "`quantize_api.quantize(model, run_fn, run_args)`"),
    _q("get_combined_dict"): (None, "a dict-merging helper: `{**a, **b}`"),
    # -- TorchScript --
    **{_q(n): ("lowbit.export.to_onnx", TS) for n in (
        "convert_jit", "convert_dynamic_jit", "prepare_jit", "prepare_dynamic_jit", "quantize_jit",
        "quantize_dynamic_jit", "script_qconfig", "script_qconfig_dict", "fuse_conv_bn_jit")},
    # -- mappings --
    _q("get_default_static_quant_module_mappings"): ("lowbit.get_default_static_quant_module_mappings", ""),
    _q("get_default_qat_module_mappings"): ("lowbit.get_default_qat_module_mappings", ""),
    _q("get_default_dynamic_quant_module_mappings"): ("lowbit.get_default_dynamic_quant_module_mappings", ""),
    _q("get_default_qconfig_propagation_list"): ("lowbit.get_default_static_quant_module_mappings",
                                                 "its keys are the observed types"),
    _q("get_static_quant_module_class"): ("lowbit.get_default_static_quant_module_mappings", "`[type]`"),
    _q("get_dynamic_quant_module_class"): ("lowbit.get_default_dynamic_quant_module_mappings", "`[type]`"),
    _q("get_embedding_static_quant_module_mappings"): ("lowbit.get_default_static_quant_module_mappings",
                                                       "embeddings are in the default table"),
    _q("get_embedding_qat_module_mappings"): ("lowbit.get_default_qat_module_mappings",
                                              "QAT embeddings are in the default table"),
    _q("get_default_static_quant_reference_module_mappings"): ("lowbit.reference.REFERENCE_MODULES",
                                                               "float type -> reference class (a dict)"),
    _q("get_default_float_to_quantized_operator_mappings"): ("lowbit.fx.patterns.FUNC_ACTIVATIONS",
                                                             "functional op -> quantized module"),
    _q("get_quantized_operator"): ("lowbit.fx.patterns.func_activation", ""),
    _q("get_default_compare_output_module_list"): ("lowbit.debug.compare", "layer-by-layer float vs int8"),
    _q("get_default_custom_config_dict"): ("lowbit.PrepareCustomConfig",
                                           "empty by default: dynamic LSTMs come from the dynamic mapping"),
    _q("no_observer_set"): (None, "DeQuantStub and embeddings get no output observer (`lowbit.workflow` "
                                  "docstring); not a public table"),
    _q("get_default_dynamic_sparse_quant_module_mappings"): (None, SPARSE),
    _q("get_default_static_sparse_quant_module_mappings"): (None, SPARSE),
    # -- qconfig getters --
    _q("get_default_qconfig"): ("lowbit.get_default_qconfig",
                                "same signature; no backend: lowbit's 8-bit recipe (torch.ao: x86)"),
    _q("get_default_qat_qconfig"): ("lowbit.get_default_qat_qconfig",
                                    "same signature; no backend: lowbit's 8-bit recipe (torch.ao: x86)"),
    _q("get_default_qconfig_mapping"): ("lowbit.get_default_qconfig_mapping", ""),
    _q("get_default_qat_qconfig_mapping"): ("lowbit.get_default_qat_qconfig_mapping", ""),
    _q("get_default_qconfig_dict"): ("lowbit.get_default_qconfig_mapping", "qconfig dicts are accepted too"),
    _q("get_default_qat_qconfig_dict"): ("lowbit.get_default_qat_qconfig_mapping", ""),
    # -- default observer / fake-quant instances --
    _q("default_observer"): ("lowbit.MinMaxObserver", "quint8"),
    _q("default_weight_observer"): ("lowbit.MinMaxObserver", "`qscheme=per_tensor_symmetric, qdtype=qint8`"),
    _q("default_per_channel_weight_observer"): ("lowbit.PerChannelMinMaxObserver", "its default"),
    _q("weight_observer_range_neg_127_to_127"): ("lowbit.MinMaxObserver",
                                                 "`qdtype=qint8.with_range(-127, 127)`, symmetric"),
    _q("per_channel_weight_observer_range_neg_127_to_127"): ("lowbit.PerChannelMinMaxObserver",
                                                             "`qdtype=qint8.with_range(-127, 127)`"),
    _q("default_histogram_observer"): ("lowbit.HistogramObserver", ""),
    _q("default_placeholder_observer"): ("lowbit.PlaceholderObserver", ""),
    _q("default_debug_observer"): ("lowbit.RecordingObserver", ""),
    _q("default_dynamic_quant_observer"): ("lowbit.get_dynamic_qconfig", "its activation "
                                                                         "(`PlaceholderObserver(is_dynamic=True)`: "
                                                                         "per token); torch.ao's one 7-bit grid per "
                                                                         "tensor: `backend=\"x86\"`"),
    _q("default_reuse_input_observer"): (None, "see ReuseInputObserver"),
    _q("default_float_qparams_observer"): ("lowbit.get_embedding_qconfig", "`float_qparams=True`"),
    _q("default_float_qparams_observer_4bit"): ("lowbit.get_embedding_qconfig", "`bits=4, float_qparams=True`"),
    _q("default_fake_quant"): ("lowbit.FakeQuantize", "its default (moving-average min/max, quint8)"),
    _q("default_weight_fake_quant"): ("lowbit.get_default_qat_qconfig", "its weight"),
    _q("default_per_channel_weight_fake_quant"): ("lowbit.get_default_qat_qconfig", "its weight (per channel)"),
    _q("default_histogram_fake_quant"): ("lowbit.FakeQuantize", "`FakeQuantize.with_args(observer=HistogramObserver)`"),
    _q("default_dynamic_fake_quant"): ("lowbit.get_dynamic_qat_qconfig", "its activation (memoryless: "
                                                                         "`averaging_constant=1`)"),
    _q("default_embedding_fake_quant"): ("lowbit.get_embedding_qat_qconfig", "its weight"),
    _q("default_embedding_fake_quant_4bit"): ("lowbit.get_embedding_qat_qconfig", "`bits=4`"),
    _q("default_fused_act_fake_quant"): ("lowbit.get_fused_qat_qconfig", "its activation"),
    _q("default_fused_wt_fake_quant"): ("lowbit.FusedMovingAvgObsFakeQuantize", "per-tensor symmetric qint8"),
    _q("default_fused_per_channel_wt_fake_quant"): ("lowbit.get_fused_qat_qconfig", "its weight"),
    _q("fused_wt_fake_quant_range_neg_127_to_127"): ("lowbit.FusedMovingAvgObsFakeQuantize",
                                                     "`qdtype=qint8.with_range(-127, 127)`"),
    _q("fused_per_channel_wt_fake_quant_range_neg_127_to_127"): ("lowbit.FusedMovingAvgObsFakeQuantize",
                                                                 "per channel, `qint8.with_range(-127, 127)`"),
    _q("default_affine_fixed_qparams_observer"): ("lowbit.FixedQParamsObserver", "`scale=1/256, zero_point=0`"),
    _q("default_symmetric_fixed_qparams_observer"): ("lowbit.FixedQParamsObserver", "`scale=2/256, zero_point=128`"),
    _q("default_fixed_qparams_range_0to1_observer"): ("lowbit.FixedQParamsObserver", "`scale=1/256, zero_point=0`"),
    _q("default_fixed_qparams_range_neg1to1_observer"): ("lowbit.FixedQParamsObserver",
                                                         "`scale=2/256, zero_point=128`"),
    _q("default_affine_fixed_qparams_fake_quant"): ("lowbit.FixedQParamsFakeQuantize", "0..1 grid"),
    _q("default_symmetric_fixed_qparams_fake_quant"): ("lowbit.FixedQParamsFakeQuantize", "-1..1 grid"),
    _q("default_fixed_qparams_range_0to1_fake_quant"): ("lowbit.FixedQParamsFakeQuantize", "0..1 grid"),
    _q("default_fixed_qparams_range_neg1to1_fake_quant"): ("lowbit.FixedQParamsFakeQuantize", "-1..1 grid"),
    # -- quantize_fx --
    "torch.ao.quantization.quantize_fx.prepare_fx": ("lowbit.prepare_fx", "`prepare_custom_config` as torch.ao"),
    "torch.ao.quantization.quantize_fx.prepare_qat_fx": ("lowbit.prepare_qat_fx", ""),
    "torch.ao.quantization.quantize_fx.convert_fx": ("lowbit.convert_fx", "`convert_custom_config` as torch.ao"),
    "torch.ao.quantization.quantize_fx.fuse_fx": ("lowbit.fuse_fx", ""),
    "torch.ao.quantization.quantize_fx.convert_to_reference_fx": ("lowbit.convert_to_reference_fx",
                                                                  "`lower_reference` makes it int8"),
    "torch.ao.quantization.quantize_fx.attach_preserved_attrs_to_model": (
        "lowbit.PrepareCustomConfig", "`set_preserved_attributes([...])`"),
}

_SAME = {  # torch.ao.nn family -> lowbit module holding the same names
    "quantized": "lowbit.nn.quantized", "quantized.dynamic": "lowbit.nn.quantized.dynamic", "qat": "lowbit.nn.qat",
    "qat.dynamic": "lowbit.nn.qat.dynamic", "intrinsic": "lowbit.nn.intrinsic", "intrinsic.qat": "lowbit.nn.intrinsic.qat",
    "intrinsic.quantized": "lowbit.nn.quantized", "intrinsic.quantized.dynamic": "lowbit.nn.quantized.dynamic",
}
_NN_REASONS = {
    "quantized.BatchNorm2d": "folded into the conv before it (`fuse_modules`, graph mode); a lone BN stays float",
    "quantized.BatchNorm3d": "folded into the conv before it (`fuse_modules`, graph mode); a lone BN stays float",
    "quantized.LSTM": "no static LSTM; `lowbit.nn.quantized.dynamic.LSTM` (per-token int8)",
    "quantized.MultiheadAttention": "graph mode quantizes attention's Linear layers and matmuls; "
                                    "`nn.MultiheadAttention` stays float",
    "quantized.Softmax": "stays float (graph mode); the next layer requantizes",
    "quantized.PReLU": "stays float: no quantized PReLU",
    "intrinsic.quantized.BNReLU2d": "BN is folded into the conv before it; a lone BN-ReLU stays float",
    "intrinsic.quantized.BNReLU3d": "BN is folded into the conv before it; a lone BN-ReLU stays float",
    **{f"quantized.dynamic.{n}": "no dynamic conv (not in torch.ao's default dynamic mapping either: poor "
                                 "accuracy); use static convs" for n in
       ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")},
}
_NN_RENAMED = {"quantized.FXFloatFunctional": ("lowbit.nn.quantized.FloatFunctional",
                                               "graph mode traces `+`, `cat`, `mul` directly")}
for _fam in ("intrinsic", "intrinsic.quantized"):
    for _n in ("LinearLeakyReLU", "LinearTanh", "ConvAdd2d", "ConvAddReLU2d"):
        _NN_RENAMED[f"{_fam}.{_n}"] = ("lowbit.register_fusion_pattern", ONEDNN_FUSION)


def torch_ao_names() -> dict[str, list[str]]:
    """``{section: [full torch.ao names]}`` from the installed torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.ao.quantization as tq
        import torch.ao.quantization.quantize_fx as qfx

        out = {"torch.ao.quantization": [_q(n) for n in tq.__all__]}
        out["torch.ao.quantization.quantize_fx"] = [
            f"{qfx.__name__}.{n}" for n in dir(qfx) if not n.startswith("_") and inspect.isfunction(getattr(qfx, n))
            and getattr(qfx, n).__module__ == qfx.__name__]
        for fam in FAMILIES:
            mod = importlib.import_module(f"torch.ao.nn.{fam}")
            names = getattr(mod, "__all__", None)
            if names is None:
                names = [n for n in dir(mod) if not n.startswith("_")
                         and not isinstance(getattr(mod, n), types.ModuleType)]
            out[f"torch.ao.nn.{fam}"] = [f"torch.ao.nn.{fam}.{n}" for n in names]
    return out


def equivalent(full: str) -> tuple[str | None, str]:
    """``(lowbit dotted name or None, note)`` for a torch.ao name; ``KeyError`` if unaccounted for."""
    if full in EQUIV:
        return EQUIV[full]
    fam, _, name = full.removeprefix("torch.ao.nn.").rpartition(".")
    key = f"{fam}.{name}"
    if key in _NN_REASONS:
        return None, _NN_REASONS[key]
    if key in _NN_RENAMED:
        return _NN_RENAMED[key]
    if fam == "quantized.reference":
        if name in ("RNNCell", "LSTMCell", "GRUCell", "LSTM", "GRU"):
            return None, REF_RNN
        return f"lowbit.reference.{name}", ""
    if fam in _SAME:
        return f"{_SAME[fam]}.{name}", ""
    raise KeyError(full)


def render() -> str:
    sections = torch_ao_names()
    total = sum(len(v) for v in sections.values())
    lines = [
        "# torch.ao quantization names → lowbit",
        "",
        f"Generated by `tools/torch_ao_names.py` from the installed torch: {total} public names "
        "(`torch.ao.quantization.__all__`, the public functions of `quantize_fx`, the `torch.ao.nn.*` "
        "families). Each has lowbit's equivalent (importable; `tests/test_torch_ao_names.py` imports them) or "
        "the reason it has none. Where the equivalent is a class or getter, the note gives the arguments.",
        "",
    ]
    for section, names in sections.items():
        lines += [f"## `{section}`", ""]
        if not names:
            lines += ["(no public names in this torch)", ""]
            continue
        lines += ["| torch.ao | lowbit | note |", "|---|---|---|"]
        for full in names:
            eq, note = equivalent(full)
            short = full.removeprefix(section + ".")
            note = note.replace("|", "\\|")  # a pipe inside a table cell must be escaped
            lines.append(f"| `{short}` | {f'`{eq}`' if eq else '—'} | {note} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        ok = OUT.exists() and OUT.read_text() == text
        print("docs/torch_ao_names.md is " + ("up to date" if ok else "stale: rerun tools/torch_ao_names.py"))
        return 0 if ok else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
