"""Onboarding in our own checkpoint format (config.json + sharded safetensors, model_type
kda_dsa_ops): a round trip gives identical outputs, a rank under expert parallelism reads only
its experts (counted in bytes), and bad checkpoints fail with a clear message and leave the model
untouched. The real families (kimi_linear, deepseek_v32) are in test_real_models.py."""

import json
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from kda_dsa_ops import onboard
from kda_dsa_ops.models import HybridModel, get_config
from kda_dsa_ops.safetensors_io import CheckpointError, Reader, write_file

from test_model import packed_batch


@pytest.fixture
def checkpoint():
    torch.manual_seed(0)
    cfg = get_config("tiny")
    model = HybridModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        onboard.export(model, d, shard_bytes=150_000)
        yield model, d


def fresh(cfg, seed=1):
    torch.manual_seed(seed)
    return HybridModel(cfg)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_gives_identical_outputs(checkpoint):
    model, d = checkpoint
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1  # sharded
    cfg = onboard.read_config(d)
    assert cfg == model.cfg
    other = fresh(cfg)
    report = onboard.load(other, d)
    assert report.ok and not report.unknown and not report.conversions
    tokens, cu, labels = packed_batch(cfg, [20, 33])
    assert torch.equal(other(tokens, cu, labels)["loss"], model(tokens, cu, labels)["loss"])


def test_bf16_checkpoint_reports_the_conversion():
    torch.manual_seed(0)
    model = HybridModel(get_config("tiny"))
    with tempfile.TemporaryDirectory() as d:
        onboard.export(model, d, dtype=torch.bfloat16)
        report = onboard.load(fresh(model.cfg), d)
    assert report.conversions == {"bfloat16 -> float32": report.mapped}


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_reads_only_its_experts(checkpoint, rank):
    model, d = checkpoint
    cfg, ep = model.cfg, 2
    local = cfg.experts // ep
    shard = fresh(cfg)
    for block in shard.blocks:  # this rank's slice of the experts, as parallel.shard_experts leaves it
        moe = block.mlp
        moe.w_gate_up = torch.nn.Parameter(moe.w_gate_up.detach()[:local].clone())
        moe.w_down = torch.nn.Parameter(moe.w_down.detach()[:local].clone())
        moe.expert_group = SimpleNamespace(rank=rank)
    report = onboard.load(shard, d)
    entries = Reader(d).entries
    mine = [n for n in entries if ".experts." not in n or rank * local <= int(n.split(".experts.")[1].split(".")[0])
            < (rank + 1) * local]
    assert len(mine) < len(entries)
    assert report.bytes_read == sum(entries[n].end - entries[n].begin for n in mine)
    assert report.bytes_read < sum(e.end - e.begin for e in entries.values())
    for full, part in zip(model.blocks, shard.blocks):
        assert torch.equal(part.mlp.w_gate_up, full.mlp.w_gate_up[rank * local:(rank + 1) * local])
        assert torch.equal(part.mlp.w_down, full.mlp.w_down[rank * local:(rank + 1) * local])


def rewrite(directory, name, tensor=None):
    """Rewrite the shard holding `name` (or the first shard, for a new name) with that tensor
    replaced or added (or dropped when tensor is None)."""
    reader = Reader(directory)
    file = (reader.entries[name] if name in reader.entries else next(iter(reader.entries.values()))).file
    tensors = {n: reader.read(n) for n, e in reader.entries.items() if e.file == file and n != name}
    if tensor is not None:
        tensors[name] = tensor
    write_file(file, tensors)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"),
    ("shape", r"shape mismatch \(1\): blocks.0.attn.q_proj.base.weight: \[3, 3\], expected \[32, 64\]"),
    ("missing", r"missing \(1\): blocks.3.attn.indexer.k.weight"),
    ("unknown", r"unknown \(1\): blocks.1.attn.stray"),
    ("model_type", r"model_type 'llama' is not one of"),
])
def test_bad_checkpoints_fail_and_leave_nothing_half_loaded(checkpoint, damage, message):
    model, d = checkpoint
    if damage == "truncate":
        last = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
        path = os.path.join(d, last)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    elif damage == "shape":
        rewrite(d, "blocks.0.attn.q_proj.base.weight", torch.zeros(3, 3))
    elif damage == "missing":
        rewrite(d, "blocks.3.attn.indexer.k.weight")
    elif damage == "unknown":
        rewrite(d, "blocks.1.attn.stray", torch.zeros(2))
    else:
        config = os.path.join(d, "config.json")
        with open(config) as f:
            raw = json.load(f)
        with open(config, "w") as f:
            json.dump(dict(raw, model_type="llama"), f)
    target = fresh(model.cfg)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=message):
        onboard.load(target, d)
    after = snapshot(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_reports_ops_per_block(checkpoint, capsys):
    _, d = checkpoint
    report = onboard.main([d, "--device", "cpu"])
    out = capsys.readouterr().out
    assert report.ok and "preset tiny" in out and "layer   3: lightning_indexer (native) + SFA: sparse_attn (native)" in out


def test_fused_ops_says_which_blocks_run_native_on_cuda():
    from kda_dsa_ops.models import get_config
    from kda_dsa_ops.onboard import fused_ops

    small = fused_ops(get_config("small"), "cuda")
    assert all("lightning_indexer (native) + SFA: sparse_attn (native)" in line for line in small if "SFA" in line)
    wide = [line for line in fused_ops(get_config("small", index_heads=96), "cuda") if "SFA" in line]
    assert wide and all("lightning_indexer: reference (the CUDA indexer takes up to 64 heads" in line
                        and "SFA: sparse_attn (native)" in line for line in wide)
    assert all("(native)" in line for line in fused_ops(get_config("small", index_heads=96), "cpu"))
    fp32 = fused_ops(get_config("small"), "cuda", torch.float32)  # what the backend does: the reference
    assert any("SFA: reference (the CUDA kernels take bf16 / fp16, the model is float32)" in line for line in fp32)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"], ids=["cpu-tensors", "gpu-tensors"])
def test_the_native_backend_takes_what_the_report_says(monkeypatch, device_type):
    """One table (contracts.*_kernel_refuses) decides both: a call the report puts on the reference
    goes to the reference, one it puts on the kernels goes to the kernels (the ops are replaced by
    recorders, so no GPU is needed)."""
    from kda_dsa_ops import ops, reference
    from kda_dsa_ops.nn import backend

    calls = []
    for module, name in ((ops, "native"), (reference, "reference")):
        for op in ("lightning_indexer", "sparse_attention"):
            monkeypatch.setattr(module, op, lambda *a, _n=name, _op=op, **kw: calls.append((_op, _n)))
    fake = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
    # (indexer heads, dim), (Dqk, dv), keys per query: GLM-5.3's NoPE layer with its pooled tail
    # (2063 keys) on the kernels, past MAX_KEYS on the reference
    cases = [((96, 64), (576, 512), 16), ((64, 64), (576, 512), 16), ((64, 64), (1024, 512), 16),
             ((64, 12), (128, 128), 16), ((32, 128), (512, 512), 2063), ((32, 128), (512, 512), 4097)]
    for (heads, dim), (dqk, dv), keys in cases:
        calls.clear()
        with monkeypatch.context() as m:  # meta tensors that say they live on device_type
            m.setattr(torch.Tensor, "device", property(lambda self: torch.device(device_type)))
            backend.NATIVE.lightning_indexer(fake(4, heads, dim), fake(4, dim), fake(4, heads), None, None, 16)
            backend.NATIVE.sparse_attention(fake(4, 8, dqk), fake(4, 1, dqk), fake(4, 1, keys, dtype=torch.int32),
                                            dv=dv)
        cuda = device_type == "cuda"
        want = [("lightning_indexer", "reference" if cuda and (heads > 64 or dim % 8) else "native"),
                ("sparse_attention", "reference" if keys > 4096 or cuda and dqk > 576 else "native")]
        assert calls == want, ((heads, dim), (dqk, dv), keys, device_type)


def write_raw(path, header: dict | list, data: bytes = b"", header_bytes: bytes | None = None):
    """A .safetensors file with the given header (JSON) and data bytes, written by hand."""
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("case, message", [
    ("offsets shifted", r"w's bytes start at 4, expected 0"),
    ("gap", r"b's bytes start at 20, expected 16"),
    ("trailing bytes", "4 bytes after the last tensor's data"),
    ("header a list", "the header is a JSON list, not an object of tensors"),
    ("no offsets", "tensor w's entry needs a dtype, a shape and two data_offsets"),
    ("malformed json", "unreadable header"),
])
def test_malformed_safetensors_files_raise_checkpoint_errors(tmp_path, case, message):
    """The layout the format requires: offsets tile the data exactly, an object of entries."""
    path = str(tmp_path / "model.safetensors")
    w = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    if case == "offsets shifted":
        write_raw(path, {"w": dict(w, data_offsets=[4, 20])}, bytes(20))
    elif case == "gap":
        write_raw(path, {"w": w, "b": dict(w, data_offsets=[20, 36])}, bytes(36))
    elif case == "trailing bytes":
        write_raw(path, {"w": w}, bytes(20))
    elif case == "header a list":
        write_raw(path, [w])
    elif case == "no offsets":
        write_raw(path, {"w": {"dtype": "F32", "shape": [4]}}, bytes(16))
    else:
        write_raw(path, {}, header_bytes=b'{"w": {"dtype": ')
    with pytest.raises(CheckpointError, match=message):
        Reader(path)


def test_bad_checkpoint_directories_raise_checkpoint_errors(checkpoint, tmp_path):
    _, d = checkpoint
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        Reader(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \.safetensors file"):
        Reader(str(tmp_path / "empty"))
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    first = sorted(set(weight_map.values()))[0]
    os.rename(os.path.join(d, first), os.path.join(d, first + ".moved"))
    with pytest.raises(CheckpointError, match=f"names files that are not there: \\['{first}'\\]"):
        Reader(d)
    os.rename(os.path.join(d, first + ".moved"), os.path.join(d, first))
    with open(index, "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        Reader(d)
    with open(index, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        Reader(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(SystemExit, match="config.json: a JSON list"):
        onboard.main([d, "--device", "cpu"])


def test_a_tensor_twice_integer_values_and_nonfinite_weights_are_refused(checkpoint, tmp_path):
    model, d = checkpoint
    name = "blocks.0.attn.q_proj.base.weight"
    shard = Reader(d).entries[name].file
    other = next(e.file for e in Reader(d).entries.values() if e.file != shard)
    rewrite(d, "blocks.0.attn.q_proj.base.weight", Reader(d).read(name).view(torch.int32))
    target = fresh(model.cfg)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=f"{name}: int32 values for a floating-point tensor"):
        onboard.load(target, d)
    rewrite(d, name, Reader(d).read(name).view(torch.float32).clone().index_fill_(1, torch.tensor([3]), math.nan))
    with pytest.raises(CheckpointError, match=rf"NaN or inf in 1 tensors .*{name}: 32 of 2048"):
        onboard.load(target, d)
    assert all(torch.equal(v, before[k]) for k, v in snapshot(target).items())
    onboard.load(target, d, allow_nonfinite=True)  # taken as they are when the user says so
    assert torch.isnan(target.blocks[0].attn.q_proj.base.weight).sum() == 32
    reader = Reader(other)
    tensors = {n: reader.read(n) for n in reader.entries}
    write_file(other, {**tensors, name: torch.zeros(32, 64)})
    with pytest.raises(CheckpointError, match=f"tensor {name} is also in"):
        Reader(d)
