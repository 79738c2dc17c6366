"""Probe: MiniLM with 7-bit per-token dynamic activations (one exact oneDNN call without VNNI).

Monkeypatches ``lowbit.nn.quantized.dynamic.linear`` for the run only (a recipe study, not a
lowbit feature yet). Run: ``python benchmarks/dynamic7_probe.py``; writes
``benchmarks/results/minilm_dynamic7_probe.json``.
"""

import copy
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
import lowbit.nn.quantized.dynamic.linear as DL
from lowbit import data as D
from lowbit import kernels
from lowbit.functional import quantize
from lowbit.qparams import calculate_qparams
from lowbit.qscheme import QScheme
from lowbit.qtensor import QTensor

U7 = Q.quint8.with_range(0, 127)
orig = (DL.quantize_per_token, DL.per_token_linear)


def qpt7(x):
    xf = x.detach().float()
    lo, hi = torch.aminmax(xf, dim=1)
    s, z = calculate_qparams(lo, hi, QScheme.PER_CHANNEL_AFFINE, U7, validate=False)
    return QTensor(quantize(xf, s, z, U7, ch_axis=0), s, z, U7, axis=0)


def ptl7(xq, weight, bias=None, cache=None):
    raw = kernels.linear(QTensor(xq.int_repr(), 1.0, 64, U7), weight, None, None, cache=cache)
    wsum = DL._weight_row_sums(weight, cache)
    y = (raw - (xq.zero_point - 64).float()[:, None] * wsum) * xq.scale[:, None]
    return y if bias is None else y + bias


class Seven(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, **kw):
        DL.quantize_per_token, DL.per_token_linear = qpt7, ptl7
        try:
            return self.m(**kw)
        finally:
            DL.quantize_per_token, DL.per_token_linear = orig


torch.set_num_threads(1)
tok, model = D.load_minilm()
docs = D.load_lee_corpus()[1]
lb = Q.quantize_dynamic(copy.deepcopy(model))
lb7 = Seven(lb)
torch.backends.quantized.engine = "x86"
ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
ref = D.embed_sentences(tok, model, docs)
cos = {
    k: float((D.embed_sentences(tok, m, docs) * ref).sum(1).mean())
    for k, m in {"lowbit dynamic u8": lb, "lowbit dynamic u7 (probe)": lb7, "torch.ao dynamic": ao}.items()
}
print("cosine", cos, flush=True)
enc = tok(docs[:32], padding=True, truncation=True, max_length=128, return_tensors="pt")
kw = dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
meth = {
    "fp32": lambda: model(**kw),
    "lowbit dynamic u8": lambda: lb(**kw),
    "lowbit dynamic u7 (probe)": lambda: lb7(**kw),
    "torch.ao dynamic": lambda: ao(**kw),
}
T = common.bench(meth, rounds=5, min_time=0.02, max_wait=1.0)
s = T.summary("fp32")
print(s)
common.write_results("minilm_dynamic7_probe", {"cosine_to_fp32": cos, "threads": 1, **s})
