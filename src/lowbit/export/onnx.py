"""``to_onnx``: converted or prepared/QAT lowbit models as deployable QDQ ONNX files.

The model is copied and every quantized piece is swapped for its float QDQ twin
(``lowbit.export.qdq``); the twin is traced by ``torch.onnx.export(..., dynamo=False)``, its
constants become initializers, and ``onnx.checker`` validates the result. What each module becomes::

    Quantize                      Q -> DQ on its grid             DeQuantize      (nothing)
    Linear(ReLU), Conv*(ReLU)*,   Q/DQ(input grid) -> Gemm / Conv / ConvTranspose(DQ(int8 W, axis), DQ(int32 b))
      ConvTranspose*                -> (Relu) -> Q/DQ(output grid)
    LinearFloatOut                as Linear, without the output Q/DQ (float result; ``fuse_dequantize``)
    float layer kept in an int8   the float module (float weights) -> Q/DQ(the grid its int8 readers read)
      model (``quantize_ptq(max_float_layers=...)``, ``keep_faster``), or nothing when its output is float
    QFunctional.add/mul/cat/...   Q/DQ(input grids) -> float op -> Q/DQ(output grid)
    Hardswish, ELU, Sigmoid, ...  float op -> Q/DQ(output grid)    ReLU6: relu6 -> Q/DQ(input grid)
    bilinear interpolate, avg /   on the codes of the input grid, lowbit's float32 math, rounded back onto it
      adaptive pools, mean of a     (``lowbit.export.codes``; prepared / QAT graphs: a bilinear upsample between
      QTensor                       two calls of one fake-quant)
    Embedding (8-bit)             Gather(DQ(int8 table, axis=0))
    Embedding (4-bit), EmbeddingBag   Gather(DQ(codes, axis=0)) (-> ScatterElements bag reduction), 4-bit codes
                                  as INT4/UINT4 at opset 21, else one per byte (``lowbit.export.embedding``)
    dynamic Linear                per-token grids (ReduceMin/Max) -> MatMulInteger -> int32 zero-point
                                  correction -> Mul(s_x s_w) -> Add bias (``lowbit.export.dynamic``)
    dynamic LSTM / GRU            time loop unrolled (fixed length, dynamic batch), each gate GEMM as above
    WeightOnlyLinear              MatMul(x, DQ(group-wise codes)) (+ bias, Relu): groups as DQ channels below
                                  opset 21; DQ(INT4/UINT4, block_size) at 21 (``lowbit.export.weight_only``)
    FakeQuantize / observer       Q -> DQ on its current grid; a module's ``weight_fake_quant`` freezes the
                                  weight into int8 codes + DQ (QAT conv-BN modules are BN-folded first); an
                                  observed float Linear/Conv gets the int8 weight ``convert`` would give it

The input grid of each quantized layer is the grid of the ``QTensor`` it received when
``example_inputs`` ran through the model (its recorded ``input_grid`` for float inputs). The file
describes the model in eval mode, traced on CPU; a ``QTensor`` the model returns becomes its
dequantized float values. Batch size (dim 0 of every input and output) stays dynamic unless
``dynamic_batch=False``. ``model`` itself is never changed (a copy is exported).

>>> import torch, tempfile, os, lowbit as Q
>>> from torch import nn
>>> from lowbit.export import to_onnx
>>> m = nn.Sequential(Q.QuantStub(), nn.Linear(4, 3), Q.DeQuantStub()).eval()
>>> m.qconfig = Q.get_default_qconfig()
>>> m = Q.prepare(m); _ = m(torch.randn(8, 4)); m = Q.convert(m)
>>> path = to_onnx(m, torch.randn(2, 4), os.path.join(tempfile.mkdtemp(), "m.onnx"))
>>> path.suffix
'.onnx'
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .embedding import EmbeddingBagTwin, EmbeddingTableTwin, to_int4
from .proto import constants_to_initializers
from .conv_epilogue import depthwise_epilogues
from .share_codes import share_codes
from .twin import _check_inputs, build_twin
from .weight_only import WeightOnlyTwin, to_blocked

__all__ = ["run_onnx", "to_onnx"]

def _require(name: str, who: str) -> Any:
    """Import an optional dependency, or say which extra installs it."""
    try:
        return __import__(name)
    except ImportError as e:
        raise ImportError(f"lowbit.export.{who} needs the '{name}' package: pip install lowbit[onnx]") from e


def _check_path(path: Any, where: str = "to_onnx", name: str = "path") -> Path:
    """A writable file path, or an error naming ``where``'s argument ``name``. A symbolic link (to a file, or
    dangling) is written through, as ``open(path, "w")`` does: the file it names is checked and returned, and the link
    stays (``os.replace`` onto the link replaced it by a regular file; a dangling link's check also left an empty file
    at its target). A name ending in a separator, ``.`` or ``..`` (``'x.onnx/'``, a directory's name) is refused (``Path``
    dropped the slash: it wrote ``x.onnx``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: {name} must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    text = os.fspath(path)
    if not text or "\0" in str(text):  # ('' was read as '.', "a directory"; a NUL raised "embedded null byte")
        raise ValueError(f"{where}: {name}={text!r} is {'empty' if not text else 'not a file name (it holds a NUL)'}; "
                         "give a file name such as model.onnx")
    if os.fsdecode(os.path.basename(text)) in ("", ".", ".."):  # ('x.onnx/', 'x.onnx/.')
        raise ValueError(f"{where}: {name}={text!r} names a directory (it ends with a path separator, '.' or '..'); "
                         "give a file name such as model.onnx")
    p, link = Path(path), os.path.islink(text)
    shown = repr(str(p)) + (f" (a symbolic link to {os.path.realpath(text)!r})" if link else "")
    p = Path(os.path.realpath(text)) if link else p
    try:
        mode = p.stat().st_mode if p.exists() else None
        parent_ok = p.parent.is_dir()
    except OSError as e:  # (a name past the file system's limit: ENAMETOOLONG)
        raise ValueError(f"{where}: cannot write {name}={shown}: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{where}: {name}={shown} is a directory; give a file name such as model.onnx")
    if mode is not None and not stat.S_ISREG(mode):
        # (to_onnx renames its finished file onto ``path``: a device such as /dev/null, or a FIFO, would be replaced
        # by a regular file; and opening a FIFO to check it blocks until a reader comes)
        raise ValueError(f"{where}: {name}={shown} exists and is not a regular file; give a file name such as "
                         "model.onnx")
    if not parent_ok:
        raise ValueError(f"{where}: cannot write {name}={shown}: directory {str(p.parent)!r} does not exist")
    existed = mode is not None
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise ValueError(f"{where}: cannot write {name}={shown}: {e.strerror or e}") from e
    if not existed:
        p.unlink()
    return p


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat_tensors(o)]
    raise TypeError(f"to_onnx: the model must return tensors (or tuples/lists of them), got {type(out).__name__}")


def to_onnx(model: nn.Module, example_inputs: Any, path: str | os.PathLike[str], *, opset_version: int = 17,
            input_names: list[str] | None = None, output_names: list[str] | None = None,
            dynamic_batch: bool = True, weight_dtype: str = "auto", exact: bool | str = False) -> Path:
    """Export a converted (or prepared / QAT) lowbit model to a QDQ ONNX file at ``path``; return the path.

    ``example_inputs`` (a tensor or a tuple) is run once through ``model`` to trace it and to read
    the grid each quantized layer's input is on. ``weight_dtype`` is ``"auto"``, ``"int8"`` or
    ``"uint8"`` (see ``lowbit.export.qdq``: ``auto`` keeps int8 unless a layer's weights could
    saturate u8 x s8 kernels on CPUs without VNNI). ``exact=True`` writes each quantized Conv / Linear as
    ``ConvInteger`` / ``MatMulInteger`` and lowbit's own float32 requantization (``lowbit.export.exact``), and
    quantized add / mul / cat / scalar ops / BatchNorm as lowbit's code arithmetic (``lowbit.export.exact_ops``), each
    reader on its producer's grid taking the producer's codes (``lowbit.export.share_codes``), so ONNX Runtime's
    codes equal lowbit's bit for bit on any ORT build (each op rounds once, as ONNX specifies); the QDQ default lets
    ORT fuse ``QLinearConv`` / ``QLinearAdd`` / ..., whose int32 bias and folded multipliers move near-tie codes by
    one step. ``exact="x86"`` also writes each Conv's requantization as depthwise 1x1 Convs that ORT's NCHWc layout
    keeps (``lowbit.export.conv_epilogue``; MobileNetV2 x0.5 ~1.25x faster in ORT): exact where ORT adds a
    depthwise Conv's bias after the product, as x86 MLAS does (AVX2 / AVX-512); ARM's NEON NCHWc kernel starts the
    sum at the bias and fuses the multiply-add, so that file is not exact there. Needs ``pip install lowbit[onnx]``.
    The file is written beside ``path`` under a temporary name and renamed onto it once it passed ONNX's checker: an
    export that fails leaves an existing file at ``path`` as it was.
    """
    onnx = _require("onnx", "to_onnx")
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_onnx: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or not 13 <= opset_version <= 21:
        raise ValueError(f"to_onnx: opset_version={opset_version!r} must be an int in 13..21 (per-channel QDQ; "
                         "21: exported at 20 and relabelled, for INT4/UINT4 embedding tables)")
    if not isinstance(dynamic_batch, bool):
        raise TypeError(f"to_onnx: dynamic_batch={dynamic_batch!r} must be True or False")
    inputs = tuple(t.cpu() for t in _check_inputs(example_inputs))
    out_path = _check_path(path)  # (a symbolic link's target: written through, the link kept)
    if not (isinstance(exact, bool) or (isinstance(exact, str) and exact == "x86")):
        raise TypeError(f"to_onnx: exact={exact!r} must be True, False or 'x86' (exact on x86 ONNX Runtime, with "
                        "Conv requantization ORT keeps in its NCHWc layout)")
    _refuse_meta(model)
    twin, tables = _twin(model, inputs, weight_dtype, opset_version, bool(exact))
    with torch.no_grad():
        n_out = len(_flat_tensors(twin(*inputs)))
    if n_out == 0:  # (ONNX Runtime refused such a file at load, deep in its session setup)
        raise ValueError("to_onnx: the model returns no tensors (an empty tuple or list); an ONNX graph needs at "
                         "least one output")
    for what, given in (("input_names", input_names), ("output_names", output_names)):
        if given is not None and (isinstance(given, str) or not all(isinstance(n, str) for n in given)):
            raise TypeError(f"to_onnx: {what}={given!r} must be a list of strings")
    input_names = list(input_names) if input_names else (
        ["input"] if len(inputs) == 1 else [f"input_{i}" for i in range(len(inputs))])
    output_names = list(output_names) if output_names else (
        ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)])
    every = input_names + output_names
    bad = [n for n in every if not n] + sorted({n for n in every if n and every.count(n) > 1})
    if bad:  # (ONNX names each value once: the exporter renamed one side, or the checker failed deep)
        raise ValueError(f"to_onnx: input and output names must be non-empty and distinct; {bad[0]!r} is "
                         f"{'empty' if not bad[0] else 'given more than once'} (input_names={input_names}, "
                         f"output_names={output_names})")
    if len(input_names) != len(inputs) or len(output_names) != n_out:
        raise ValueError(f"to_onnx: got {len(input_names)} input names for {len(inputs)} inputs and "
                         f"{len(output_names)} output names for {n_out} outputs")
    axes = {n: {0: "batch"} for n in input_names + output_names} if dynamic_batch else None
    # written beside ``path`` under a temporary name and renamed over it at the end: a failed export (a graph the
    # checker refuses, opset 21 with GroupNormalization) leaves an existing file at ``path`` as it was
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        _export(onnx, twin, inputs, tmp, opset_version, input_names, output_names, axes, tables, exact)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return Path(path)


_EXPORT_LOCK = threading.Lock()  # the symbolic registry below is process-wide: one export at a time


@contextlib.contextmanager
def _float_dequantize_is_identity(opset: int) -> Iterator[None]:
    """While exporting, ``aten::dequantize`` of a float tensor is the tensor itself, as in eager mode.

    A model's own ``y.dequantize()`` of a ``QTensor`` runs on the twin's float (QDQ'd) value, and torch's
    symbolic for it expects a torch quantized tensor: the TorchScript exporter failed deep in its pass
    ("ONNX symbolic expected the output of ... to be a quantized tensor"). A torch quantized tensor (traced as
    a tuple) keeps torch's own symbolic; a custom one registered before is put back afterwards.
    """
    from torch.onnx._internal.torchscript_exporter import registration, symbolic_helper

    name = "aten::dequantize"
    group = registration.registry.get_function_group(name)
    before = group.get(opset) if group is not None else None

    def symbolic(g: Any, x: Any) -> Any:
        if symbolic_helper._is_tuple_construct(x):  # a torch quantized tensor: torch's (or the user's) symbolic
            return before(g, x) if before is not None else symbolic_helper.dequantize_helper(g, x)[0]
        return x

    with _EXPORT_LOCK:
        torch.onnx.register_custom_op_symbolic(name, symbolic, opset)
        try:
            yield
        finally:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
            group = registration.registry.get_function_group(name)
            if before is not None and group is not None and group.get(opset) is not before:
                torch.onnx.register_custom_op_symbolic(name, before, opset)  # a user's own override


def _twin(model: nn.Module, inputs: tuple[torch.Tensor, ...], weight_dtype: str,
          opset_version: int, exact: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    """``build_twin`` plus the opset its embedding / weight-only twins write, and the tables among them."""
    twin = build_twin(model, inputs, weight_dtype, exact)
    for name, m in twin.named_modules():
        if isinstance(m, EmbeddingBagTwin):
            m.check_opset(opset_version, name)
        if isinstance(m, WeightOnlyTwin):
            m.opset = opset_version
    return twin, [m for m in twin.modules() if isinstance(m, (EmbeddingTableTwin, EmbeddingBagTwin))]


def _export(onnx: Any, twin: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path, opset_version: int,
            input_names: list[str], output_names: list[str], axes: dict[str, dict[int, str]] | None,
            tables: list[nn.Module], exact: bool | str = False) -> None:
    """``to_onnx``'s export of ``twin`` to ``path``, its initializers, the opset-21 relabelling and the checker
    (``exact``: readers take their producers' codes, ``share_codes``; ``exact="x86"``: Conv epilogues as
    depthwise Convs, ``conv_epilogue``)."""
    with warnings.catch_warnings(), _float_dequantize_is_identity(min(opset_version, 20)):
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        try:
            torch.onnx.export(twin, inputs, str(path), dynamo=False, opset_version=min(opset_version, 20),
                              input_names=input_names, output_names=output_names, dynamic_axes=axes,
                              do_constant_folding=True, autograd_inlining=False)  # (every twin Function has
            # its symbolic; inlining their forwards failed with "unordered_map::at" on a layer called twice)
        except torch.onnx.errors.UnsupportedOperatorError as e:  # (its message goes on with the whole TorchScript
            # graph, hundreds of lines: the op and the opset are its first line)
            raise NotImplementedError(f"to_onnx: {str(e).splitlines()[0].strip()} (a float op of the model that "
                                      "ONNX cannot express at this opset: another opset_version in 13..21, or "
                                      "keep the op out of the exported model)") from None
    proto = onnx.load(str(path))
    _keep_unused_inputs(onnx, proto, inputs, input_names, axes)
    constants_to_initializers(proto)
    if exact:
        share_codes(proto.graph)
        if exact == "x86":
            depthwise_epilogues(proto.graph)  # (after share_codes, which reads the Round -> Clip ends)
    if opset_version == 21:  # 20 -> 21 only added types (INT4, FLOAT8) and defaulted attributes to the ops used
        if any(n.op_type == "GroupNormalization" for n in proto.graph.node):
            raise ValueError("to_onnx: opset_version=21 cannot relabel a GroupNormalization graph; use <= 20")
        for imp in proto.opset_import:
            if imp.domain in ("", "ai.onnx"):
                imp.version = 21
        to_int4(proto, tables)
        to_blocked(proto)
    proto.producer_name = "lowbit"
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def _refuse_meta(model: nn.Module) -> None:
    """A model moved with ``.to("meta")`` has no values to write (its copy failed deep in ``deepcopy``: "Cannot copy
    out of meta tensor")."""
    for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        name = next((n for n, t in named() if t.is_meta), None)
        if name is not None:
            raise RuntimeError(f"to_onnx: {kind} '{name}' is on the meta device (moved with .to('meta')): it has no "
                               "values to write; export the model on cpu (or cuda)")


def _keep_unused_inputs(onnx: Any, proto: Any, inputs: tuple[torch.Tensor, ...], names: list[str],
                        axes: dict[str, dict[int, str]] | None) -> None:
    """Put back the inputs the exporter dropped because no op reads them, in the model's order, so the file takes
    the model's arguments (``run_onnx(path, x, unused)`` was refused: "the model takes 1 inputs")."""
    present = {i.name: i for i in proto.graph.input}
    if len(present) >= len(names) or not set(present) <= set(names):  # (none dropped, or renamed: left as written)
        return
    kept = []
    for n, t in zip(names, inputs):
        if n in present:
            kept.append(present[n])
            continue
        dims: list[Any] = list(t.shape)
        if axes is not None and dims:
            dims[0] = axes.get(n, {}).get(0, dims[0])
        kept.append(onnx.helper.make_tensor_value_info(
            n, onnx.helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=t.dtype).numpy().dtype), dims))
    extra = [i for i in proto.graph.input if i.name not in set(names)]  # (initializers kept as inputs, if any)
    del proto.graph.input[:]
    proto.graph.input.extend(kept + extra)


def _float_weight_layers(onnx: Any, path: str | os.PathLike[str]) -> bool:
    """Whether a Conv / ConvTranspose / Gemm of the file reads a float32 weight initializer (a float layer)."""
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as err:  # (protobuf's DecodeError "Wire format was corrupt", naming no file)
        raise ValueError(f"run_onnx: {str(path)!r} is not an ONNX model ({type(err).__name__}: {err})") from None
    floats = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    return any(n.op_type in ("Conv", "ConvTranspose", "Gemm") and len(n.input) > 1 and n.input[1] in floats
               for n in graph.node)


_ORT_TYPES = {"tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
              "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(int8)": torch.int8,
              "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool}


def _check_feeds(metas: Any, inputs: tuple[torch.Tensor, ...]) -> None:
    """Each input's dtype and fixed dimensions against the session's inputs (ORT's own error names neither the
    tensor's shape nor which of its dimensions is symbolic)."""
    for i, (meta, t) in enumerate(zip(metas, inputs)):
        want = _ORT_TYPES.get(meta.type)
        shape = list(meta.shape) if meta.shape is not None else None
        fits = shape is None or (len(shape) == t.dim() and all(not isinstance(d, int) or d == n
                                                                 for d, n in zip(shape, t.shape)))
        if (want is not None and t.dtype != want) or not fits:
            raise ValueError(f"run_onnx: input {i} ({meta.name!r}) is a {t.dtype} tensor of shape {tuple(t.shape)}; "
                             f"the model takes {meta.type} of shape {shape} (names: dimensions of any size)")


def run_onnx(path: str | os.PathLike[str], *inputs: torch.Tensor, optimized_model_path: str | None = None,
             accuracy_level: int | None = 1) -> list[torch.Tensor]:
    """Run an ONNX file on ONNX Runtime's CPU provider; outputs as tensors (``pip install lowbit[onnx]``).

    ``optimized_model_path`` saves the graph ORT actually runs (its fused integer kernels).
    ``accuracy_level`` is given to the ``MatMulNBits`` kernels ORT fuses from blocked int4/int8
    DequantizeLinear + MatMul (opset-21 ``WeightOnlyLinear``): 1 (here the default) keeps float32
    activations, lowbit's numerics; ``None`` leaves ORT's default, 4, which quantizes activations
    to int8 per block (faster; ~0.5 % relative output error measured on a 256 -> 64 layer).
    """
    if accuracy_level is not None and (isinstance(accuracy_level, bool) or accuracy_level not in (0, 1, 2, 3, 4)):
        raise ValueError(f"run_onnx: accuracy_level={accuracy_level!r} must be None or an int in 0..4")
    bad = [type(t).__name__ for t in inputs if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"run_onnx: inputs must be tensors, got {', '.join(bad)}")
    for i, t in enumerate(inputs):  # numpy (ORT's Python API) has no bfloat16 / complex32 / quantized dtypes
        if t.dtype in (torch.bfloat16, torch.complex32) or t.is_quantized or "float8" in str(t.dtype):
            raise TypeError(f"run_onnx: input {i} has dtype {t.dtype}, which ONNX Runtime's Python API cannot take; "
                            "convert it first (e.g. .float())")
    if not Path(path).is_file():
        raise FileNotFoundError(f"run_onnx: no ONNX file at {str(path)!r}")
    if optimized_model_path is not None:
        _check_path(optimized_model_path, "run_onnx", "optimized_model_path")
    ort = _require("onnxruntime", "run_onnx")
    opts = ort.SessionOptions()
    if accuracy_level is not None:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    if optimized_model_path is not None:
        opts.optimized_model_filepath = str(optimized_model_path)
    # ORT >= 1.20's WeightBiasQuantization quantizes the float weight of a Conv / Gemm read from a DequantizeLinear and
    # written to a QuantizeLinear (per-tensor int8): a float layer kept in an int8 model would silently run int8.
    # Off only where such a float weight exists (prepared / QAT files rely on it for their float biases' int32 form)
    off = ["WeightBiasQuantization"] if _float_weight_layers(_require("onnx", "run_onnx"), path) else []
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"], disabled_optimizers=off)
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"run_onnx: the model takes {len(names)} inputs ({names}), got {len(inputs)}")
    _check_feeds(sess.get_inputs(), inputs)
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, inputs)}
    return [torch.from_numpy(o) for o in sess.run(None, feeds)]
