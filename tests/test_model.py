"""The nn layers and the hybrid model on CPU: LoRA, chunked cross-entropy, sequence bounds, the
model on the native kernels against the same model on reference ops (float64: loss and every
gradient), LoRA training, router-bias balancing and configuration errors."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from kda_dsa_ops import reference as R
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.nn import LoRALinear, Rope, ShortConv, chunked_linear_cross_entropy, positions_in_sequence
from kda_dsa_ops.nn.backend import get_backend

from tolerances import MODEL_REL_RMS, assert_close

F64 = torch.float64


def packed_batch(cfg, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    tokens = torch.randint(0, cfg.vocab, (T,), generator=g)
    labels = torch.randint(0, cfg.vocab, (T,), generator=g)
    labels[0] = -100  # ignored
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return tokens, cu, labels


def test_lora_linear_freezes_the_base_and_merges():
    torch.manual_seed(0)
    layer = LoRALinear(12, 7, rank=4, alpha=8.0)
    x = torch.randn(5, 12)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_a", "lora_b"]
    assert torch.equal(layer(x), layer.base(x))  # a fresh adapter changes nothing
    layer.lora_b.data.normal_()
    y = layer(x)
    layer.merge()
    torch.testing.assert_close(layer(x), y)
    layer.unmerge()
    torch.testing.assert_close(layer(x), y)
    torch.testing.assert_close(layer.base(x), x @ layer.base.weight.t())


@pytest.mark.parametrize("rows", ["kernel", "reference"])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_cross_entropy_matches_full(chunk, rows):
    """Loss, accuracy and both gradients (each alone too) against F.cross_entropy on the whole
    logits; without grad mode only the loss is computed, and it is the same."""
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=F64, requires_grad=True)
    w = torch.randn(30, 16, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 30, (50,))
    labels[::5] = -100
    fn = R.cross_entropy_rows_ if rows == "reference" else None
    loss, accuracy = chunked_linear_cross_entropy(h, w, labels, chunk=chunk, rows=fn, with_accuracy=True)
    logits = h @ w.t()
    ref = F.cross_entropy(logits, labels, ignore_index=-100)
    assert_close(loss, ref, F64, "loss")
    labelled = labels != -100
    assert accuracy == (logits[labelled].argmax(-1) == labels[labelled]).double().mean()
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert_close(a, b, F64, "grad")
    for wrt in (h, w):
        other = w if wrt is h else h
        other.requires_grad_(False)
        (a,) = torch.autograd.grad(chunked_linear_cross_entropy(h, w, labels, chunk=chunk, rows=fn), wrt)
        (b,) = torch.autograd.grad(F.cross_entropy(h @ w.t(), labels), wrt)
        assert_close(a, b, F64, "grad alone")
        other.requires_grad_(True)
    with torch.no_grad():
        assert_close(chunked_linear_cross_entropy(h, w, labels, chunk=chunk, rows=fn), ref, F64, "no-grad loss")


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_short_conv_stays_inside_each_sequence(backend):
    torch.manual_seed(0)
    conv, ops = ShortConv(6, 4), get_backend(backend)
    x = torch.randn(11, 6)
    cu = torch.tensor([0, 2, 11], dtype=torch.int32)
    y = conv(x, positions_in_sequence(cu, 11), ops)
    for a, b in ((0, 2), (2, 11)):
        torch.testing.assert_close(y[a:b], conv(x[a:b], torch.arange(b - a), ops))


def test_model_native_matches_reference_float64():
    """The same weights on the native kernels and on the reference ops: equal loss and gradients."""
    torch.manual_seed(0)
    cfg = get_config("tiny", dsa_topk=16)
    model = HybridModel(cfg).double()
    tokens, cu, labels = packed_batch(cfg, [37, 1, 90])
    results = []
    for backend in ("native", "reference"):
        model.set_backend(backend)
        model.zero_grad()
        out = model(tokens, cu, labels)
        out["loss"].backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (out, grads), (out_ref, grads_ref) = results
    for key in ("loss", "lm_loss", "indexer_loss"):
        assert_close(out[key], out_ref[key], F64, key, table=MODEL_REL_RMS)
    assert grads.keys() == grads_ref.keys() and len(grads) > 20
    for name in grads:
        assert_close(grads[name], grads_ref[name], F64, name, table=MODEL_REL_RMS)


def test_shared_indexer_layer_runs_no_indexer_and_asks_for_no_probabilities():
    """pattern KDD, index_pattern FFS (read at D layers): the second sparse layer reuses the first
    one's indices; the indexer runs once and only the first layer's attention returns
    probabilities (for its loss)."""
    torch.manual_seed(0)
    cfg = get_config("tiny", dsa_topk=16, pattern="KDD", index_pattern="FFS", layers=3)
    model = HybridModel(cfg).double()
    base = get_backend("native")
    calls = []

    def attention(*args, **kwargs):
        calls.append(("attention", kwargs.get("return_p", False)))
        return base.sparse_attention(*args, **kwargs)

    def indexer(*args, **kwargs):
        calls.append(("indexer", None))
        return base.lightning_indexer(*args, **kwargs)

    model.backend = type(base)(**{**vars(base), "sparse_attention": attention, "lightning_indexer": indexer})
    tokens, cu, labels = packed_batch(cfg, [40, 25])
    model(tokens, cu, labels)["loss"].backward()
    assert calls == [("indexer", None), ("attention", True), ("attention", False)]


@pytest.mark.parametrize("recompute, offload", [("attention", False), ("block", False), ("none", True),
                                               ("block", True)])
def test_recompute_and_offload_change_no_number(recompute, offload):
    torch.manual_seed(0)
    cfg = get_config("tiny", dsa_topk=16)
    model = HybridModel(cfg).double()
    tokens, cu, labels = packed_batch(cfg, [30, 50])
    results = []
    for r, o in (("none", False), (recompute, offload)):
        model.recompute, model.offload = r, o
        model.zero_grad()
        loss = model(tokens, cu, labels)["loss"]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_lora_training_moves_only_adapters_and_lowers_the_loss():
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = HybridModel(cfg, lora_rank=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tokens, cu, labels = packed_batch(cfg, [64, 64])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(tokens, cu, labels)["lm_loss"]
        loss.backward()
        opt.step()
        model.update_router_biases()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_router_bias_moves_toward_balance():
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = HybridModel(cfg)
    tokens, cu, labels = packed_batch(cfg, [100])
    model(tokens, cu, labels)
    moe = model.blocks[0].mlp
    load = moe.expert_load.clone()
    model.update_router_biases()
    over, under = load > load.mean(), load < load.mean()
    assert (moe.router_bias[over] < 0).all() and (moe.router_bias[under] > 0).all()


@pytest.mark.parametrize("overrides, message", [
    ({"dsa_topk": 4096}, r"dsa_topk must be in \[1, 2048\]"),
    ({"moe_topk": 9}, r"moe_topk must be in \[1, experts = 8\]"),
    ({"pattern": "KKX"}, "pattern must be made of"),
    ({"kda_value_heads": 3}, "must be a multiple of kda_heads"),
    ({"ffn_pattern": "FM"}, r"dense layers \('F' in ffn_pattern\) need dense_ffn > 0"),
    ({"moe_groups": 3}, r"moe_groups \(3\) must divide experts \(8\)"),
    ({"rope": Rope("spiral")}, "rope style must be one of"),
    ({"index_style": "deepseek", "dsa_q_rank": 0}, "the deepseek indexer reads the q latent"),
])
def test_bad_config_fails_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **overrides)


def image_batch(cfg, seed=0):
    """Two sequences mixing text and images: [text, image, text] and [image, text]."""
    g = torch.Generator().manual_seed(seed)
    patches = (cfg.image_size // cfg.patch) ** 2
    img = torch.full((patches,), cfg.image_token)
    seq1 = torch.cat([torch.randint(0, cfg.vocab - 1, (5,), generator=g), img,
                      torch.randint(0, cfg.vocab - 1, (7,), generator=g)])
    seq2 = torch.cat([img, torch.randint(0, cfg.vocab - 1, (9,), generator=g)])
    tokens = torch.cat([seq1, seq2])
    labels = torch.where(tokens == cfg.image_token, -100, torch.roll(tokens, -1))
    cu = torch.tensor([0, len(seq1), len(seq1) + len(seq2)], dtype=torch.int32)
    images = torch.rand(2, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    return tokens, cu, labels, images


def test_images_pack_with_text_and_train_the_front_end():
    torch.manual_seed(0)
    cfg = get_config("tiny", image_size=16, patch=8, dsa_topk=16)
    model = HybridModel(cfg).double()
    tokens, cu, labels, images = image_batch(cfg)
    results = []
    for backend in ("native", "reference"):
        model.set_backend(backend)
        model.zero_grad()
        out = model(tokens, cu, labels, images.double())
        out["loss"].backward()
        results.append((out["loss"].detach(), model.vision.embed.weight.grad.clone()))
    assert results[0][1].abs().sum() > 0  # the images reach the loss
    assert_close(results[0][0], results[1][0], F64, "loss", table=MODEL_REL_RMS)
    assert_close(results[0][1], results[1][1], F64, "patch embedding grad", table=MODEL_REL_RMS)
    other = model(tokens, cu, labels, torch.rand_like(images).double())["loss"]
    assert other.item() != results[0][0].item()  # other images, other loss
    with pytest.raises(ValueError, match=r"the images give 4 image tokens, the batch has 8 placeholders"):
        model(tokens, cu, labels, images[:1].double())


@pytest.mark.filterwarnings("error")  # torch's fused RMSNorm refuses bf16 input with fp32 weights, warning
def test_model_trains_under_bf16_autocast():
    """The precision train.py uses on CUDA (bf16 products, fp32 master weights and router)."""
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = HybridModel(cfg)
    tokens, cu, labels = packed_batch(cfg, [40, 25])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, cu, labels)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and all(p.dtype == torch.float32 for p in model.parameters())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("device", DEVICES)
def test_activation_offload_prefetches_one_block_ahead(device):
    """Each block's saved tensors leave for host memory in the forward and come back one block
    ahead of the backward; the gradients are those without offload."""
    import contextlib

    from kda_dsa_ops.nn.offload import ActivationOffload

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).to(device) for _ in range(4)]
    x0 = torch.randn(512, 64, device=device, requires_grad=True)
    params = [x0] + [p for b in blocks for p in b.parameters()]

    def grads(offload):
        x = x0
        for i, b in enumerate(blocks):
            with offload.block(i) if offload else contextlib.nullcontext():
                x = b(x)
        return torch.autograd.grad(x.square().sum(), params)

    offload = ActivationOffload(torch.device(device), min_bytes=0)
    for a, b in zip(grads(offload), grads(None)):
        assert torch.equal(a, b)
    assert offload.events == [("backward", 3), ("fetch", 3), ("fetch", 2), ("backward", 2), ("fetch", 1),
                              ("backward", 1), ("fetch", 0), ("backward", 0)]
    assert all(s.device is None for g in offload.groups.values() for s in g)  # the graph took them


def test_hyper_connection_projection_matches_its_composition():
    """mHC's normalised projection (its own backward: one GEMM and one pass over the streams)
    against (x fn^T) * rsqrt(mean(x^2) + eps) by autograd, and by gradcheck, in float64."""
    from kda_dsa_ops.nn.layers import _NormalisedProjection

    torch.manual_seed(0)
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    fn = torch.randn(15, 24, dtype=torch.float64, requires_grad=True)
    y = _NormalisedProjection.apply(x, fn, 1e-6)
    ref = (x @ fn.t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, fn), g), torch.autograd.grad(ref, (x, fn), g)):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda x, fn: _NormalisedProjection.apply(x, fn, 1e-6), (x, fn))
