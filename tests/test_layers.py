"""Architecture checks: imports only go down the layer stack of docs/design.md, and ``import lowbit``
is cheap (no optional dependency, no GPU initialisation)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"

# The layer stack of docs/design.md, bottom first. A module may import its own tier and the tiers
# below it, never one above. Paths are dotted prefixes under ``lowbit``; the longest prefix wins.
TIERS: list[tuple[str, ...]] = [
    ("qscheme", "runtime"),             # runtime: process settings (glibc malloc), imports nothing of lowbit
    ("compile_state", "fx_leaves"),   # tracing(): lower layers emit torch.ops.lowbit.* while traced; fx_leaves:
    # lowbit modules as one call_module node in any torch.fx trace (FxLeaf)
    ("qparams",),
    ("blocked", "qstore", "native", "rounding"),  # cache-blocked exact quantize; one-pass 8-bit codes; C row passes;
    # rounding: quantize's code formula round(x · fl(1/s) + z), shared with the rounding algorithms
    ("state_check",),                  # check_quantized_state: a checkpoint's scales, zero points, codes
    ("functional",),
    ("qtensor", "qtensor.convert", "qtensor.order", "qtensor.resample", "batches"),  # convert: to / type / dtype
    # casts; order: sort / max ... on codes; resample: bilinear on codes; batches: iter_batches, run_batch
    ("observer", "observer.collectives"),  # collectives: the tensor reductions and handshake (from observer.distributed)
    ("fake_quant",),                   # package: base, learnable, fused, fixed
    ("qconfig",),
    ("custom_config", "fusion_registry", "recipes"),  # config objects, the user pattern registry, recipes
    ("stubs", "kernels", "kernels.avx2", "kernels.plan", "kernels.conv_transpose"),  # avx2: exact split / fbgemm without
    # VNNI; plan: eager floor; conv_transpose: a transposed conv as one ordinary conv
    ("nn.intrinsic",),                 # fused float markers and BN folding
    ("nn.qat",),
    ("nn.intrinsic.qat",),             # QAT ConvBn builds on nn.qat
    ("nn.quantized", "nn.quantized.group_codes"),  # (+ dynamic/) run on kernels; group_codes: weight-only codes
    ("mappings", "examples", "speed_guard", "pt2"),
    ("fuse", "workflow", "quantize_dynamic", "weight_only", "llm", "llm.plan", "fx", "fx.fusion", "fx.converter",
     "fx.islands", "fx.masks", "fx.child_reads", "fx.observed_rules", "quantize_api", "reference"),
    # fx.fusion: fuse_graph, split from fx.patterns; fx.converter: from fx.convert; fx.islands: the elementwise int
    # ops kept float (from fx.classify); fx.masks: attention masks and the sums they enter kept float; fx.child_reads:
    # an untraceable forward's reads of its children's attributes kept on their prepared graphs; fx.observed_rules:
    # convert_fx's decisions from the calibration ranges (a scalar product's collapsed grid, a child graph's mask
    # without example inputs)
    ("export", "export.weighted", "export.conv_epilogue", "algorithms", "algorithms.layerwise_step", "algorithms.equalize_pairs",
     "algorithms.end_to_end", "debug", "debug.float_swap", "debug.float_twins", "debug.graph_swap", "debug.swap_edges",
     "debug.swap_islands", "data"),
    # export.weighted: the QDQ twin of a quantized Linear / Conv (split from export.qdq); export.conv_epilogue: exact
    # Conv epilogues as depthwise 1x1 Convs (ORT's NCHWc keeps them);
    # end_to_end: the loop tune / distill share;
    # layerwise_step:
    # one layer's rounding step; equalize_pairs: CLE's pairs and channel maps (split from layerwise / equalize);
    # debug.float_swap: the fast mixed-precision search's float twins (split from debug.mixed_precision);
    # debug.float_twins: the float twins themselves and eager mode's input grids (split from debug.float_swap);
    # debug.graph_swap: its graph-mode part (ops by call-order key, a reused layer's calls, gates; from float_swap)
    # debug.swap_edges: share-op ends, shared-Quantize picks, plain float copies (split from graph_swap)
    # debug.swap_islands: fx.islands' rule on the prepared graphs for the fast search, function activations it keeps float
    ("report", "ptq", "ptq_checks", "ptq_steps", "models"),  # debug results rendered; quantize_ptq (fx + algorithms),
    # its checks, its equalize / refine steps (ptq_steps: the model's graph and its child graphs); CNNs
    ("__init__",),                     # the package root: re-exports the public names of all of the above
    ("cli", "cli.gguf_file", "__main__"),  # gguf_file: quantize-llm's check of a .gguf header before transformers
]
RANK = {prefix: i for i, tier in enumerate(TIERS) for prefix in tier}
OPTIONAL = ("onnx", "onnxruntime", "matplotlib", "transformers", "gensim", "safetensors", "tokenizers")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rank(mod: str) -> int | None:
    """Tier of ``mod`` (dotted, relative to ``lowbit``); ``None`` for a bare package such as ``nn``."""
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return RANK[".".join(parts[:n])]
    return None


def is_module(mod: str) -> bool:
    p = SRC.joinpath(*mod.split(".")) if mod else SRC
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists() or p.is_dir()


def exempt(node: ast.AST, parents: dict[ast.AST, ast.AST], is_init: bool) -> bool:
    """Imports that are no runtime dependency: under ``if TYPE_CHECKING:``, or a package's lazy
    PEP 562 re-export (``def __getattr__`` in an ``__init__.py``, resolved only when the name is used)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
        if is_init and isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and isinstance(
                parents.get(node), ast.Module):
            return True
    return False


def lowbit_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` for every runtime import of a lowbit module (targets relative to ``lowbit``)."""
    tree = ast.parse(path.read_text())
    parents, imports = {}, []  # one walk: every node's parent, and the import nodes in walk order
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
    me = module_name(path).split(".") if module_name(path) else []
    package = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in imports:  # only import nodes are checked (before: exempt()'s ancestor walk, with an ast.unparse
        # of every enclosing `if` test, ran on every node of the tree; 13.5 s -> ~1 s, same result)
        if exempt(node, parents, path.name == "__init__.py"):
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix("lowbit").lstrip(".")) for a in node.names
                    if a.name == "lowbit" or a.name.startswith("lowbit.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + (node.module or "").split("."))
            elif node.module and (node.module == "lowbit" or node.module.startswith("lowbit.")):
                base = node.module.removeprefix("lowbit").lstrip(".")
            else:
                continue
            base = base.strip(".")
            for a in node.names:  # `from .nn import qat` imports the submodule nn.qat
                sub = f"{base}.{a.name}".strip(".")
                out.append((node.lineno, sub if is_module(sub) else base))
    return out


def test_every_module_has_a_tier():
    missing = sorted(m for p in SRC.rglob("*.py") if (m := module_name(p)) and rank(m) is None
                     and not (p.name == "__init__.py"))
    assert not missing, f"modules not in the layer stack of docs/design.md (add them there and to TIERS): {missing}"


def design_layout() -> list[str]:
    """Top-level entries of the ``## Layout`` block of docs/design.md, in order (``nn/qat/`` -> ``nn.qat``)."""
    text = (SRC.parents[1] / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries = []
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line.strip():
            token = line.split()[0]
            if token.endswith((".py", "/")):
                entries.append(token.removesuffix(".py").strip("/").replace("/", "."))
    return entries


def test_tiers_follow_docs_design_md():
    entries = design_layout()
    assert "qscheme" in entries and "qconfig" in entries, entries
    assert [e for e in entries if e not in RANK] == [], "docs/design.md lists modules missing from TIERS"
    ranks = [RANK[e] for e in entries]
    assert ranks == sorted(ranks), f"TIERS order disagrees with docs/design.md: {list(zip(entries, ranks))}"


def test_imports_only_go_down_the_layer_stack():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        me = module_name(path)
        if not me:  # lowbit/__init__.py re-exports everything
            continue
        my_rank = rank(me)
        if my_rank is None:  # a bare package __init__ (e.g. nn/): takes the highest tier below it
            my_rank = max((r for p in SRC.joinpath(*me.split(".")).rglob("*.py")
                           if (r := rank(module_name(p))) is not None), default=len(TIERS))
        for line, target in lowbit_imports(path):
            target_rank = RANK["__init__"] if target == "" else rank(target)  # `import lowbit`
            if target_rank is not None and target_rank > my_rank:
                bad.append(f"{path.relative_to(SRC)}:{line} ({me}, tier {my_rank}) imports {target or 'lowbit'} "
                           f"(tier {target_rank})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_layer_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # the checker itself: a fake qparams.py importing qconfig must be reported
    fake = tmp_path / "lowbit"
    fake.mkdir()
    (fake / "qparams.py").write_text("from .qconfig import QConfig\nfrom . import qscheme\n"
                                     "def __getattr__(name):\n    from .qconfig import QConfigMapping\n")
    (fake / "qconfig.py").write_text("")
    (fake / "qscheme.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    targets = [(t, rank(t)) for _, t in lowbit_imports(fake / "qparams.py")]
    # (a lazy import in a plain module's __getattr__ still counts: only package facades are exempt)
    assert targets == [("qconfig", RANK["qconfig"]), ("qscheme", RANK["qscheme"]), ("qconfig", RANK["qconfig"])]
    (fake / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import cli\n"
                                      "def __getattr__(name):\n    from . import cli\n")
    assert lowbit_imports(fake / "__init__.py") == []  # typing-only and lazy package re-exports are exempt
    assert rank("qparams") < rank("qconfig") and rank("nn.intrinsic.qat.modules") == RANK["nn.intrinsic.qat"]


def test_import_is_cheap():
    """``import lowbit`` loads no optional dependency and not ``lowbit.debug``, and initialises no GPU; importing
    every submodule after it (``lowbit.data``, ``lowbit.examples``, ``lowbit.report`` among them) still loads no
    optional dependency: gensim / transformers come with the data, matplotlib when a report draws. One fresh
    interpreter for all of it (test_report and test_realdata_api each started one for a part of it before)."""
    mods = sorted({module_name(p) for p in SRC.rglob("*.py")} - {""})

    def probe(names: tuple[str, ...]) -> str:
        return f"print(sorted(m for m in {names!r} if m in sys.modules), torch.cuda.is_initialized())"
    res = subprocess.run([sys.executable, "-c", "\n".join([
        "import importlib, sys, lowbit, torch", probe(OPTIONAL + ("lowbit.debug",)),
        f"for m in {mods!r}: importlib.import_module('lowbit.' + m)", probe(OPTIONAL),
    ])], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["[] False", "[] False"]
