"""Model onboarding: read a Hugging-Face-style checkpoint (config.json + safetensors, single or
sharded) of this model family, map its tensors onto HybridModel with a declarative table per
family, report what did not map, and say which fused op each block will run on.

    python -m kda_dsa_ops.onboard CHECKPOINT_DIR [--family kimi-hybrid] [--device cuda]

Loading reads tensor by tensor (never the whole checkpoint into memory); under expert
parallelism a rank reads only the experts it owns. Everything is read and checked first; the
model is written only when every tensor is present with the right shape, so a bad checkpoint
leaves nothing half-loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field, fields

import torch

from .models import HybridConfig, HybridModel
from .models.hybrid import PRESETS
from .safetensors_io import CheckpointError, Reader, write_sharded

# A family: config.json keys -> HybridConfig fields, and tensor names -> our parameter names.
# Templates: {i} a layer, {e} an expert. Kinds: "all" layers, "K" (KDA) or "D" (DSA) layers.
# Transforms: "identity"; "t" (transpose: the checkpoint stores [out, in] where we hold [in, out]);
# "conv" (depthwise conv1d [C, 1, W] with the current token last -> our [C, W], current first).
FAMILIES = {
    "kimi-hybrid": {
        "config": {
            "vocab_size": "vocab", "hidden_size": "hidden", "num_hidden_layers": "layers", "layer_pattern": "pattern",
            "linear_attn_num_heads": "kda_heads", "linear_attn_num_value_heads": "kda_value_heads",
            "linear_attn_head_dim": "kda_head_dim", "linear_attn_gate_rank": "kda_gate_rank",
            "num_attention_heads": "dsa_heads", "q_lora_rank": "dsa_q_rank", "kv_lora_rank": "dsa_kv_rank",
            "qk_rope_head_dim": "dsa_rope_dim", "index_n_heads": "index_heads", "index_head_dim": "index_dim",
            "index_topk": "dsa_topk", "n_routed_experts": "experts", "num_experts_per_tok": "moe_topk",
            "moe_latent_size": "latent", "moe_intermediate_size": "expert_ffn",
            "shared_expert_intermediate_size": "shared_ffn",
        },
        "tensors": [
            ("all", "model.embed_tokens.weight", "embed.weight", "identity"),
            ("all", "lm_head.weight", "lm_head", "identity"),
            ("all", "model.norm.weight", "norm.weight", "identity"),
            ("all", "model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.weight", "identity"),
            ("all", "model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.moe_norm.weight", "identity"),
            *[("K", f"model.layers.{{i}}.self_attn.{src}", f"blocks.{{i}}.attn.{dst}", tf) for src, dst, tf in [
                ("q_proj.weight", "q_proj.base.weight", "identity"), ("k_proj.weight", "k_proj.base.weight", "identity"),
                ("v_proj.weight", "v_proj.base.weight", "identity"), ("q_conv1d.weight", "q_conv.weight", "conv"),
                ("k_conv1d.weight", "k_conv.weight", "conv"), ("v_conv1d.weight", "v_conv.weight", "conv"),
                ("f_a_proj.weight", "g_down.weight", "identity"), ("f_b_proj.weight", "g_up.weight", "identity"),
                ("A_log", "A_log", "identity"), ("dt_bias", "dt_bias", "identity"),
                ("b_proj.weight", "b_proj.weight", "identity"), ("o_norm.weight", "o_norm.weight", "identity"),
                ("g_proj.weight", "o_gate.base.weight", "identity"), ("o_proj.weight", "o_proj.base.weight", "identity"),
            ]],
            *[("D", f"model.layers.{{i}}.self_attn.{src}", f"blocks.{{i}}.attn.{dst}", tf) for src, dst, tf in [
                ("q_a_proj.weight", "q_down.base.weight", "identity"), ("q_a_layernorm.weight", "q_norm.weight", "identity"),
                ("q_b_proj.weight", "q_up.base.weight", "identity"),
                ("kv_a_proj_with_mqa.weight", "kv_down.base.weight", "identity"),
                ("kv_a_layernorm.weight", "kv_norm.weight", "identity"), ("g_proj.weight", "gate.base.weight", "identity"),
                ("o_proj.weight", "o_proj.base.weight", "identity"), ("indexer.wq_b.weight", "index_q.weight", "identity"),
                ("indexer.wk.weight", "index_k.weight", "identity"),
                ("indexer.weights_proj.weight", "index_w.weight", "identity"),
            ]],
            *[("all", f"model.layers.{{i}}.mlp.{src}", f"blocks.{{i}}.moe.{dst}", tf) for src, dst, tf in [
                ("gate.weight", "router", "t"), ("gate.e_score_correction_bias", "router_bias", "identity"),
                ("latent_down_proj.weight", "down.base.weight", "identity"), ("latent_norm.weight", "norm.weight", "identity"),
                ("latent_up_proj.weight", "up.base.weight", "identity"),
                ("shared_experts.gate_up_proj.weight", "shared.gate_up.base.weight", "identity"),
                ("shared_experts.down_proj.weight", "shared.down.base.weight", "identity"),
                ("experts.{e}.gate_up_proj.weight", "w_gate_up.{e}", "t"), ("experts.{e}.down_proj.weight", "w_down.{e}", "t"),
            ]],
        ],
    },
}


def _transform(t: torch.Tensor, how: str, inverse: bool = False) -> torch.Tensor:
    if how == "t":
        return t.t()
    if how == "conv":
        return t.flip(-1).unsqueeze(1) if inverse else t.squeeze(1).flip(-1)
    return t


@dataclass
class Report:
    mapped: int = 0
    missing: list = field(default_factory=list)        # our tensors the checkpoint lacks
    unmapped: list = field(default_factory=list)       # checkpoint tensors no rule takes
    shape_errors: list = field(default_factory=list)
    conversions: dict = field(default_factory=dict)    # "bf16 -> fp32": count
    ops: list = field(default_factory=list)            # the op each block runs on
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.shape_errors)

    def text(self) -> str:
        lines = [f"mapped {self.mapped} tensors, read {self.bytes_read / 2**20:,.1f} MiB"]
        for title, items in (("missing", self.missing), ("shape mismatch", self.shape_errors),
                             ("unmapped (ignored)", self.unmapped)):
            if items:
                lines.append(f"{title} ({len(items)}): " + "; ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
        lines += [f"dtype conversion {k}: {v} tensors" for k, v in self.conversions.items()]
        return "\n".join(lines + self.ops)


def read_config(directory: str, family: str = "kimi-hybrid") -> HybridConfig:
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    names = FAMILIES[family]["config"]
    known = {f.name for f in fields(HybridConfig)}
    values = {names[k]: v for k, v in raw.items() if k in names and names[k] in known}
    missing = [k for k, v in names.items() if v not in values]
    if missing:
        raise CheckpointError(f"{directory}/config.json lacks {missing}")
    cfg = HybridConfig(**values)
    cfg.validate()
    return cfg


def dsa_cuda_limits(cfg: HybridConfig) -> str | None:
    """Why the DSA CUDA kernels cannot take this model's shapes, or None (they run in bf16/fp16:
    a model run in fp32 on a GPU takes the reference for these ops)."""
    dqk, dv = cfg.dsa_kv_rank + cfg.dsa_rope_dim, cfg.dsa_kv_rank
    if cfg.index_heads > 64 or cfg.index_dim % 8 or cfg.index_dim > 128:
        return f"the CUDA indexer takes up to 64 heads of a multiple of 8 up to 128, got {cfg.index_heads} x {cfg.index_dim}"
    if dqk % 8 or not (dqk <= 128 or (dqk <= 576 and dv <= 512)):
        return f"the CUDA sparse attention takes Dqk <= 128, or <= 576 with dv <= 512 (multiples of 8), got {dqk} / {dv}"
    return None


def fused_ops(cfg: HybridConfig, device: str) -> list[str]:
    """Which op each block will run on, or why it falls back to reference/."""
    cuda = device == "cuda"
    lines = []
    for i, kind in enumerate(cfg.kinds()):
        if kind == "K":
            attn = "KDA: kda_fwd / kda_bwd (native)"
        else:
            attn = "LI + SFA: lightning_indexer + sparse_attn (native)"
            why = dsa_cuda_limits(cfg) if cuda else None
            if why:
                attn = f"LI + SFA: reference ({why})"
        aligned = cfg.latent % 8 == 0 and cfg.expert_ffn % 8 == 0
        moe = ("grouped GEMM: grouped_mm (native)" if aligned or not cuda
               else "grouped GEMM: needs latent and expert_ffn multiples of 8 on CUDA")
        lines.append(f"layer {i:>3}: {attn}; {moe}")
    return lines


def _rules(cfg: HybridConfig, family: str, experts: range):
    """(checkpoint name, our name, expert slot or None, transform) for every tensor we need."""
    kinds = cfg.kinds()
    for kind, src, dst, how in FAMILIES[family]["tensors"]:
        layers = range(cfg.layers) if "{i}" in src else [None]
        for i in layers:
            if i is not None and kind != "all" and kinds[i] != kind:
                continue
            for e in (experts if "{e}" in src else [None]):
                name = src.format(i=i, e=e)
                target = dst.format(i=i, e=e)
                if e is not None:
                    yield name, target.rsplit(".", 1)[0], e - experts.start, how
                else:
                    yield name, target, None, how


def load(model: HybridModel, directory: str, family: str = "kimi-hybrid", device: str = "cpu") -> Report:
    """Loads the checkpoint into model (whose experts may be this rank's slice under EP). Raises
    CheckpointError, with the report, before writing anything if a tensor is missing or misshapen."""
    reader = Reader(directory)
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    local = next(p for n, p in params.items() if n.endswith("moe.w_gate_up")).shape[0]
    first = (model.blocks[0].moe.expert_group.rank * local) if model.blocks[0].moe.expert_group else 0
    experts = range(first, first + local)
    report, staged, used = Report(ops=fused_ops(cfg, device)), [], set()
    for name, target, slot, how in _rules(cfg, family, experts):
        if target not in params:
            raise CheckpointError(f"family {family!r} maps {name} to {target}, which the model does not have")
        used.add(name)
        if name not in reader:
            report.missing.append(name)
            continue
        dest = params[target] if slot is None else params[target][slot]
        shape = reader.entries[name].shape
        expected = tuple(_transform(torch.empty(dest.shape, device="meta"), how, inverse=True).shape)
        if shape != expected:
            report.shape_errors.append(f"{name}: {list(shape)}, expected {list(expected)}")
            continue
        staged.append((name, dest, how))
    owned_elsewhere = re.compile(r"\.experts\.(\d+)\.")
    for name in reader.entries:
        m = owned_elsewhere.search(name)
        if name not in used and not (m and int(m.group(1)) not in experts and int(m.group(1)) < cfg.experts):
            report.unmapped.append(name)
    if not report.ok:
        raise CheckpointError(f"{directory}: cannot load\n{report.text()}")
    values = []
    for name, dest, how in staged:  # every read happens before the first write
        t = _transform(reader.read(name), how)
        key = f"{str(t.dtype).removeprefix('torch.')} -> {str(dest.dtype).removeprefix('torch.')}"
        if t.dtype != dest.dtype:
            report.conversions[key] = report.conversions.get(key, 0) + 1
        values.append((dest, t))
    with torch.no_grad():
        for dest, t in values:
            dest.copy_(t)
    report.mapped, report.bytes_read = len(values), reader.bytes_read
    return report


def export(model: HybridModel, directory: str, family: str = "kimi-hybrid", shard_bytes: int = 1 << 30,
           dtype: torch.dtype | None = None) -> None:
    """Writes model (unsharded) as a checkpoint of `family`: config.json and sharded safetensors."""
    cfg = model.cfg
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors = {}
    for name, target, slot, how in _rules(cfg, family, range(cfg.experts)):
        t = params[target] if slot is None else params[target][slot]
        t = _transform(t.detach(), how, inverse=True).contiguous()
        tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    write_sharded(directory, tensors, shard_bytes)
    names = {v: k for k, v in FAMILIES[family]["config"].items()}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({names[k]: v for k, v in vars(cfg).items() if k in names}, f, indent=1)


def main(argv=None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="directory with config.json and the safetensors files")
    p.add_argument("--family", choices=sorted(FAMILIES), default="kimi-hybrid")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    cfg = read_config(args.checkpoint, args.family)
    preset = next((n for n, c in PRESETS.items() if c == cfg), None)
    print(f"config: {cfg}" + (f" (preset {preset})" if preset else ""))
    with torch.device("cpu"):
        model = HybridModel(cfg)
    report = load(model, args.checkpoint, args.family, args.device)
    print(report.text())
    return report


if __name__ == "__main__":
    main()
