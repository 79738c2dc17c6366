"""Probe: MiniLM with 7-bit per-token dynamic activations (one exact oneDNN call without VNNI).

Monkeypatches ``lowbit.nn.quantized.dynamic.linear.dynamic_linear`` for the run only (a recipe study,
not a lowbit feature yet): per-row grids on ``[0, 127]``, so the kernel makes one exact call without
VNNI. Run: ``python benchmarks/dynamic7_probe.py [OUT]``; writes ``benchmarks/results/OUT.json``
(default ``minilm_dynamic7_probe``).
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
from lowbit.kernels import onednn
from lowbit.nn.quantized.dynamic import per_token
from lowbit.qtensor import QTensor

U7 = Q.quint8.with_range(0, 127)
orig = DL.dynamic_linear
_C127, _CM64 = torch.tensor(127.0), torch.tensor(-64.0)
_SHARED7 = (torch.tensor(1.0), torch.tensor(64), U7)  # the codes' shared kernel grid: 7-bit, one exact call


def dyn7(x2, weight_int8, w_scale, w_zero_point, qdtype, bias, cache):
    """``dynamic_linear`` with 7-bit per-token codes (``[0, 127]`` per row): the kernel sees a 7-bit grid
    and makes one call without VNNI; the per-row grids enter in the same epilogue as the 8-bit path."""
    xf = x2.detach().float()
    lo = xf.amin(1, keepdim=True).clamp_(max=0.0)
    scale = xf.amax(1, keepdim=True).clamp_(min=0.0).sub_(lo).div_(_C127).clamp_(min=1e-8)
    neg_zp = lo.div_(scale).round_()
    q = torch.mul(xf, torch.reciprocal(scale)).sub_(neg_zp).round_().clamp_(0, 127).byte()
    weight = QTensor._trusted(weight_int8, w_scale, w_zero_point, qdtype, axis=0)
    raw = onednn.linear(QTensor._trusted(q, *_SHARED7), weight, None, None, False, cache)
    wsum = per_token._weight_row_sums(weight, cache)
    return per_token._epilogue(raw, torch.sub(_CM64, neg_zp), wsum, scale, bias)  # c = z_x - 64


class Seven(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, **kw):
        DL.dynamic_linear = dyn7
        try:
            return self.m(**kw)
        finally:
            DL.dynamic_linear = orig


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
common.write_results(sys.argv[1] if len(sys.argv) > 1 else "minilm_dynamic7_probe", {"cosine_to_fp32": cos, "threads": 1, **s})
