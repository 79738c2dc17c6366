"""``convert_fx``'s per-graph converter (split from ``convert.py``, whose docstring describes what each observer node
becomes): ``_Converter`` walks one prepared graph's observer nodes and swaps modules (``module``), builds
``QFunctional`` calls (``functional``), quantized activations (``act``) and quantized ``Linear`` / ``ConvNd`` modules
from ``F.linear`` / ``F.conv*`` on parameters (``weighted``), inserts ``Quantize`` (input observers) and shared
``DeQuantize`` nodes (``dequantize``: after every int value a float op or the output reads), and drops dropout,
leftover stubs and a bilinear resample's second observer call (``identities``). Each quantized node's grid is its
observer's: ``scale, zero_point = observer.calculate_qparams()``, ``q = clamp(round(x / scale) + zero_point)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..fake_quant.base import holds_grid
from ..mappings import get_default_dynamic_quant_module_mappings, get_default_static_quant_module_mappings
from ..nn.quantized.normalization import batchnorm_float_reason
from ..nn.intrinsic.qat.modules import _BnFolded
from ..nn.quantized import activation as nnq_act
from ..nn.quantized._utils import output_qparams
from ..nn.quantized.functional_modules import QFunctional, scaled_operand
from ..nn.quantized.stubs import DeQuantize, Quantize, region_dtype
from ..observer import PlaceholderObserver
from ..state_check import LOAD_HINT
from .convert_dynamic import set_module as _set_module, what as _what
from .patterns import func_activation, is_dropout
from .prepare import returned_values
from .state import STATE_KEY
from .report import FxReport
from .scalar_ops import scalar_call
from .weighted import arg_of, input_of, standin

__all__: list[str] = []


def _reads_layout(node: fx.Node) -> bool:
    """Whether ``node`` reads its first input's memory layout: ``as_strided``, ``stride()``, ``storage_offset()``,
    ``is_contiguous()``."""
    if node.op == "call_method":
        return node.target in ("as_strided", "stride", "storage_offset", "is_contiguous")
    return node.op == "call_function" and node.target is torch.as_strided


def _reads_codes(node: fx.Node, deqs: set[fx.Node], limit: int = 256) -> bool:
    """Whether float ``node`` is computed (through float nodes, up to ``limit`` of them) from one of ``deqs``, the
    dequantized int8 values."""
    seen, todo = {node}, [node]
    while todo and len(seen) < limit:
        for src in todo.pop().all_input_nodes:
            if src in deqs:
                return True
            if src not in seen and src.meta.get("lowbit_domain") != "int":
                seen.add(src)
                todo.append(src)
    return False


class _Holder(nn.Module):
    """Carries an observer as ``activation_post_process`` for ``output_qparams``."""

    def __init__(self, obs: nn.Module) -> None:
        super().__init__()
        self.activation_post_process = obs


def _grid(obs: nn.Module, where: str) -> tuple[float, int, Any]:
    return output_qparams(_Holder(obs), where)


class _Converter:
    def __init__(self, gm: fx.GraphModule, report: FxReport, prefix: str, custom: dict[type, type]) -> None:
        self.gm, self.graph, self.report, self.prefix = gm, gm.graph, report, prefix
        self.mapping = {**get_default_static_quant_module_mappings(), **custom}
        self.dynamic_mapping = get_default_dynamic_quant_module_mappings()
        self.count = 0
        self.swapped: set[Any] = set()
        self.dropped: set[str] = set()  # get_attr targets whose nodes were erased
        self.standins: dict[fx.Node, nn.Module] = {}  # weighted node -> its float nn.Linear / nn.ConvNd
        self.dtype = region_dtype(gm)  # (read before the swaps: float64 model -> float64 out of the int8 region)
        # prepare_custom_config's quantized input/output indexes (top-level graph only)
        state = gm.meta[STATE_KEY]
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        top = not prefix
        self.quantized_inputs = {placeholders[i] for i in state.get("input_quantized_idxs", [])
                                 if top and i < len(placeholders)}
        self.output_idxs: list[int] = list(state.get("output_quantized_idxs", [])) if top else []

    def _quantized_outputs(self) -> set[fx.Node]:
        """The values returned as ``QTensor``s (``output_quantized_idxs``), read from the final output node."""
        values = returned_values(self.graph)
        if not values or not self.output_idxs:
            return set()
        past = [i for i in self.output_idxs if i >= len(values)]
        if past:  # (a typo was silently ignored)
            raise ValueError(f"convert_fx: output_quantized_indexes {past} are past the model's {len(values)} outputs")
        return {values[i] for i in self.output_idxs if isinstance(values[i], fx.Node)}

    def _key(self, node: fx.Node) -> str:
        return f"{self.prefix}.{node.name}" if self.prefix else node.name

    def _new_name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def _replace(self, old: fx.Node, new: fx.Node) -> None:
        new.meta.update({k: v for k, v in old.meta.items() if k.startswith("lowbit_")})
        old.replace_all_uses_with(new)
        self.graph.erase_node(old)

    def module(self, node: fx.Node, obs: nn.Module | None) -> None:
        mod = self.gm.get_submodule(node.target)
        qcls = self.mapping.get(type(mod))
        if qcls is None:
            raise ValueError(f"convert_fx: module '{node.target}' ({type(mod).__name__}) has no quantized class; "
                             "for an observed custom module pass convert_custom_config="
                             "ConvertCustomConfig().set_observed_to_quantized_mapping(Observed, Quantized)")
        src = mod.fold() if isinstance(mod, _BnFolded) else mod
        if obs is not None:  # weight-only modules (embeddings) have no output observer
            src.activation_post_process = obs
        try:
            new = qcls.from_float(src)
        except (ValueError, TypeError, RuntimeError) as err:
            raise type(err)(f"convert_fx: module '{node.target}' ({type(mod).__name__} -> {qcls.__name__}): "
                            f"{err}") from err
        if not isinstance(new, nn.Module):  # (a custom from_observed returning None failed inside torch.fx)
            raise TypeError(f"convert_fx: module '{node.target}': {qcls.__name__}.from_float / from_observed returned "
                            f"{type(new).__name__}, not an nn.Module")
        _set_module(self.gm, node.target, new)
        self.report.converted[self._key(node)] = f"{type(mod).__name__} -> {qcls.__module__}.{qcls.__name__}"

    def left_float(self, src: fx.Node) -> bool:
        """Keep float a ``module`` node whose BatchNorm lost its running statistics after prepare (batch statistics;
        ``batchnorm_float_reason``): its output observer becomes a ``Quantize`` for the int ops reading it, and
        ``dequantize`` gives it float inputs. Returns whether it did."""
        why = batchnorm_float_reason(self.gm.get_submodule(src.target))
        if why is None:
            return False
        src.meta.update(lowbit_kind="float", lowbit_domain="float")
        self.report.left_float[self._key(src)] = f"{_what(src, self.gm)} ({why})"
        self.report.converted.pop(self._key(src), None)
        return True

    def functional(self, node: fx.Node, obs: nn.Module) -> fx.Node:
        qop = node.meta["lowbit_qop"]
        name = self._new_name("qfunctional")
        grid = node.meta.get("lowbit_grid") or _grid(obs, "QFunctional")  # (lowbit_grid: the input's, observed_rules)
        self.gm.add_submodule(name, QFunctional(*grid))
        args: tuple[Any, ...] = tuple(node.args)
        with self.graph.inserting_before(node):
            if qop == "cat":
                tensors = args[0] if args else node.kwargs["tensors"]
                dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
                method, args = "cat", (tensors, dim)
            elif qop.endswith("_scalar"):  # (x ± c, c - x on the mirrored codes, x · c, x / c: fx/scalar_ops.py)
                method, args = scalar_call(self.graph, node, name)
            else:
                method = qop
                if "lowbit_alpha" in node.meta:  # (a + c · b: b's grid scaled by |c|, its codes mirrored for c < 0;
                    # the scaled grid kept on the QFunctional that adds it: scaled_operand's third argument)
                    scaled = self.graph.call_function(scaled_operand, (args[1], node.meta["lowbit_alpha"],
                                                                       self.graph.get_attr(name)))
                    scaled.meta.update(lowbit_kind="share", lowbit_domain="int", lowbit_ftensor=True)
                    args = (args[0], scaled)
            new = self.graph.call_module(name, (method, *args))  # QFunctional.forward(op, ...): a leaf when re-traced
        alpha = f" (second operand times {node.meta['lowbit_alpha']!r})" if "lowbit_alpha" in node.meta else ""
        self.report.converted[self._key(node)] = f"{_what(node, self.gm)} -> QFunctional.{method}{alpha}"
        self._replace(node, new)
        return new

    def act(self, node: fx.Node, obs: nn.Module) -> fx.Node:
        cls = func_activation(node.op, node.target)
        assert cls is not None
        name = self._new_name("quantized_act")
        if cls is nnq_act.ReLU6:
            mod: nn.Module = cls()
        else:
            grid = _grid(obs, cls.__name__)
            extra = node.kwargs.get("negative_slope", node.kwargs.get("alpha"))
            if extra is None and len(node.args) > 1 and not isinstance(node.args[1], bool):
                extra = node.args[1]
            if cls is nnq_act.LeakyReLU:
                mod = cls(grid[0], grid[1], 0.01 if extra is None else extra, grid[2])
            elif cls is nnq_act.ELU:
                mod = cls(grid[0], grid[1], 1.0 if extra is None else extra, grid[2])
            else:
                mod = cls(*grid)
        self.gm.add_submodule(name, mod)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(name, (node.args[0],))
        qname = f"{type(mod).__module__}.{type(mod).__name__}"
        self.report.converted[self._key(node)] = f"{_what(node, self.gm)} -> {qname}"
        self._replace(node, new)
        return new

    def weighted(self, node: fx.Node, obs: nn.Module) -> fx.Node:
        wobs, bias = arg_of(node, "weight"), arg_of(node, "bias")  # weight_post_process(get_attr), get_attr
        assert wobs.meta.get("lowbit_kind") == "obs_w", wobs
        src = self.standins[node]
        src.weight_fake_quant = self.gm.get_submodule(wobs.target)  # type: ignore[arg-type]
        src.activation_post_process = obs
        qcls = self.mapping[type(src)]
        what = _what(node, self.gm)
        try:
            mod = qcls.from_float(src)
        except (ValueError, TypeError, RuntimeError) as err:
            raise type(err)(f"convert_fx: '{node.name}' ({what} -> {qcls.__name__}): {err}") from err
        name = self._new_name(f"quantized_{what}")
        self.gm.add_submodule(name, mod)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(name, (input_of(node),))
        self.report.converted[self._key(node)] = f"{what} -> {qcls.__module__}.{qcls.__name__}"
        self._replace(node, new)
        for attr in (wobs, wobs.args[0], bias):  # the observer, then the float weight / bias reads
            if attr is not None and not attr.users:
                if attr.op == "get_attr":
                    self.dropped.add(attr.target)
                self.graph.erase_node(attr)
        return new

    def drop_float_attrs(self) -> None:
        """Delete float weights/biases whose only readers were converted (kept if a node or a module
        forward still reads them)."""
        read = {n.target for n in self.graph.nodes if n.op == "get_attr"}
        called = {n.target for n in self.graph.nodes if n.op == "call_module"}
        for target in self.dropped - read:
            owner, _, name = target.rpartition(".")
            if any(owner == c or owner.startswith(f"{c}.") for c in called):  # a leaf's forward reads it
                continue
            delattr(self.gm.get_submodule(owner) if owner else self.gm, name)

    def observers(self) -> None:
        # float stand-ins first: a weight may belong to a module that is swapped below (fc.weight)
        self.standins = {n: standin(n.meta["lowbit_wspec"], self.gm) for n in self.graph.nodes
                         if n.meta.get("lowbit_kind") in ("weighted", "dynamic") and "lowbit_wspec" in n.meta}
        for node in list(self.graph.nodes):
            role = node.meta.get("lowbit_kind")
            if role not in ("obs_out", "obs_in"):  # obs_w: read by the weighted node's conversion
                continue
            obs = self.gm.get_submodule(node.target)
            src = node.args[0]
            if not holds_grid(obs):
                where = f"{self.prefix}: " if self.prefix else ""
                inner = getattr(obs, "activation_post_process", obs)
                if isinstance(inner, PlaceholderObserver):  # (NoopObserver too) "saw no data" after calibration misled
                    raise RuntimeError(
                        f"convert_fx: {where}the observer after '{src.name}' ({_what(src, self.gm)}) is a "
                        f"{type(inner).__name__} (qconfig.activation), which records no grid: a static int8 layer "
                        "needs an observer such as HistogramObserver or MinMaxObserver; for a layer quantized per call "
                        "give it a dynamic qconfig (get_dynamic_qconfig())")
                raise RuntimeError(f"convert_fx: {where}the observer after '{src.name}' ({_what(src, self.gm)}) saw "
                                   "no data (or only NaN/Inf values, which observers ignore); run calibration batches "
                                   f"through the prepared model before convert_fx() ({LOAD_HINT})")
            if role == "obs_in" and src in self.quantized_inputs:  # arrives as a QTensor: no Quantize
                node.replace_all_uses_with(src)
                self.graph.erase_node(node)
                src.meta["lowbit_domain"] = "int"
                continue
            if role == "obs_in" or src.meta["lowbit_kind"] == "module" and self.left_float(src):
                name = self._new_name("quantize")
                self.gm.add_submodule(name, Quantize(*_grid(obs, "Quantize")))
                with self.graph.inserting_before(node):
                    new = self.graph.call_module(name, (src,))
                self._replace(node, new)
                new.meta["lowbit_kind"] = "quantize"
                continue
            kind = src.meta["lowbit_kind"]
            if kind == "module":
                if src.target not in self.swapped:  # a module called at several sites is swapped once
                    self.module(src, obs)
                    self.swapped.add(src.target)
                produced = src
            elif kind == "weighted":
                produced = self.weighted(src, obs)
            else:
                produced = self.functional(src, obs) if kind == "functional" else self.act(src, obs)
            node.replace_all_uses_with(produced)
            self.graph.erase_node(node)

    def dequantize(self) -> None:
        self.gm.add_submodule("dequantize", DeQuantize(self.dtype))
        made: dict[fx.Node, fx.Node] = {}
        quantized_outputs = self._quantized_outputs()
        for node in list(self.graph.nodes):
            kind = node.meta.get("lowbit_kind")
            if kind not in ("float", "opaque", "output", "dynamic") and not (
                    kind == "share" and node.meta.get("lowbit_domain") == "float"):
                continue
            for src in list(node.all_input_nodes):
                if src.meta.get("lowbit_domain") != "int":
                    continue
                if node.op == "output" and src in quantized_outputs:  # returned as a QTensor
                    continue
                if src not in made:
                    with self.graph.inserting_after(src):
                        made[src] = self.graph.call_module("dequantize", (src,))
                    made[src].meta.update(lowbit_kind="dequantize", lowbit_domain="float", lowbit_ftensor=True)
                node.replace_input_with(src, self._float_layout(src, made[src]) if _reads_layout(node) else made[src])
        deqs = set(made.values())
        for node in list(self.graph.nodes):  # a float value made from dequantized codes (torch.cat of two int8 convs:
            arg = node.args[0] if _reads_layout(node) and node.args else None  # channels-last as its inputs)
            if isinstance(arg, fx.Node) and arg.meta.get("lowbit_domain") != "int" and isinstance(
                    arg.meta.get("lowbit_layout"), str) and _reads_codes(arg, deqs):
                node.replace_input_with(arg, self._float_layout(arg, arg))
        if self.prefix and self.gm.meta.get(STATE_KEY, {}).get("layout_reads"):  # a child graph whose parent's
            self._outputs_in_float_layout(made)  # eager code may read its outputs' layout (fx/child_reads.reads_layout)

    def _outputs_in_float_layout(self, made: dict[fx.Node, fx.Node]) -> None:
        """A child graph's float outputs made from int8 codes laid out as the float child's (``y.stride()``,
        ``y.is_contiguous()``, ``y.as_strided(...)`` in the parent read a conv's channels-last codes otherwise)."""
        out = next(n for n in self.graph.nodes if n.op == "output")
        src_of = {d: s for s, d in made.items()}
        for v in out.all_input_nodes:
            src = src_of.get(v, v)
            if v.meta.get("lowbit_domain") != "int" and isinstance(src.meta.get("lowbit_layout"), str) and (
                    v in src_of or _reads_codes(v, set(src_of))):
                out.replace_input_with(v, self._float_layout(src, v))

    def _float_layout(self, src: fx.Node, deq: fx.Node) -> fx.Node:
        """``deq`` (``src`` dequantized, or a float ``src`` itself) laid out as the float model's value
        (``meta["lowbit_layout"]``, recorded on the example inputs; row-major when not recorded), for a reader of its
        memory layout: an int8 conv's codes are channels-last, so ``y.as_strided((n, 4, 36), (144, 36, 1))`` written
        for the float model's row-major ``y`` read the wrong elements (-2.5 dB); ``torch.cat`` of two such values (in
        float) is channels-last too (-2.7 dB). ``contiguous(memory_format=...)`` returns a tensor already so laid
        out as it is."""
        name = src.meta.get("lowbit_layout", "contiguous_format")
        if name is None:  # (a strided view in the float model: as it was)
            return deq
        fmt = getattr(torch, name)
        for user in deq.users:
            if user.op == "call_method" and user.target == "contiguous" and user.kwargs.get("memory_format") == fmt:
                return user
        with self.graph.inserting_after(deq):
            new = self.graph.call_method("contiguous", (deq,), {"memory_format": fmt})
        new.meta.update(lowbit_kind="share", lowbit_domain="float", lowbit_ftensor=True, lowbit_inserted=True)
        return new

    def identities(self) -> None:
        """Dropout (inference), leftover stubs and a bilinear resample's second observer call (obs_share) become identities."""
        from ..stubs import DeQuantStub, QuantStub
        for node in list(self.graph.nodes):
            mod = self.gm.get_submodule(node.target) if node.op == "call_module" else None
            if is_dropout(node, mod) or isinstance(mod, (QuantStub, DeQuantStub)) or node.meta.get("lowbit_kind") == "obs_share":
                node.replace_all_uses_with(node.args[0])
                self.graph.erase_node(node)
