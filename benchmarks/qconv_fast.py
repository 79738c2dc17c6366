"""The compiled conv op's fast entry (``pt2.kernel_ops._arm_fast``): its body against the full one, and compiled SmallCNN.

Run: ``python benchmarks/qconv_fast.py [batch [rounds]]`` (defaults 1, 21; prints the ISA first). For SmallCNN's two planned convs
(conv2, conv3; converted, default recipe), interleaved, medians of the rounds of thread CPU time, 1 thread: the eager
module, ``kernel_ops.qconv_cfg`` (the op body as the dispatcher calls it: the fast entry after arming) and the full
body (``_qconv`` with no config: the body before session 49), the paired saving; then the whole SmallCNN eager,
compiled, and compiled with the fast entries dropped before every round (``_arm_fast`` a no-op: each conv call then
pays one dict miss more than the old body did).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import lowbit as Q
from lowbit.compile_state import conv_config, qdtype_key
from lowbit.examples import SmallCNN
from lowbit.pt2 import kernel_ops as K

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
print(common.isa_line())
torch.manual_seed(0)
m = Q.fuse_modules(SmallCNN().eval(), SmallCNN.fusion_groups())
p = Q.prepare(copy.deepcopy(m), Q.get_default_qconfig())
with torch.inference_mode():
    p(torch.randn(128, 1, 28, 28))
m = Q.convert(p)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
x = torch.randn(B, 1, 28, 28)
got, hooks = {}, []
for name in ("conv2", "conv3"):
    mod = getattr(m, name)
    hooks.append(mod.register_forward_hook(lambda mod, a, y, name=name: got.setdefault(name, (mod, a[0])) and None))
with torch.inference_mode():
    m(x)
for h in hooks:
    h.remove()
calls = {}
for name, (mod, xq) in got.items():
    w = mod.weight()
    sp = mod._spec
    cfg = conv_config(qdtype_key(xq.qdtype), qdtype_key(w.qdtype), qdtype_key(mod.out_qdtype), mod._relu, list(sp.stride),
                      list(sp.padding), list(sp.dilation), sp.groups, False, [0] * sp.dim)
    args = (xq.int_repr(), xq.scale, xq.zero_point, mod.weight_int8, mod.weight_scale, mod.weight_zero_point, mod.bias,
            mod.scale, mod.zero_point)
    def old(args=args, cfg=cfg):
        (x_qd, w_qd, out_qd, relu), geometry, nlc, spec = K._cfg_args(cfg)
        a = args
        return K._qconv("qconv_cfg", a[0], a[1], a[2], x_qd, a[3], a[4], a[5], w_qd, a[6], a[7], a[8], out_qd, relu,
                        *geometry, checked_spec=spec, nlc=nlc)
    new = lambda args=args, cfg=cfg: K.qconv_cfg(*args, cfg)
    eager = lambda mod=mod, xq=xq: mod(xq)
    with torch.inference_mode():
        for _ in range(3):
            old(), new(), eager()
        assert torch.equal(old(), new()) and torch.equal(new(), eager().int_repr())
        assert K._CACHES[id(mod.weight_int8)][1].get(cfg) is not None, "fast entry not armed"
    calls[name] = {"eager module": eager, "op body old": old, "op body new": new}

def measure(meths, rounds, reps=200):
    res = {k: [] for k in meths}
    keys = list(meths)
    for r in common.round_bar(rounds, "qconv_fast rounds"):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            f, t0 = meths[k], time.thread_time_ns()
            for _ in range(reps):
                f()
            res[k].append((time.thread_time_ns() - t0) / reps / 1e3)
    return res
R = int(sys.argv[2]) if len(sys.argv) > 2 else 21
with torch.inference_mode():
    for name, meths in calls.items():
        res = measure(meths, R)
        d = statistics.median(a - b for a, b in zip(res["op body old"], res["op body new"]))
        print(f"b{B} {name}: " + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in res.items())
              + f" us | new saves {d:5.1f} us (paired)", flush=True)
    torch._dynamo.reset()
    c = torch.compile(m, fullgraph=True, dynamic=False)
    c(x); c(x)
    assert torch.equal(c(x), m(x))
    real = K._arm_fast
    def drop():
        for _, cache in list(K._CACHES.values()):
            for k in [k for k in cache if isinstance(k, str) and "|" in k]:
                del cache[k]
    state = {"fast": True}
    def comp_fast():
        if not state["fast"]:
            K._arm_fast = real; state["fast"] = True
        return c(x)
    def comp_old():
        if state["fast"]:
            K._arm_fast = lambda *a, **k: None; drop(); state["fast"] = False
        return c(x)
    res = measure({"eager": lambda: m(x), "compiled fast": comp_fast, "compiled no fast entry": comp_old}, R, 50)
    K._arm_fast = real
    d = statistics.median(a - b for a, b in zip(res["compiled no fast entry"], res["compiled fast"]))
    print(f"SmallCNN b{B}: " + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in res.items())
          + f" us | fast entry saves {d:5.1f} us (paired)")
