"""MiniLM with every encoder Linear dynamic int8, exported to ONNX and run by ONNX Runtime.

Run: ``python benchmarks/onnx_dynamic_minilm.py [--docs 16] [--tokens 128] [--out NAME]``. Prints the ISA, then prints and writes
``benchmarks/results/NAME.json`` (default ``onnx_dynamic_minilm``): sentence-embedding cosine ORT vs lowbit and each vs
fp32 on the first ``--docs`` ``lee_background`` documents, the ONNX file sizes (int8 vs an fp32
export of the same model), and ORT's op counts (``MatMulInteger`` vs float ``MatMul``).

The float references are computed before anything is exported: ``torch.onnx.export`` of the fp32
``BertModel`` changes that model's own later outputs (cosine 0.97 to its earlier ones, measured here),
while ``lowbit.export.to_onnx`` leaves the quantized model untouched (cosine 1.00000, printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import lowbit as Q  # noqa: E402
from lowbit import data as D  # noqa: E402
from lowbit.data import Encoder, mean_pool as embed  # noqa: E402
from lowbit.export import run_onnx, to_onnx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=common.positive_int, default=16)
    ap.add_argument("--tokens", type=common.positive_int, default=128)
    ap.add_argument("--out", default="onnx_dynamic_minilm", help="results name (benchmarks/results/OUT.json)")
    args = ap.parse_args()
    print(common.isa_line(), flush=True)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import onnx

    tok, model = D.load_minilm()
    qm = Q.quantize_dynamic(model.eval(), {nn.Linear})
    docs = D.load_lee_corpus()[0][: args.docs]
    enc = tok(docs, padding="max_length", truncation=True, max_length=args.tokens, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():  # before exporting: tracing may switch the model's attention implementation
        ref, fp = Encoder(qm)(ids, mask), Encoder(model)(ids, mask)
    with tempfile.TemporaryDirectory() as d:
        int8_path = to_onnx(Encoder(qm), (ids[:2], mask[:2]), Path(d) / "int8.onnx")
        with torch.no_grad():
            torch.onnx.export(Encoder(model), (ids[:2], mask[:2]), str(Path(d) / "fp32.onnx"), dynamo=False,
                              input_names=["ids", "mask"], dynamic_axes={"ids": {0: "b"}, "mask": {0: "b"}})
        sizes = {k: (Path(d) / f"{k}.onnx").stat().st_size / 2**20 for k in ("int8", "fp32")}
        ops = Counter(n.op_type for n in onnx.load(str(int8_path)).graph.node)
        out = torch.as_tensor(run_onnx(int8_path, ids, mask)[0])
    with torch.no_grad():
        after = Encoder(qm)(ids, mask)
    e_ort, e_lb, e_fp = embed(out, mask), embed(ref, mask), embed(fp, mask)
    cos = {"ort_vs_lowbit": (e_ort * e_lb).sum(-1), "ort_vs_fp32": (e_ort * e_fp).sum(-1),
           "lowbit_vs_fp32": (e_lb * e_fp).sum(-1),
           "lowbit_after_export_vs_before": (embed(after, mask) * e_lb).sum(-1)}
    rows = [[k, f"{float(v.mean()):.5f}", f"{float(v.min()):.5f}"] for k, v in cos.items()]
    print(common.md_table(["cosine", "mean", "worst"], rows))
    print(f"\nONNX file: int8 {sizes['int8']:.1f} MB, fp32 {sizes['fp32']:.1f} MB; "
          f"MatMulInteger {ops['MatMulInteger']}, float MatMul {ops['MatMul']}")
    path = common.write_results(args.out, {
        "docs": args.docs, "tokens": args.tokens, "sizes_MB": sizes, "ops": dict(ops),
        "cosine": {k: {"mean": float(v.mean()), "worst": float(v.min())} for k, v in cos.items()}})
    print(path)


if __name__ == "__main__":
    main()
