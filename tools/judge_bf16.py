"""The real families' tiny checkpoints (tests/real_checkpoints.py, transformers' initialisation) in
bf16 on the CUDA kernels against transformers' float64 eager logits: the relative RMS error per
family, and onboard's block-to-op table for each.

    PYTHONPATH=python:tests python tools/judge_bf16.py DIR
"""

import sys
import tempfile

import torch

import real_checkpoints
from kda_dsa_ops import onboard
from test_real_models import judged_logits, load_judge, tokens_and_bounds


def main(directory: str) -> None:
    for family in sorted(real_checkpoints.CONFIGS):
        path = f"{directory}/{family}"
        real_checkpoints.write(family, path, unit_scale=False, **real_checkpoints.BF16_OVERRIDES.get(family, {}))
        judge = load_judge(family, path)
        model = onboard.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
        tokens, cu = tokens_and_bounds(model.cfg.vocab, family=family)
        with torch.no_grad():
            ours = model.logits(tokens.cuda(), cu.cuda()).double().cpu()
        theirs = judged_logits(judge, tokens, cu)
        print(f"{family}: bf16 on CUDA vs the float64 judge, relative RMS {((ours - theirs).norm() / theirs.norm()):.2e}")
        print("\n".join(onboard.fused_ops(model.cfg, "cuda")))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
