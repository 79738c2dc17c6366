"""Per-call overhead of a static int8 Linear at M = 1 (1×768×768, 1 thread): where the time goes.

Run: ``python benchmarks/overhead.py``; writes ``benchmarks/results/overhead_m1.json``. Interleaved like
``common.bench``; each line adds one layer of the call stack on top of the previous one.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import warnings

import common
import torch

warnings.filterwarnings("ignore")
import torch.nn.functional as F

import lowbit as Q
from lowbit import kernels
from lowbit.kernels import onednn
from lowbit.nn.quantized import Linear as QLinear

torch.set_num_threads(1)
torch.backends.quantized.engine = "x86"
lin = torch.nn.Linear(768, 768)
x = torch.randn(1, 768)
w = lin.weight.detach()
b = lin.bias.detach()
s = w.abs().amax(1) / 127
wq = Q.quantize_per_channel(w, s, torch.zeros(768, dtype=torch.long), 0, Q.qint8)
qd = Q.quint8.with_range(0, 127)
m = QLinear.from_reference(lin, wq, 0.05, 64, qd)
m.input_grid = (0.03, 64, qd)
xq = Q.QTensor(Q.quantize(x, 0.03, 64, qd), 0.03, 64, qd)
weight, out = m._prepared()
cache = m._cache
kernels.linear(xq, weight, m.bias, out, False, cache)
pk = cache["onednn.fbgemm_q"][1]
q = xq.int_repr()
aw = torch._make_per_channel_quantized_tensor(wq.int_repr(), s.double(), torch.zeros(768, dtype=torch.long), 0)
apk = torch.ops.quantized.linear_prepack(aw, b)
meth = {
    "fp32 F.linear": lambda: F.linear(x, w, b),
    "ao static full (q->qlinear->dq)": lambda: torch.ops.quantized.linear(
        torch.quantize_per_tensor(x, 0.03, 64, torch.quint8), apk, 0.05, 64
    ).dequantize(),
    "lowbit static full (float in, dequantize out)": lambda: m(x).dequantize(),
    "lowbit module forward (QTensor in)": lambda: m(xq),
    "kernels.linear (dispatch)": lambda: kernels.linear(xq, weight, m.bias, out, False, cache),
    "onednn.linear (backend)": lambda: onednn.linear(xq, weight, m.bias, out, False, cache),
    "fbgemm op only": lambda: torch.ops.quantized.linear(
        torch._make_per_tensor_quantized_tensor(q, 0.03, 64), pk, 0.05, 64
    ),
    "lowbit quantize(x) (input)": lambda: Q.quantize(x, 0.03, 64, qd),
    "QTensor.dequantize (output)": lambda: xq.dequantize(),
}
T = common.bench(meth, rounds=7, min_time=0.05, max_wait=2.0)
rows = {k: T.median(k) * 1e6 for k in meth}
for k, v in rows.items():
    print(f"{k:48s} {v:7.1f} us")
print("clean", T.n_clean, "load", T.summary()["other_load_median"])
common.write_results("overhead_m1", {"shape": "1x768x768", "threads": 1, "us": rows, "clean_rounds": T.n_clean})
