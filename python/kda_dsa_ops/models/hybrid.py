"""The hybrid model: per layer, KDA or MLA attention (sparse, with the DSA indexer, or dense
causal), then a (Latent)MoE or a dense SwiGLU feed-forward; packed varlen batches; chunked
cross-entropy over the vocabulary. One configuration expresses the project's presets and the
real checkpoints of the family (Kimi Linear, DeepSeek-V3.2)."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .._dtypes import accumulation_dtype
from ..contracts import MAX_TOPK
from ..nn import (HyperConnection, KDAAttention, LatentMoE, LightningIndexer, MLAttention, RMSNorm, Rope, SwiGLU,
                  chunked_linear_cross_entropy, freeze_all_but_adapters, get_backend, positions_in_sequence)
from ..nn.offload import ActivationOffload
from ..nn.vision import PatchEmbed, VisionConfig, VisionTower


@dataclass(frozen=True)
class HybridConfig:
    """One model for the whole family: the project's presets and the real checkpoints
    (kimi_linear, deepseek_v32, glm5_next; onboard.from_pretrained reads their config.json into this)."""
    vocab: int
    hidden: int
    layers: int
    pattern: str = "KKKD"  # attention per layer, repeated: K = KDA, D = MLA + DSA (sparse), A = dense causal MLA
    ffn_pattern: str = "M"  # feed-forward per layer, repeated: M = MoE, F = dense SwiGLU (dense_ffn wide)
    dense_ffn: int = 0
    rms_norm_eps: float = 1e-6  # every RMS norm but the MLA latents'
    kda_heads: int = 2
    kda_value_heads: int = 2
    kda_head_dim: int = 16
    kda_gate_rank: int = 8  # rank of the decay gate and of the output gate
    kda_conv_size: int = 4
    kda_lower_bound: float | None = None  # GLM-5.3's decay: lower_bound * sigmoid(exp(A_log) * (x + dt_bias))
    dsa_heads: int = 2
    dsa_q_rank: int = 32  # 0: one q projection, no q latent
    dsa_kv_rank: int = 32
    dsa_nope_dim: int = 16
    dsa_rope_dim: int = 8
    dsa_v_dim: int = 16
    dsa_gate: bool = True  # sigmoid gate on the sparse attention's latent output (D layers)
    latent_norm_eps: float = 1e-6  # the MLA q and kv latent norms
    rope: Rope = Rope()  # of the MLA rope dims (and the deepseek indexer's): style, theta, YaRN
    index_heads: int = 2
    index_dim: int = 16
    dsa_topk: int = 64
    index_style: str = "plain"  # "plain" (q, k, w from the input) or "deepseek" (see nn.LightningIndexer)
    index_pattern: str = "F"  # per layer, repeated (read at D layers): F = its own indexer, S = the last one's choice
    index_kpool: int = 0  # > 0: GLM-5.3's indexer over pools of this many keys
    index_kpool_tail: bool = True  # and the latest incomplete pool always chosen
    experts: int = 8
    moe_topk: int = 2
    latent: int = 32  # 0: experts on the full width
    expert_ffn: int = 32
    shared_ffn: int = 64  # 0: no shared expert
    routed_scale: float = 1.0
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_renorm: bool = True
    swiglu_limit: float = 0.0  # > 0: GLM-5.3's clamps of every SwiGLU's gate and up
    capacity_factor: float | None = None
    drop_policy: str = "drop_probs"
    indexer_loss_weight: float = 0.1
    hc_mult: int = 1  # > 1: that many residual streams mixed by hyper-connections (mHC, GLM-5.3)
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    image_size: int = 0  # > 0: the presets' image front end (nn.PatchEmbed)
    patch: int = 8
    channels: int = 3
    vision: VisionConfig | None = None  # GLM-5.3's vision tower (nn.VisionTower)
    image_token_id: int = -1  # the placeholder of an image token (-1: the last vocabulary id)

    @property
    def image_token(self) -> int:
        return self.image_token_id if self.image_token_id >= 0 else self.vocab - 1

    @property
    def moe_width(self) -> int:
        """The width tokens have when they travel to the experts."""
        return self.latent or self.hidden

    def validate(self) -> None:
        """Raises ValueError on a configuration no kernel or layer could run."""
        problems = []
        if not self.pattern or set(self.pattern) - {"K", "D", "A"}:
            problems.append(f"pattern must be made of 'K' (KDA), 'D' (sparse MLA) and 'A' (dense MLA), "
                            f"got {self.pattern!r}")
        if not self.ffn_pattern or set(self.ffn_pattern) - {"M", "F"}:
            problems.append(f"ffn_pattern must be made of 'M' (MoE) and 'F' (dense), got {self.ffn_pattern!r}")
        elif "F" in self.ffn_pattern and self.dense_ffn <= 0:
            problems.append(f"dense layers ('F' in ffn_pattern) need dense_ffn > 0, got {self.dense_ffn}")
        if not 0 < self.dsa_topk <= MAX_TOPK:
            problems.append(f"dsa_topk must be in [1, {MAX_TOPK}], got {self.dsa_topk}")
        if not 0 < self.moe_topk <= self.experts:
            problems.append(f"moe_topk must be in [1, experts = {self.experts}], got {self.moe_topk}")
        if self.moe_groups > 1 and (self.experts % self.moe_groups or self.experts // self.moe_groups < 2
                                    or not 0 < self.moe_topk_groups <= self.moe_groups):
            problems.append(f"moe_groups ({self.moe_groups}) must divide experts ({self.experts}) into groups of "
                            f">= 2, with moe_topk_groups in [1, moe_groups], got {self.moe_topk_groups}")
        if self.kda_value_heads % self.kda_heads:
            problems.append(f"kda_value_heads ({self.kda_value_heads}) must be a multiple of kda_heads "
                            f"({self.kda_heads})")
        if self.kda_head_dim > 128:
            problems.append(f"kda_head_dim must be <= 128, got {self.kda_head_dim}")
        if self.dsa_rope_dim % 2:
            problems.append(f"dsa_rope_dim must be even (rotary pairs), got {self.dsa_rope_dim}")
        if self.rope.style not in Rope.STYLES:
            problems.append(f"rope style must be one of {Rope.STYLES}, got {self.rope.style!r}")
        if self.index_style not in LightningIndexer.STYLES:
            problems.append(f"index_style must be one of {LightningIndexer.STYLES}, got {self.index_style!r}")
        elif self.index_style == "deepseek" and (self.dsa_q_rank <= 0 or self.index_dim < self.dsa_rope_dim):
            problems.append("the deepseek indexer reads the q latent (dsa_q_rank > 0) and rotates dsa_rope_dim of "
                            f"its index_dim dims, got q rank {self.dsa_q_rank}, index_dim {self.index_dim}")
        if set(self.index_pattern) - {"F", "S"}:
            problems.append(f"index_pattern must be made of 'F' and 'S', got {self.index_pattern!r}")
        elif self.index_kinds() and self.index_kinds()[0] == "S":
            problems.append("the first sparse (D) layer must have its own indexer: index_pattern gives it 'S'")
        if self.index_kpool and (self.index_style != "deepseek" or self.dsa_topk % self.index_kpool):
            problems.append(f"index_kpool ({self.index_kpool}) needs the deepseek index_style and to divide dsa_topk "
                            f"({self.dsa_topk})")
        if self.image_size and self.vision is not None:
            problems.append("one image front end: image_size (the presets') or vision (GLM-5.3's), not both")
        if self.image_size and self.image_size % self.patch:
            problems.append(f"image_size ({self.image_size}) must be a multiple of patch ({self.patch})")
        if problems:
            raise ValueError("bad HybridConfig: " + "; ".join(problems))

    def kinds(self) -> list[str]:
        return [self.pattern[i % len(self.pattern)] for i in range(self.layers)]

    def ffn_kinds(self) -> list[str]:
        return [self.ffn_pattern[i % len(self.ffn_pattern)] for i in range(self.layers)]

    def index_kind(self, layer: int) -> str:
        """F (its own indexer) or S (the last sparse layer's choice), read at sparse (D) layers."""
        return self.index_pattern[layer % len(self.index_pattern)]

    def index_kinds(self) -> list[str]:
        """F or S for each sparse (D) layer, in order."""
        return [self.index_kind(i) for i, k in enumerate(self.kinds()) if k == "D"]


PRESETS = {
    # Runs on a laptop CPU in seconds.
    "tiny": HybridConfig(vocab=256, hidden=64, layers=4),
    # One GPU.
    "small": HybridConfig(vocab=32000, hidden=1024, layers=8, kda_heads=8, kda_value_heads=8, kda_head_dim=128,
                          kda_gate_rank=64, dsa_heads=8, dsa_q_rank=384, dsa_kv_rank=512, dsa_nope_dim=128,
                          dsa_rope_dim=64, dsa_v_dim=128, index_heads=8, index_dim=64, dsa_topk=2048, experts=64,
                          moe_topk=8, latent=256, expert_ffn=256, shared_ffn=1024),
    # The full-size shapes (896 experts, top-16, 3:1 KDA:DSA, topk 2048): for the planner only.
    "k3-2.8t": HybridConfig(vocab=163840, hidden=7168, layers=80, kda_heads=64, kda_value_heads=64,
                            kda_head_dim=128, kda_gate_rank=128, dsa_heads=128, dsa_q_rank=1536, dsa_kv_rank=512,
                            dsa_nope_dim=128, dsa_rope_dim=64, dsa_v_dim=128, index_heads=64, index_dim=128,
                            dsa_topk=2048, experts=896, moe_topk=16, latent=3072, expert_ffn=4096, shared_ffn=18432),
}


def get_config(name: str, **overrides) -> HybridConfig:
    if name not in PRESETS:
        raise ValueError(f"config must be one of {sorted(PRESETS)}, got {name!r}")
    cfg = replace(PRESETS[name], **overrides)
    cfg.validate()
    return cfg


class HybridBlock(nn.Module):
    """Attention then feed-forward, each with a residual: x + f(norm(x)), or with hc_mult > 1
    hyper-connections over the residual streams (nn.HyperConnection)."""

    def __init__(self, cfg: HybridConfig, kind: str, ffn_kind: str, lora_rank: int, mlp_lora_rank: int,
                 own_indexer: bool = True):
        super().__init__()
        self.kind, self.ffn_kind = kind, ffn_kind
        eps = cfg.rms_norm_eps
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden, eps=eps), RMSNorm(cfg.hidden, eps=eps)
        self.attn_hc = self.ffn_hc = None
        if cfg.hc_mult > 1:
            self.attn_hc, self.ffn_hc = (HyperConnection(cfg.hidden, cfg.hc_mult, cfg.hc_eps, cfg.hc_sinkhorn_iters, eps)
                                         for _ in range(2))
        if kind == "K":
            self.attn = KDAAttention(cfg.hidden, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_value_heads,
                                     cfg.kda_gate_rank, cfg.kda_conv_size, lora_rank, eps, cfg.kda_lower_bound)
        else:
            rope = cfg.rope
            indexer = None
            if kind == "D" and own_indexer:
                q_in = cfg.dsa_q_rank if cfg.index_style == "deepseek" else cfg.hidden
                indexer = LightningIndexer(cfg.hidden, q_in, cfg.index_heads, cfg.index_dim, cfg.dsa_topk,
                                           cfg.index_style, rope, cfg.dsa_rope_dim, cfg.index_kpool,
                                           cfg.index_kpool_tail)
            self.attn = MLAttention(cfg.hidden, cfg.dsa_heads, cfg.dsa_q_rank, cfg.dsa_kv_rank, cfg.dsa_nope_dim,
                                    cfg.dsa_rope_dim, cfg.dsa_v_dim, rope, indexer, cfg.dsa_gate and kind == "D",
                                    cfg.latent_norm_eps, lora_rank, sparse=kind == "D")
        if ffn_kind == "M":
            self.mlp = LatentMoE(cfg.hidden, cfg.latent, cfg.experts, cfg.moe_topk, cfg.expert_ffn, cfg.shared_ffn,
                                 cfg.capacity_factor, cfg.drop_policy, lora_rank=mlp_lora_rank,
                                 routed_scale=cfg.routed_scale, n_group=cfg.moe_groups,
                                 topk_group=cfg.moe_topk_groups, renorm=cfg.moe_renorm, norm_eps=eps,
                                 swiglu_limit=cfg.swiglu_limit)
        else:
            self.mlp = SwiGLU(cfg.hidden, cfg.dense_ffn, mlp_lora_rank, cfg.swiglu_limit)

    def feed_forward(self, x: Tensor, backend) -> Tensor:
        return self.mlp(x, backend)

    def attention(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend, shared_indices: Tensor | None = None,
                  cp=None):
        """(output, indexer loss, the sparse layer's indices or None) of the attention on x [T, hidden]."""
        if self.kind == "K":
            return self.attn(self.attn_norm(x), cu_seqlens, pos, backend, cp), x.new_zeros(
                (), dtype=accumulation_dtype(x)), None
        return self.attn(self.attn_norm(x), cu_seqlens, pos, backend, shared_indices, cp)

    def forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend, recompute: str = "none",
                shared_indices: Tensor | None = None, cp=None):
        """x [T, hidden], or [T, hc_mult, hidden] streams -> (the same, indexer loss, indices or None).
        recompute: "attention" keeps only the block's input for the attention half and runs it again
        in the backward; "block" does so for the whole block; "none" keeps every activation.
        shared_indices: the last sparse layer's choice, for a layer without an indexer of its own.
        cp: a parallel.ContextParallel when x is one share of a batch split along T."""
        if recompute == "block":
            return checkpoint(self._forward, x, cu_seqlens, pos, backend, False, shared_indices, cp,
                              use_reentrant=False)
        return self._forward(x, cu_seqlens, pos, backend, recompute == "attention", shared_indices, cp)

    def _forward(self, x: Tensor, cu_seqlens: Tensor, pos: Tensor, backend, recompute_attention: bool = False,
                 shared_indices: Tensor | None = None, cp=None):
        streams = x
        if self.attn_hc is not None:
            post, comb, x = self.attn_hc(streams, backend)
        if recompute_attention:
            attn, aux, indices = checkpoint(self.attention, x, cu_seqlens, pos, backend, shared_indices, cp,
                                            use_reentrant=False)
        else:
            attn, aux, indices = self.attention(x, cu_seqlens, pos, backend, shared_indices, cp)
        if self.attn_hc is None:
            x = x + attn
            return x + self.feed_forward(self.mlp_norm(x), backend), aux, indices
        streams = HyperConnection.mix(post, comb, attn, streams, backend)
        post, comb, x = self.ffn_hc(streams, backend)
        return (HyperConnection.mix(post, comb, self.feed_forward(self.mlp_norm(x), backend), streams, backend), aux,
                indices)


class HybridModel(nn.Module):
    """tokens [T] int64 packed by cu_seqlens int32 [N + 1] -> hidden states, and the training loss.

    backend: "native" (the kernels) or "reference" (the same model on reference ops).
    lora_rank > 0 freezes every base weight and trains low-rank adapters on the projections: of
    attention and feed-forward (lora_targets="all") or of attention only ("attention").
    recompute: "none", "attention" or "block" (see HybridBlock.forward): activations traded for a
    second forward in the backward. offload: the activations each block saves for the backward go
    to pinned host memory and come back one block ahead of the backward (nn.offload).
    """

    RECOMPUTE = ("none", "attention", "block")

    LORA_TARGETS = ("all", "attention")

    def __init__(self, cfg: HybridConfig, lora_rank: int = 0, backend: str = "native", recompute: str = "none",
                 offload: bool = False, lora_targets: str = "all"):
        super().__init__()
        cfg.validate()
        if lora_targets not in self.LORA_TARGETS:
            raise ValueError(f"lora_targets must be one of {self.LORA_TARGETS}, got {lora_targets!r}")
        if recompute not in self.RECOMPUTE:
            raise ValueError(f"recompute must be one of {self.RECOMPUTE}, got {recompute!r}")
        self.cfg, self.backend, self.recompute, self.offload = cfg, get_backend(backend), recompute, offload
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.vision = (VisionTower(cfg.vision, cfg.hidden) if cfg.vision is not None
                       else PatchEmbed(cfg.image_size, cfg.patch, cfg.channels, cfg.hidden) if cfg.image_size else None)
        mlp_lora_rank = lora_rank if lora_targets == "all" else 0
        self.blocks = nn.ModuleList(HybridBlock(cfg, kind, ffn_kind, lora_rank, mlp_lora_rank, cfg.index_kind(i) == "F")
                                    for i, (kind, ffn_kind) in enumerate(zip(cfg.kinds(), cfg.ffn_kinds())))
        self.norm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.randn(cfg.vocab, cfg.hidden) / cfg.hidden ** 0.5)
        self.lora_rank = lora_rank
        if lora_rank > 0:
            freeze_all_but_adapters(self)

    def set_backend(self, name: str) -> None:
        self.backend = get_backend(name)

    def embed_inputs(self, tokens: Tensor, images, cp=None) -> Tensor:
        """Token embeddings, with the image tokens of `images` (in order) at the image placeholder
        tokens. images: [n, channels, image_size, image_size] (PatchEmbed), or (pixel_values,
        image_grid_thw) as GLM-5.3's image processor gives them (VisionTower). cp: tokens are one
        share of the batch, images the whole batch's; the share's placeholders take the image
        tokens after those of the earlier shares."""
        x = self.embed(tokens)
        if images is None:
            return x
        if self.vision is None:
            raise ValueError("this model has no image front end (HybridConfig.image_size = 0, vision = None)")
        features = self.vision(*images) if isinstance(self.vision, VisionTower) else self.vision(images)
        slots = (tokens == self.cfg.image_token).nonzero().squeeze(1)
        first, placeholders = 0, slots.numel()
        if cp is not None:
            first, placeholders = cp.counts(slots.numel(), tokens.device)
        if placeholders != features.shape[0]:
            raise ValueError(f"the images give {features.shape[0]} image tokens, the batch has {placeholders} "
                             f"placeholders (token {self.cfg.image_token})")
        return x.index_copy(0, slots, features[first:first + slots.numel()].to(x.dtype))

    def hidden_states(self, tokens: Tensor, cu_seqlens: Tensor, images: Tensor | None = None,
                      cp=None) -> tuple[Tensor, Tensor]:
        """Final hidden states [T, hidden] and the summed indexer loss of the DSA blocks. cp (a
        parallel.ContextParallel of cu_seqlens): tokens are this rank's share (cp.local), images
        the whole batch's, the states and the indexer loss (a mean over the share's queries) the
        share's."""
        if cp is None:
            pos = positions_in_sequence(cu_seqlens, tokens.shape[0])
        else:
            if tokens.shape[0] != cp.share or not cp.matches(cu_seqlens):
                raise ValueError(f"with context parallelism the model takes this rank's {cp.share} tokens "
                                 "(cp.local(tokens)) and the whole batch's cu_seqlens, the one cp was made of")
            cu_seqlens, pos = cp.cu_seqlens(tokens.device), cp.positions(tokens.device)
        x = self.embed_inputs(tokens, images, cp)
        offload = ActivationOffload(x.device) if self.offload else None
        aux = x.new_zeros((), dtype=accumulation_dtype(x))
        if self.cfg.hc_mult > 1:
            x = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        indices = None
        for i, block in enumerate(self.blocks):
            with offload.block(i) if offload else contextlib.nullcontext():
                x, block_aux, block_indices = block(x, cu_seqlens, pos, self.backend, self.recompute, indices, cp)
            aux = aux + block_aux.to(aux.dtype)
            indices = block_indices if block_indices is not None else indices
        if self.cfg.hc_mult > 1:
            x = x.mean(1)
        return self.norm(x), aux

    def logits(self, tokens: Tensor, cu_seqlens: Tensor, images: Tensor | None = None) -> Tensor:
        """[T, vocab] next-token logits (inference and checks; training uses the chunked loss)."""
        h, _ = self.hidden_states(tokens, cu_seqlens, images)
        return h @ self.lm_head.to(h.dtype).t()

    def forward(self, tokens: Tensor, cu_seqlens: Tensor, labels: Tensor, images: Tensor | None = None,
                cp=None) -> dict:
        """{"loss": lm + indexer_loss_weight * indexer, "lm_loss", "indexer_loss", "accuracy"};
        labels [T] int64 (-100 = ignored); accuracy: argmax predictions on the labelled tokens.
        images (see embed_inputs): their image tokens replace the placeholders. cp (context
        parallelism, see hidden_states): tokens and labels are this rank's share, and the losses
        are normalised by the whole batch's counts so that their mean over the ranks is the
        unsplit batch's (accuracy stays the share's)."""
        h, aux = self.hidden_states(tokens, cu_seqlens, images, cp)
        head = self.lm_head.to(h.dtype)
        lm, accuracy = chunked_linear_cross_entropy(h, head, labels, rows=self.backend.cross_entropy_rows_,
                                                    with_accuracy=True)
        if cp is not None:  # the share's mean -> its part of the batch's mean, times the ranks
            count = int((labels != -100).sum())
            lm = lm * (max(count, 1) * cp.world / max(cp.counts(count, labels.device)[1], 1))
        return {"loss": lm + self.cfg.indexer_loss_weight * aux.to(lm.dtype), "lm_loss": lm, "indexer_loss": aux,
                "accuracy": accuracy}

    @torch.no_grad()
    def index_selections(self, tokens: Tensor, cu_seqlens: Tensor) -> dict[int, Tensor]:
        """{layer: its indexer's choice [T, topk] int32 (-1: no key)} for every sparse layer with an
        indexer of its own, from one forward over tokens packed by cu_seqlens (the key sets the
        sparse attention kernels are given; bench/index_sets.py records them from a checkpoint)."""
        chosen, hooks = {}, []
        for i, block in enumerate(self.blocks):
            if block.kind == "D" and block.attn.indexer is not None:
                hooks.append(block.attn.register_forward_hook(
                    lambda _m, _args, out, i=i: chosen.__setitem__(i, out[2].int())))
        try:
            self.hidden_states(tokens, cu_seqlens)
        finally:
            for hook in hooks:
                hook.remove()
        return chosen

    def update_router_biases(self) -> None:
        """After an optimizer step: nudge each MoE router's selection bias toward balanced loads."""
        for block in self.blocks:
            if block.ffn_kind == "M":
                block.mlp.update_bias()

    def config_dict(self) -> dict:
        return asdict(self.cfg)
