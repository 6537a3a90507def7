"""Real checkpoints: read a Hugging-Face-style checkpoint (config.json + safetensors, single or
sharded) of the family — `kimi_linear`, `deepseek_v32`, `glm5_next`, or this package's own
`kda_dsa_ops` format — into HybridModel, write one back, and say which op each block runs on.

    python -m kda_dsa_ops.onboard CHECKPOINT_DIR [--device cuda]

`from_pretrained(path)` reads config.json by its `model_type` into a HybridConfig and maps every
tensor through the family's declarative table (FAMILIES). Loading reads tensor by tensor (never
the whole checkpoint into memory); under expert parallelism a rank reads only the experts it
owns. FP8 weights (e4m3 with a `weight_scale_inv` per 128 x 128 block, as DeepSeek-V3.2 ships)
are dequantised on load. Everything is read and checked first: the model is written only when
every tensor is present, known and of the right shape, so a bad checkpoint leaves it untouched.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

import torch

from .models import HybridConfig, HybridModel
from .nn.vision import VisionConfig
from .models.hybrid import PRESETS
from .nn import LoRALinear, Rope
from .contracts import attention_kernel_refuses, indexer_kernel_refuses
from .safetensors_io import CheckpointError, Reader, write_file, write_sharded

FP8_BLOCK = 128
OWN_FORMAT = "kda_dsa_ops"


@dataclass(frozen=True)
class Rule:
    """Checkpoint tensor(s) -> one of our tensors. where: the layers it applies to ("all", an
    attention kind K/D/A, "MLA" (D or A), "MLAq"/"MLA0" (MLA with / without a q latent), an ffn
    kind M/F). {i} is a layer, {e} an expert (target "<param>.{e}": that expert's slice), {b} a
    block of the vision tower.
    how: "identity"; "t" (the checkpoint is [out, in] where we hold [in, out]); "conv" (depthwise
    conv1d [C, 1, W], current token last -> our [C, W], current first); "reshape:1,1,-1,1" (the
    checkpoint's shape, -1 for the rest: the same elements); "window:out,C,m" (a conv2d [out, C,
    m, m] over m x m windows as our linear map over a window's [m, m, C] features);
    "cat" (several sources stacked along dim 0); "cat_t" (stacked, then transposed)."""
    where: str
    source: str | tuple[str, ...]
    target: str
    how: str = "identity"

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else self.source


@dataclass(frozen=True)
class Family:
    read_config: Callable[[dict], HybridConfig]
    rules: Callable[[HybridConfig], list[Rule]]
    aliases: tuple[tuple[str, str], ...] = ()  # (canonical, alternative) spellings of a name fragment


def _get(raw: dict, *names, default=None, required: list | None = None):
    """The first of `names` present in raw; else default (a missing required key is noted)."""
    for n in names:
        if raw.get(n) is not None:
            return raw[n]
    if required is not None and default is None:
        required.append(names[0])
    return default


def _check_missing(missing: list, model_type: str) -> None:
    if missing:
        raise CheckpointError(f"config.json ({model_type}) lacks {sorted(set(missing))}")


def _moe_fields(raw: dict, missing: list, first_dense: int) -> dict:
    """first_dense: the family's dense first layers when the config says neither mlp_layer_types
    nor first_k_dense_replace."""
    L = _get(raw, "num_hidden_layers", required=missing) or 0
    mlp_types = raw.get("mlp_layer_types") or [
        "dense" if i < _get(raw, "first_k_dense_replace", default=first_dense) else "sparse" for i in range(L)]
    ffn = _get(raw, "moe_intermediate_size", required=missing) or 0
    return dict(
        ffn_pattern="".join("F" if t == "dense" else "M" for t in mlp_types),
        dense_ffn=_get(raw, "intermediate_size", required=missing),
        experts=_get(raw, "n_routed_experts", "num_experts", "num_local_experts", required=missing),
        moe_topk=_get(raw, "num_experts_per_tok", "num_experts_per_token", required=missing),
        latent=0, expert_ffn=ffn,
        shared_ffn=ffn * _get(raw, "n_shared_experts", "num_shared_experts", default=1),
        routed_scale=float(_get(raw, "routed_scaling_factor", default=1.0)),
        moe_groups=_get(raw, "n_group", "num_expert_group", default=1),
        moe_topk_groups=_get(raw, "topk_group", default=1),
        moe_renorm=bool(_get(raw, "norm_topk_prob", "moe_renormalize", default=True)),
        capacity_factor=None)


def _mla_fields(raw: dict, missing: list) -> dict:
    return dict(
        dsa_heads=_get(raw, "num_attention_heads", required=missing),
        dsa_q_rank=_get(raw, "q_lora_rank", default=0),
        dsa_kv_rank=_get(raw, "kv_lora_rank", required=missing),
        dsa_nope_dim=_get(raw, "qk_nope_head_dim", required=missing),
        dsa_rope_dim=_get(raw, "qk_rope_head_dim", required=missing),
        dsa_v_dim=_get(raw, "v_head_dim", required=missing),
        dsa_gate=False, latent_norm_eps=1e-6)


def _common_fields(raw: dict, missing: list) -> dict:
    if raw.get("tie_word_embeddings"):
        raise CheckpointError("tied input and output embeddings (tie_word_embeddings) are not supported")
    return dict(vocab=_get(raw, "vocab_size", required=missing), hidden=_get(raw, "hidden_size", required=missing),
                layers=_get(raw, "num_hidden_layers", required=missing),
                rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)))


def _rope(raw: dict, style: str) -> Rope:
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return Rope(style, theta)
    if kind != "yarn" or params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise CheckpointError(f"rope {params} is not supported (default and YaRN with truncate are)")
    return Rope(style, theta, float(params["factor"]), int(params["original_max_position_embeddings"]),
                float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                float(params.get("mscale") or 0), float(params.get("mscale_all_dim") or 0))


def kimi_linear_config(raw: dict) -> HybridConfig:
    missing: list = []
    la = raw.get("linear_attn_config") or {}
    L = _get(raw, "num_hidden_layers", required=missing) or 0
    types = raw.get("layer_types")
    if types is None and "full_attn_layers" in la:  # 1-indexed in the released checkpoints
        types = ["full_attention" if i + 1 in la["full_attn_layers"] else "linear_attention" for i in range(L)]
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    heads = la.get("num_heads", _get(raw, "linear_num_heads", default=32))
    head_dim = la.get("head_dim", _get(raw, "linear_head_dim", default=128))
    values = _common_fields(raw, missing) | _mla_fields(raw, missing) | _moe_fields(raw, missing, 1) | dict(
        pattern="".join("A" if t == "full_attention" else "K" for t in types),
        kda_heads=heads, kda_value_heads=heads, kda_head_dim=head_dim, kda_gate_rank=head_dim,
        kda_conv_size=la.get("short_conv_kernel_size", _get(raw, "linear_conv_kernel_dim", default=4)),
        rope=Rope("none"))
    _check_missing(missing, "kimi_linear")
    return HybridConfig(**values)


def deepseek_v32_config(raw: dict) -> HybridConfig:
    missing: list = []
    values = _common_fields(raw, missing) | _mla_fields(raw, missing) | _moe_fields(raw, missing, 3)
    values |= dict(pattern="D", rope=_rope(raw, "interleave"), index_style="deepseek",
                   index_heads=_get(raw, "index_n_heads", required=missing),
                   index_dim=_get(raw, "index_head_dim", required=missing),
                   dsa_topk=_get(raw, "index_topk", required=missing))
    _check_missing(missing, "deepseek_v32")
    return HybridConfig(**values)


def glm5_next_config(raw: dict) -> HybridConfig:
    """GLM-5.3-Flash: its text_config and vision_config."""
    missing: list = []
    text = raw.get("text_config") or {}
    vision = raw.get("vision_config")
    L = _get(text, "num_hidden_layers", required=missing) or 0
    types = text.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(L)]
    la = text.get("linear_attn_config") or {}
    heads = la.get("num_heads", _get(text, "linear_num_heads", default=64))
    head_dim = la.get("head_dim", _get(text, "linear_head_dim", default=128))
    indexer_types = text.get("indexer_types") or ["full"] * L
    eps = float(_get(text, "rms_norm_eps", default=1e-5))
    values = _common_fields(text, missing) | _mla_fields(text, missing) | _moe_fields(text, missing, 3) | dict(
        pattern="".join("K" if t == "linear_attention" else "D" for t in types),
        kda_heads=heads, kda_value_heads=heads, kda_head_dim=head_dim, kda_gate_rank=head_dim,
        kda_conv_size=la.get("short_conv_kernel_size", _get(text, "linear_conv_kernel_dim", default=4)),
        kda_lower_bound=la.get("gate_lower_bound", text.get("linear_lower_bound", -5.0)),
        latent_norm_eps=eps, rope=Rope("none"), index_style="deepseek",
        index_heads=_get(text, "index_n_heads", required=missing), index_dim=_get(text, "index_head_dim", required=missing),
        dsa_topk=_get(text, "index_topk", required=missing), index_kpool=_get(text, "index_kpool", default=16),
        index_kpool_tail=bool(_get(text, "index_kpool_always_select_tail", default=True)),
        index_pattern="".join("S" if t == "shared" else "F" for t in indexer_types) or "F",
        swiglu_limit=float(_get(text, "swiglu_limit", default=0.0)),
        hc_mult=_get(text, "hc_mult", default=1), hc_eps=float(_get(text, "hc_eps", default=1e-6)),
        hc_sinkhorn_iters=_get(text, "hc_sinkhorn_iters", default=20),
        image_token_id=_get(raw, "image_token_id", default=-1))
    if vision is not None:
        values["vision"] = VisionConfig(
            depth=_get(vision, "depth", required=missing), hidden=_get(vision, "hidden_size", required=missing),
            heads=_get(vision, "num_heads", required=missing), ffn=_get(vision, "intermediate_size", required=missing),
            out_hidden=_get(vision, "out_hidden_size", required=missing),
            merger_ffn=_get(vision, "projection_intermediate_size", required=missing),
            patch=_get(vision, "patch_size", default=14), temporal_patch=_get(vision, "temporal_patch_size", default=2),
            merge=_get(vision, "spatial_merge_size", default=2), channels=_get(vision, "in_channels", default=3),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            norm_eps=float(_get(vision, "rms_norm_eps", default=1e-5)),
            swiglu_limit=float(_get(vision, "swiglu_limit", default=10.0)),
            bias=bool(_get(vision, "attention_bias", default=True)))
    _check_missing(missing, "glm5_next")
    return HybridConfig(**values)


def own_config(raw: dict) -> HybridConfig:
    known = {f.name for f in fields(HybridConfig)}
    unknown = sorted(set(raw) - known - {"model_type"})
    if unknown:
        raise CheckpointError(f"config.json ({OWN_FORMAT}) has unknown fields {unknown}")
    values = {k: v for k, v in raw.items() if k in known}
    if values.get("vision") is not None:
        values["vision"] = VisionConfig(**values["vision"])
    if "rope" in values:
        values["rope"] = Rope(**values["rope"])
    return HybridConfig(**values)


def _block_rules(prefix: str, names: dict) -> list[Rule]:
    return [Rule(where, f"model.layers.{{i}}.{prefix}.{src}", f"blocks.{{i}}.{dst}", how)
            for where, src, dst, how in names]


def _hf_rules(moe: str, expert: tuple[str, str, str]) -> list[Rule]:
    """The layout shared by the families: llama-style names, MLA as DeepSeek names it, SwiGLU MLPs
    with separate gate/up/down, experts one by one (expert = its gate, up and down names)."""
    gate, up, down = expert
    rules = [Rule("all", "model.embed_tokens.weight", "embed.weight"), Rule("all", "lm_head.weight", "lm_head"),
             Rule("all", "model.norm.weight", "norm.weight"),
             Rule("all", "model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.weight"),
             Rule("all", "model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm.weight")]
    rules += _block_rules("self_attn", [
        ("MLA0", "q_proj.weight", "attn.q_proj.base.weight", "identity"),
        ("MLAq", "q_a_proj.weight", "attn.q_down.base.weight", "identity"),
        ("MLAq", "q_a_layernorm.weight", "attn.q_norm.weight", "identity"),
        ("MLAq", "q_b_proj.weight", "attn.q_up.base.weight", "identity"),
        ("MLA", "kv_a_proj_with_mqa.weight", "attn.kv_down.base.weight", "identity"),
        ("MLA", "kv_a_layernorm.weight", "attn.kv_norm.weight", "identity"),
        ("MLA", "kv_b_proj.weight", "attn.kv_up.base.weight", "identity"),
        ("MLA", "o_proj.weight", "attn.o_proj.base.weight", "identity")])
    rules += [
        Rule("F", ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
             "blocks.{i}.mlp.gate_up.base.weight", "cat"),
        Rule("F", "model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.down.base.weight"),
        Rule("M", f"model.layers.{{i}}.{moe}.gate.weight", "blocks.{i}.mlp.router", "t"),
        Rule("M", f"model.layers.{{i}}.{moe}.gate.e_score_correction_bias", "blocks.{i}.mlp.router_bias"),
        Rule("M", (f"model.layers.{{i}}.{moe}.shared_experts.gate_proj.weight",
                   f"model.layers.{{i}}.{moe}.shared_experts.up_proj.weight"),
             "blocks.{i}.mlp.shared.gate_up.base.weight", "cat"),
        Rule("M", f"model.layers.{{i}}.{moe}.shared_experts.down_proj.weight", "blocks.{i}.mlp.shared.down.base.weight"),
        Rule("M", (f"model.layers.{{i}}.{moe}.experts.{{e}}.{gate}.weight", f"model.layers.{{i}}.{moe}.experts.{{e}}.{up}.weight"),
             "blocks.{i}.mlp.w_gate_up.{e}", "cat_t"),
        Rule("M", f"model.layers.{{i}}.{moe}.experts.{{e}}.{down}.weight", "blocks.{i}.mlp.w_down.{e}", "t")]
    return rules


def _kda_rules(a_log: str) -> list[Rule]:
    """Kimi Linear's KDA layers (a_log: how its A_log is laid out)."""
    return _block_rules("self_attn", [
        ("K", f"{p}_proj.weight", f"attn.{p}_proj.base.weight", "identity") for p in "qkv"] + [
        ("K", f"{p}_conv1d.weight", f"attn.{p}_conv.weight", "conv") for p in "qkv"] + [
        ("K", "f_a_proj.weight", "attn.g_down.weight", "identity"), ("K", "f_b_proj.weight", "attn.g_up.weight", "identity"),
        ("K", "A_log", "attn.A_log", a_log), ("K", "dt_bias", "attn.dt_bias", "identity"),
        ("K", "b_proj.weight", "attn.b_proj.weight", "identity"),
        ("K", "g_a_proj.weight", "attn.o_gate_down.base.weight", "identity"),
        ("K", "g_b_proj.weight", "attn.o_gate_up.base.weight", "identity"),
        ("K", "o_norm.weight", "attn.o_norm.weight", "identity"), ("K", "o_proj.weight", "attn.o_proj.base.weight", "identity")])


def _indexer_rules() -> list[Rule]:
    """DeepSeek-V3.2's indexer, on the sparse layers that have their own (DF)."""
    return _block_rules("self_attn.indexer", [
        ("DF", "wq_b.weight", "attn.indexer.q.weight", "identity"), ("DF", "wk.weight", "attn.indexer.k.weight", "identity"),
        ("DF", "k_norm.weight", "attn.indexer.k_norm.weight", "identity"),
        ("DF", "k_norm.bias", "attn.indexer.k_norm.bias", "identity"),
        ("DF", "weights_proj.weight", "attn.indexer.w.weight", "identity")])


def kimi_linear_rules(cfg: HybridConfig) -> list[Rule]:
    return _hf_rules("mlp", ("w1", "w3", "w2")) + _kda_rules("reshape:1,1,-1,1")


def deepseek_v32_rules(cfg: HybridConfig) -> list[Rule]:
    return _hf_rules("mlp", ("gate_proj", "up_proj", "down_proj")) + _indexer_rules()


def glm5_next_rules(cfg: HybridConfig) -> list[Rule]:
    """GLM-5.3-Flash's text model (under model.language_model.): DeepSeek's MLA, indexer and MoE,
    Kimi's KDA, the hyper-connections of every block and the indexer's pooling."""
    layer = "model.language_model.layers.{i}"
    rules = _hf_rules("mlp", ("gate_proj", "up_proj", "down_proj")) + _kda_rules("identity") + _indexer_rules()
    rules = [replace(r, source=tuple(n.replace("model.", "model.language_model.", 1) for n in r.sources))
             for r in rules]
    rules += [Rule("all", f"{layer}.hc_{part}_{p}", f"blocks.{{i}}.{part}_hc.{p}") for part in ("attn", "ffn")
              for p in ("fn", "base", "scale")]
    rules += [Rule("DF", f"{layer}.self_attn.indexer.index_kpool_compress_{p}", f"blocks.{{i}}.attn.indexer.kpool_{p}")
              for p in ("ape", "gate")]
    v = cfg.vision
    if v is None:
        return rules
    block, bias = "model.visual.blocks.{b}", (".weight", ".bias") if v.bias else (".weight",)
    rules += [Rule("all", f"{block}.{src}", f"vision.blocks.{{b}}.{dst}") for src, dst in [
        ("norm1.weight", "norm1.weight"), ("norm2.weight", "norm2.weight"), ("attn.q_norm.weight", "q_norm.weight"),
        ("attn.k_norm.weight", "k_norm.weight")] + [(f"attn.{n}{p}", f"{n}{p}") for n in ("qkv", "proj") for p in bias]
        + [(f"mlp.down_proj{p}", f"down{p}") for p in bias]]
    rules += [Rule("all", (f"{block}.mlp.gate_proj{p}", f"{block}.mlp.up_proj{p}"), f"vision.blocks.{{b}}.gate_up{p}",
                   "cat") for p in bias]
    patch = f"reshape:{v.hidden},{v.channels},{v.temporal_patch},{v.patch},{v.patch}"
    window = f"window:{v.out_hidden},{v.hidden},{v.merge}"
    rules += [Rule("all", "model.visual.patch_embed.proj.weight", "vision.patch_embed.weight", patch),
              Rule("all", "model.visual.patch_embed.proj.bias", "vision.patch_embed.bias"),
              Rule("all", "model.visual.post_layernorm.weight", "vision.post_norm.weight"),
              Rule("all", "model.visual.downsample.weight", "vision.downsample.weight", window),
              Rule("all", "model.visual.downsample.bias", "vision.downsample.bias"),
              Rule("all", "model.visual.merger.proj.weight", "vision.merger_proj.weight"),
              Rule("all", "model.visual.merger.post_projection_norm.weight", "vision.merger_norm.weight"),
              Rule("all", "model.visual.merger.post_projection_norm.bias", "vision.merger_norm.bias"),
              Rule("all", ("model.visual.merger.gate_proj.weight", "model.visual.merger.up_proj.weight"),
                   "vision.merger_gate_up.weight", "cat"),
              Rule("all", "model.visual.merger.down_proj.weight", "vision.merger_down.weight")]
    return rules


def own_rules(cfg: HybridConfig) -> list[Rule]:
    """Our own format: every parameter and buffer under its own name, experts one tensor each."""
    with torch.device("meta"):
        names = [n for n, _ in HybridModel(cfg).state_dict().items()]
    rules = []
    for n in names:
        if n.endswith(("mlp.w_gate_up", "mlp.w_down")):
            rules.append(Rule("all", n.replace("mlp.", "mlp.experts.{e}."), n + ".{e}"))
        else:
            rules.append(Rule("all", n, n))
    return rules


FAMILIES = {
    "kimi_linear": Family(kimi_linear_config, kimi_linear_rules, aliases=(("mlp.", "block_sparse_moe."),)),
    "deepseek_v32": Family(deepseek_v32_config, deepseek_v32_rules),
    "glm5_next": Family(glm5_next_config, glm5_next_rules),
    OWN_FORMAT: Family(own_config, own_rules),
}


def _applies(where: str, cfg: HybridConfig, i: int | None) -> bool:
    if where == "all" or i is None:
        return True
    kind, ffn = cfg.kinds()[i], cfg.ffn_kinds()[i]
    return {"MLA": kind in "DA", "MLAq": kind in "DA" and cfg.dsa_q_rank > 0,
            "MLA0": kind in "DA" and cfg.dsa_q_rank == 0,
            "DF": kind == "D" and cfg.index_kind(i) == "F"}.get(where, where in (kind, ffn))


def _expand(cfg: HybridConfig, family: Family, experts: range):
    """(checkpoint names, our name, expert slot or None, how) for every tensor the model holds."""
    for rule in family.rules(cfg):
        layers = range(cfg.layers) if "{i}" in rule.target else [None]
        vision_blocks = range(cfg.vision.depth) if "{b}" in rule.target else [None]
        for i, b in itertools.product(layers, vision_blocks):
            if not _applies(rule.where, cfg, i):
                continue
            for e in experts if "{e}" in rule.target else [None]:
                names = tuple(s.format(i=i, e=e, b=b) for s in rule.sources)
                target = rule.target.format(i=i, e=e, b=b)
                if e is not None:
                    yield names, target.rsplit(".", 1)[0], e - experts.start, rule.how
                else:
                    yield names, target, None, rule.how


def _to_ours(parts: list[torch.Tensor], how: str, shape: torch.Size) -> torch.Tensor:
    if how == "t":
        return parts[0].t()
    if how == "conv":
        return parts[0].squeeze(1).flip(-1)
    if how.startswith("reshape"):
        return parts[0].reshape(shape)
    if how.startswith("window:"):  # conv2d [out, C, m, m] over an m x m window -> linear over [m, m, C]
        return parts[0].permute(0, 2, 3, 1).reshape(shape)
    if how == "cat":
        return torch.cat(parts, 0)
    if how == "cat_t":
        return torch.cat(parts, 0).t()
    return parts[0]


def _to_checkpoint(t: torch.Tensor, how: str, count: int) -> list[torch.Tensor]:
    """The inverse of _to_ours: our tensor as the checkpoint's tensor(s)."""
    if how == "t":
        return [t.t()]
    if how == "conv":
        return [t.flip(-1).unsqueeze(1)]
    if how.startswith("reshape:"):
        return [t.reshape([int(n) for n in how.split(":")[1].split(",")])]
    if how.startswith("window:"):
        out, channels, m = (int(n) for n in how.split(":")[1].split(","))
        return [t.reshape(out, m, m, channels).permute(0, 3, 1, 2)]
    if how == "cat":
        return list(t.chunk(count, 0))
    if how == "cat_t":
        return list(t.t().chunk(count, 0))
    return [t]


def _dequantise(weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 block-scaled weight [out, in] with scale_inv [ceil(out/128), ceil(in/128)] -> fp32."""
    rows, cols = weight.shape
    blocks = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    if tuple(scale_inv.shape) != blocks:
        raise CheckpointError(f"{name}_scale_inv: shape {list(scale_inv.shape)}, expected {list(blocks)} "
                              f"(one scale per {FP8_BLOCK} x {FP8_BLOCK} block of {list(weight.shape)})")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


@dataclass
class Report:
    family: str = ""
    mapped: int = 0
    missing: list = field(default_factory=list)        # tensors the checkpoint lacks
    unknown: list = field(default_factory=list)        # checkpoint tensors no rule takes
    shape_errors: list = field(default_factory=list)
    conversions: dict = field(default_factory=dict)    # "bf16 -> fp32": count
    dequantised: int = 0                               # FP8 weights dequantised
    ops: list = field(default_factory=list)            # the op each block runs on
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unknown or self.shape_errors)

    def text(self) -> str:
        lines = [f"{self.family}: mapped {self.mapped} tensors, read {self.bytes_read / 2**20:,.1f} MiB"]
        for title, items in (("missing", self.missing), ("shape mismatch", self.shape_errors),
                             ("unknown", self.unknown)):
            if items:
                lines.append(f"{title} ({len(items)}): " + "; ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
        lines += [f"dtype conversion {k}: {v} tensors" for k, v in self.conversions.items()]
        if self.dequantised:
            lines.append(f"FP8 block-scaled weights dequantised: {self.dequantised}")
        return "\n".join(lines + self.ops)


def read_raw_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: a JSON {type(raw).__name__}, not an object of settings")
    if raw.get("model_type") not in FAMILIES:
        raise CheckpointError(f"{path}: model_type {raw.get('model_type')!r} is not one of {sorted(FAMILIES)}")
    return raw


def read_config(directory: str, **overrides) -> HybridConfig:
    """The HybridConfig of a checkpoint directory (by config.json's model_type), with overrides."""
    raw = read_raw_config(directory)
    try:
        cfg = FAMILIES[raw["model_type"]].read_config(raw)
        cfg.validate()
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError) as err:  # values of the wrong kind or out of range
        raise CheckpointError(f"{os.path.join(directory, 'config.json')}: {err}") from None
    cfg = replace(cfg, **overrides)
    cfg.validate()
    return cfg


def fused_ops(cfg: HybridConfig, device: str, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Which op each block will run on (for a model of dtype on device), or why it falls back to
    reference/ or to torch (the DSA calls by contracts' *_kernel_refuses, which the backend reads)."""
    cuda = device == "cuda"
    lines = []
    width = cfg.dsa_topk + (cfg.index_kpool - 1 if cfg.index_kpool and cfg.index_kpool_tail else 0)
    for i, (kind, ffn) in enumerate(zip(cfg.kinds(), cfg.ffn_kinds())):
        if kind == "K":
            attn = "KDA: kda_fwd / kda_bwd (native)"
        elif kind == "A":
            attn = "dense MLA: torch scaled_dot_product_attention (no kernel of ours: dense causal attention)"
        else:
            if cfg.index_kind(i) == "S":
                indexer = "the previous layer's choice"
            elif cfg.index_kpool:
                indexer = "k-pooled indexer: reference (no kernel scores pools yet, issue 25)"
            else:
                why = indexer_kernel_refuses(device, dtype, cfg.dsa_topk, cfg.index_heads, cfg.index_dim)
                indexer = f"lightning_indexer: reference ({why})" if why else "lightning_indexer (native)"
            why = attention_kernel_refuses(device, dtype, width, cfg.dsa_kv_rank + cfg.dsa_rope_dim, cfg.dsa_kv_rank)
            attn = f"{indexer} + SFA: " + (f"reference ({why})" if why else "sparse_attn (native)")
        if ffn == "F":
            mlp = "dense SwiGLU: torch matmuls"
        else:
            aligned = cfg.moe_width % 8 == 0 and cfg.expert_ffn % 8 == 0
            mlp = ("MoE: moe_route + moe_permute + grouped_mm (native)" if aligned or not cuda
                   else "MoE: grouped_mm needs the expert width and expert_ffn multiples of 8 on CUDA")
        lines.append(f"layer {i:>3}: {attn}; {mlp}")
    if cfg.vision is not None:
        lines.append(f"vision tower: {cfg.vision.depth} blocks on torch (SDPA, matmuls), frozen under LoRA")
    return lines


def _expert_range(model: HybridModel) -> range:
    moe = next((b.mlp for b in model.blocks if b.ffn_kind == "M"), None)
    if moe is None:
        return range(0)
    local = moe.w_gate_up.shape[0]
    first = moe.expert_group.rank * local if moe.expert_group is not None else 0
    return range(first, first + local)


def _find(reader: Reader, name: str, family: Family) -> str | None:
    if name in reader:
        return name
    for canonical, alternative in family.aliases:
        if canonical in name and name.replace(canonical, alternative) in reader:
            return name.replace(canonical, alternative)
    return None


def load(model: HybridModel, directory: str, device: str = "cpu", allow_nonfinite: bool = False) -> Report:
    """Loads the checkpoint in `directory` into model (whose experts may be this rank's slice
    under EP). Raises CheckpointError, with the report, before writing anything if a tensor is
    missing, unknown, misshapen, of an integer or bool dtype where the model holds floats, an FP8
    weight lacks its scales, or (unless allow_nonfinite) a weight holds NaN or inf."""
    raw = read_raw_config(directory)
    family = FAMILIES[raw["model_type"]]
    reader = Reader(directory)
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    experts = _expert_range(model)
    report, staged, used = Report(family=raw["model_type"], ops=fused_ops(cfg, device, next(model.parameters()).dtype)), [], set()
    for names, target, slot, how in _expand(cfg, family, experts):
        if target not in params:
            raise CheckpointError(f"family {raw['model_type']!r} maps {names} to {target}, which the model lacks")
        found = [_find(reader, n, family) for n in names]
        report.missing += [n for n, f in zip(names, found) if f is None]
        if None in found:
            continue
        used.update(found)
        dest = params[target] if slot is None else params[target][slot]
        shapes = [reader.entries[f].shape for f in found]
        probe = _to_checkpoint(torch.empty(dest.shape, device="meta"), how, len(names))
        expected = [tuple(p.shape) for p in probe]
        if how.startswith("reshape") and math.prod(shapes[0]) == dest.numel():
            expected = [tuple(shapes[0])]  # any layout of the same elements (e.g. [H] or [1, 1, H, 1])
        bad = [f"{f}: {list(s)}, expected {list(e)}" for f, s, e in zip(found, shapes, expected) if tuple(s) != e]
        bad += [f"{f}: {str(reader.entries[f].dtype).removeprefix('torch.')} values for a floating-point tensor"
                for f in found if dest.is_floating_point() and not reader.entries[f].dtype.is_floating_point]
        scales = []
        for f in found:
            if reader.entries[f].dtype == torch.float8_e4m3fn:
                scale = f + "_scale_inv"
                if scale not in reader:
                    bad.append(f"{f}: FP8 weight without {scale}")
                scales.append(scale)
            else:
                scales.append(None)
        used.update(s for s in scales if s is not None)
        if bad:
            report.shape_errors += bad
            continue
        staged.append((found, scales, dest, how))
    expert_of, layer_of = re.compile(r"\.experts\.(\d+)\."), re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")
    for name in reader.entries:
        m, layer = expert_of.search(name), layer_of.search(name)
        owned_elsewhere = m is not None and int(m.group(1)) not in experts and int(m.group(1)) < cfg.experts
        beyond = layer is not None and int(layer.group(1)) >= cfg.layers  # e.g. DeepSeek's multi-token-prediction layer
        if name not in used and not owned_elsewhere and not beyond:
            report.unknown.append(name)
    if not report.ok:
        raise CheckpointError(f"{directory}: cannot load\n{report.text()}")
    values, nonfinite = [], []
    for found, scales, dest, how in staged:  # every read happens before the first write
        parts = []
        for f, s in zip(found, scales):
            t = reader.read(f)
            if t.is_floating_point() and not allow_nonfinite:
                count = int((~torch.isfinite(t if t.element_size() > 1 else t.float())).sum())  # (fp8: no isfinite)
                if count:
                    nonfinite.append(f"{f}: {count} of {t.numel()}")
            if s is not None:
                t = _dequantise(t, reader.read(s), f)
                report.dequantised += 1
            parts.append(t)
        t = _to_ours(parts, how, dest.shape)
        key = f"{str(t.dtype).removeprefix('torch.')} -> {str(dest.dtype).removeprefix('torch.')}"
        if t.dtype != dest.dtype:
            report.conversions[key] = report.conversions.get(key, 0) + 1
        values.append((dest, t))
    if nonfinite:
        raise CheckpointError(f"{directory}: NaN or inf in {len(nonfinite)} tensors (load(..., allow_nonfinite=True) "
                              f"takes them as they are): " + "; ".join(nonfinite[:8]))
    with torch.no_grad():
        for dest, t in values:
            dest.copy_(t)
    report.mapped, report.bytes_read = len(values), reader.bytes_read
    return report


def from_pretrained(path: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    backend: str = "native", lora_rank: int = 0, lora_targets: str = "all",
                    allow_nonfinite: bool = False, **overrides) -> HybridModel:
    """A HybridModel with a checkpoint's weights: config.json's model_type picks the family
    (kimi_linear, deepseek_v32, glm5_next, kda_dsa_ops); overrides replace HybridConfig fields (e.g.
    capacity_factor). dtype: the model's (default: the checkpoint's, float32 if unstated).
    lora_rank > 0 adds fresh adapters (the base frozen), ready to fine-tune, on lora_targets
    ("all" projections or "attention" only; see HybridModel). Bad checkpoints raise
    CheckpointError (see load)."""
    raw = read_raw_config(path)
    cfg = read_config(path, **overrides)
    if dtype is None:
        dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))
    device = torch.device(device or "cpu")
    with torch.device(device):
        model = HybridModel(cfg, lora_rank=lora_rank, backend=backend, lora_targets=lora_targets).to(dtype)
    if lora_rank > 0:  # adapters train in fp32 whatever the base's dtype
        for module in model.modules():
            if isinstance(module, LoRALinear) and module.rank > 0:
                module.lora_a.data, module.lora_b.data = module.lora_a.data.float(), module.lora_b.data.float()
    load(model, path, device.type, allow_nonfinite)
    model.source_config = raw
    return model


def _our_tensor(model: HybridModel, params: dict, target: str, slot: int | None) -> torch.Tensor:
    """Our tensor for export: LoRA adapters merged into their base weight."""
    if target.endswith(".base.weight"):
        module = model.get_submodule(target.removesuffix(".base.weight"))
        if isinstance(module, LoRALinear):
            return module.effective_weight().detach()
    t = params[target]
    return (t if slot is None else t[slot]).detach()


def export(model: HybridModel, directory: str, family: str | None = None, shard_bytes: int = 1 << 30,
           dtype: torch.dtype | None = None) -> None:
    """Writes model (unsharded; LoRA merged into the base weights) as a checkpoint of `family`
    (default: the one it was loaded from, else our own format): config.json (the source's,
    when the model came from that family) and sharded safetensors."""
    source = getattr(model, "source_config", None)
    family = family or (source or {}).get("model_type", OWN_FORMAT)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors = {}
    for names, target, slot, how in _expand(cfg, FAMILIES[family], range(cfg.experts)):
        ours = _our_tensor(model, params, target, slot)
        for name, t in zip(names, _to_checkpoint(ours, how, len(names))):
            t = t.contiguous()
            tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    write_sharded(directory, tensors, shard_bytes)
    if source is not None and source.get("model_type") == family:
        config = dict(source)
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
    elif family == OWN_FORMAT:
        config = {"model_type": OWN_FORMAT, **asdict(cfg)}
    else:
        raise ValueError(f"export to {family!r} needs a model loaded from a {family} checkpoint (its config.json)")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def export_adapters(model: HybridModel, directory: str, family: str | None = None) -> dict:
    """Writes the LoRA adapters alone in PEFT's format (adapter_config.json +
    adapter_model.safetensors, named after transformers' modules of `family`), so that
    peft.PeftModel.from_pretrained(<the transformers model>, directory) computes what this model
    computes. An adapter on weights the checkpoint keeps apart (a fused gate/up) becomes one
    adapter per part, sharing A. Returns the adapter config."""
    family = family or (getattr(model, "source_config", None) or {}).get("model_type", OWN_FORMAT)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    tensors, modules, ranks, scalings = {}, [], set(), set()
    for names, target, slot, how in _expand(model.cfg, FAMILIES[family], range(model.cfg.experts)):
        if slot is not None or not target.endswith(".base.weight"):
            continue
        lora = model.get_submodule(target.removesuffix(".base.weight"))
        if not isinstance(lora, LoRALinear) or lora.rank == 0:
            continue
        if how not in ("identity", "cat"):
            raise ValueError(f"an adapter on {target} ({how}) has no PEFT form")
        if family in ("deepseek_v32", "glm5_next") and names[0].endswith(("gate_proj.weight", "up_proj.weight",
                                                                           "down_proj.weight")):
            raise ValueError(f"peft reads adapters on modules named gate_proj / up_proj / down_proj of a {family} "
                             f"model as the fused experts' ({names[0]}): train with lora_targets='attention' to "
                             f"export the adapters for peft, or export the merged weights")
        ranks.add(lora.rank)
        scalings.add(lora.scaling)
        for name, b in zip(names, lora.lora_b.detach().chunk(len(names), 0)):
            module = name.removesuffix(".weight")
            modules.append(module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = lora.lora_a.detach().float().contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.float().contiguous()
    if not modules:
        raise ValueError("the model has no LoRA adapters (build it with lora_rank > 0)")
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"PEFT's format holds one rank and scaling, the adapters have {ranks} / {scalings}")
    rank, scaling = ranks.pop(), scalings.pop()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scaling * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": "^(?:" + "|".join(re.escape(m) for m in modules) + ")$",
              "base_model_name_or_path": None}
    os.makedirs(directory, exist_ok=True)
    write_file(os.path.join(directory, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config


def main(argv=None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="directory with config.json and the safetensors files")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        cfg = read_config(args.checkpoint)
    except CheckpointError as err:
        raise SystemExit(f"onboard: {err}") from None
    preset = next((n for n, c in PRESETS.items() if c == cfg), None)
    print(f"config: {cfg}" + (f" (preset {preset})" if preset else ""))
    with torch.device("cpu"):
        model = HybridModel(cfg)
    try:
        report = load(model, args.checkpoint, args.device)
    except CheckpointError as err:
        raise SystemExit(f"onboard: {err}") from None
    print(report.text())
    return report


if __name__ == "__main__":
    main()
