"""Activation offload with prefetch: what each block saves for the backward goes to pinned host
memory during the forward (copies on a side stream, behind the forward's compute) and comes back
one block ahead in the backward: when block i's backward first needs its activations, block
i - 1's are already being copied back on the side stream, behind block i's backward.

    offload = ActivationOffload(device)
    for i, block in enumerate(blocks):
        with offload.block(i):
            x = block(x)
    loss.backward()   # unpacks block n-1, prefetches n-2, ...

Parameters and tensors under `min_bytes` (scalars, small norms) stay on the device. On a CPU device the copies
are plain host copies, so the bookkeeping runs (and is tested) without a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


class _Saved:
    """One offloaded tensor: its host copy, and its device copy once fetched back."""

    __slots__ = ("host", "device", "ready")

    def __init__(self, host: Tensor):
        self.host, self.device, self.ready = host, None, None


class ActivationOffload:
    def __init__(self, device: torch.device, min_bytes: int = 1 << 16):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda" means the current device (tensors say cuda:N)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.min_bytes = min_bytes
        self.groups: dict[int, list[_Saved]] = {}
        self.begun: set[int] = set()  # blocks whose backward has started
        self.events: list[tuple[str, int]] = []  # ("backward", block) and ("fetch", block), in order

    def _side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _pack(self, group: int, t: Tensor):
        if (t.device != self.device or t.numel() * t.element_size() < self.min_bytes
                or isinstance(t, torch.nn.Parameter)):  # weights stay where they live anyway
            return t
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with self._side():
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory stays ours until the copy is done
        else:
            host = t.detach().clone()
        saved = _Saved(host)
        self.groups.setdefault(group, []).append(saved)
        return group, saved

    def _fetch_one(self, s: _Saved) -> None:
        with self._side():
            s.device = s.host.to(self.device, non_blocking=True)
            if self.cuda:
                s.ready = torch.cuda.Event()
                s.ready.record(self.stream)

    def _fetch(self, group: int) -> None:
        entries = [s for s in self.groups.get(group, []) if s.device is None]
        if entries:
            self.events.append(("fetch", group))
        for s in entries:
            self._fetch_one(s)

    def _unpack(self, packed):
        if isinstance(packed, Tensor):
            return packed
        group, saved = packed
        if group not in self.begun:  # this block's backward starts: it, and the next block back
            self.begun.add(group)
            self.events.append(("backward", group))
            self._fetch(group)
            self._fetch(max((g for g in self.groups if g < group), default=-1))
        if saved.device is None:  # unpacked before (a graph kept for a second backward)
            self._fetch_one(saved)
        t, saved.device = saved.device, None  # from here the graph holds the device copy
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            t.record_stream(current)
        return t

    def block(self, group: int):
        """The context in which block `group` runs its forward."""
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack)
