"""Test helpers: memory poisoning, opcheck wrapper, input builders shared by the test files."""

import torch

POISON_BYTE = 0xFE  # fp16 NaN, bf16/fp32 -1.7e38, int32 -16843010: unwritten outputs cannot pass


def poison(device) -> None:
    """Fill memory the CUDA caching allocator will hand out next, so outputs a kernel fails to
    write show up as garbage instead of stale correct values (no-op on CPU)."""
    if torch.device(device).type != "cuda":
        return
    blocks = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1 << 26, 1 << 22, 1 << 20, 1 << 16, 1 << 12)]
    for b in blocks:
        b.fill_(POISON_BYTE)
    del blocks


OPCHECK_ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args, kwargs=None, test_utils=OPCHECK_ALL):
    """torch.library.opcheck (every test utility unless told); raises on failure."""
    result = torch.library.opcheck(op, args, kwargs or {}, test_utils=test_utils)
    failed = {k: v for k, v in result.items() if v != "SUCCESS"}
    assert not failed, failed


# The backward ops have no autograd of their own (no double backward): their schema and fake kernel
BACKWARD_UTILS = ("test_schema", "test_faketensor")


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (first and last dims swapped in memory), keeping
    requires_grad: valid input the ops must take, whose gradients come back contiguous."""
    out = t.detach().transpose(0, -1).contiguous().transpose(0, -1)
    return out.requires_grad_(t.requires_grad)


def offsets_from_counts(counts, device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
