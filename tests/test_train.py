"""train.py on CPU: the recall task, exact resume from a checkpoint, LoRA from a trained
checkpoint under FSDP2 + EP on 2 gloo processes, and layout errors before any work."""

import json
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from kda_dsa_ops import train
from kda_dsa_ops.train import recall_batch, warmup_lr

COMMON = ["--config", "tiny", "--seqs", "2", "--pairs", "4", "--queries", "2", "--log-every", "1000"]


def test_recall_batch_labels_are_the_asked_values():
    tokens, cu, labels = recall_batch(256, seqs=3, pairs=5, queries=2, seed=1)
    length = 2 * 5 + 2
    assert cu.tolist() == [0, length, 2 * length, 3 * length]
    for s in range(3):
        seq, lab = tokens[s * length:(s + 1) * length], labels[s * length:(s + 1) * length]
        pairs = dict(zip(seq[:10:2].tolist(), seq[1:10:2].tolist()))
        assert (lab[:10] == -100).all()
        for key, value in zip(seq[10:].tolist(), lab[10:].tolist()):
            assert pairs[key] == value


@pytest.mark.filterwarnings("error")  # a single-process save or load says it is one (no_dist), not DCP's guess
def test_resume_reproduces_the_next_steps_exactly():
    """Also across a learning-rate warmup that the checkpoint falls inside."""
    warmup = ["--warmup-steps", "5"]
    with tempfile.TemporaryDirectory() as d:
        straight = train.main(COMMON + warmup + ["--steps", "6", "--out", os.path.join(d, "a")])["history"]
        train.main(COMMON + warmup + ["--steps", "3", "--checkpoint-every", "3", "--out", os.path.join(d, "b")])
        resumed = train.main(COMMON + warmup + ["--steps", "6", "--resume", "--out", os.path.join(d, "b")])["history"]
    assert [h["step"] for h in resumed] == [4, 5, 6]
    assert [h["loss"] for h in resumed] == [h["loss"] for h in straight[3:]]


def test_max_grad_norm_clips_the_update():
    """The norm is reported either way, and the flag reaches the step: AdamW's first update is
    invariant to a gradient's scale except through eps (1e-8), which a gradient clipped to a
    global norm of 1e-6 falls below, so the second step's loss changes."""
    with tempfile.TemporaryDirectory() as d:
        free = train.main(COMMON + ["--steps", "2", "--out", os.path.join(d, "a")])["history"]
        clipped = train.main(COMMON + ["--steps", "2", "--max-grad-norm", "1e-6", "--out", os.path.join(d, "b")])["history"]
    assert free[0]["grad_norm"] == clipped[0]["grad_norm"] > 1e-3
    assert free[0]["loss"] == clipped[0]["loss"]
    assert clipped[1]["loss"] != free[1]["loss"]


def test_warmup_raises_the_learning_rate_linearly():
    assert [warmup_lr(s, 3e-3, 4) for s in range(6)] == [3e-3 * 0.25, 3e-3 * 0.5, 3e-3 * 0.75, 3e-3, 3e-3, 3e-3]
    assert warmup_lr(0, 3e-3, 0) == 3e-3
    with tempfile.TemporaryDirectory() as d:  # the first update is smaller: the second loss changes
        constant = train.main(COMMON + ["--steps", "2", "--out", os.path.join(d, "a")])["history"]
        warm = train.main(COMMON + ["--steps", "2", "--warmup-steps", "10", "--out", os.path.join(d, "b")])["history"]
    assert constant[0]["loss"] == warm[0]["loss"] and constant[1]["loss"] != warm[1]["loss"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train.main(argv)


def test_lora_from_a_checkpoint_under_fsdp_and_ep():
    with tempfile.TemporaryDirectory() as d:
        base = os.path.join(d, "base")
        mp.spawn(_rank_main, args=(2, _free_port(), COMMON + ["--ep", "2", "--steps", "3", "--device", "cpu",
                                                              "--out", base]), nprocs=2)
        lora = os.path.join(d, "lora")
        mp.spawn(_rank_main, args=(2, _free_port(), COMMON + ["--ep", "2", "--steps", "3", "--device", "cpu",
                                                              "--lora-rank", "4", "--task", "shifted",
                                                              "--init-from", os.path.join(base, "final"),
                                                              "--out", lora]), nprocs=2)
        assert os.path.isfile(os.path.join(lora, "log.json"))
        # a checkpoint of --ep 2 in a run of --ep 1: the layout is named, not a missing key
        with pytest.raises(SystemExit, match=r"saved with --ep 2 .*; this run has --ep 1: run it with --ep 2"):
            train.main(COMMON + ["--steps", "4", "--init-from", os.path.join(base, "final"), "--out",
                                 os.path.join(d, "one")])
        saved = train.dcp.FileSystemReader(os.path.join(lora, "final")).read_metadata().state_dict_metadata
        model_keys = [k for k in saved if k.startswith("model.")]
        # LoRA checkpoints hold the adapters and the routers' balancing biases (training state), no base weight
        assert model_keys and all("lora_" in k or k.endswith("router_bias") for k in model_keys)


def test_bad_layout_fails_before_any_work():
    with pytest.raises(SystemExit, match=r"world size \(1\) must be a multiple of ep \(2\)"):
        train.main(COMMON + ["--ep", "2", "--steps", "1", "--out", "unused"])
    with pytest.raises(SystemExit, match=r"--cp 2 must divide the 1 data-parallel ranks"):
        train.main(COMMON + ["--cp", "2", "--steps", "1", "--out", "unused"])


def test_context_parallel_trains_like_one_process(tmp_path):
    """--cp 2 on two gloo processes: they share every batch, each a half of its tokens (three
    sequences of 10: the second crosses the halves' bound); the losses are the single process's."""
    one = train.main(COMMON + ["--steps", "4", "--device", "cpu", "--seqs", "3", "--out", str(tmp_path / "one")])[
        "history"]
    mp.spawn(_rank_main, args=(2, _free_port(), COMMON + ["--cp", "2", "--steps", "4", "--device", "cpu",
                                                          "--seqs", "3", "--out", str(tmp_path / "cp")]), nprocs=2)
    with open(tmp_path / "cp" / "log.json") as f:
        two = json.load(f)["history"]
    assert len(two) == 4
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v32", "glm5_next"])
def test_lora_fine_tunes_a_real_checkpoint_under_fsdp_and_ep(family, tmp_path):
    """--init-from a checkpoint directory that transformers wrote: its shapes replace --config, each
    rank reads the shared weights and its own experts, LoRA rank 16 on 2 gloo processes (FSDP2 + EP
    2), and the loss falls on the recall task."""
    pytest.importorskip("transformers")
    import real_checkpoints

    ckpt = str(tmp_path / family)
    real_checkpoints.write(family, ckpt)
    out = str(tmp_path / "lora")
    mp.spawn(_rank_main, args=(2, _free_port(), ["--init-from", ckpt, "--ep", "2", "--lora-rank", "16", "--steps",
                                                 "60", "--seqs", "8", "--pairs", "4", "--queries", "4", "--lr", "1e-2",
                                                 "--device", "cpu", "--log-every", "1000", "--out", out]), nprocs=2)
    with open(os.path.join(out, "log.json")) as f:
        losses = [h["loss"] for h in json.load(f)["history"]]
    assert sum(losses[-5:]) / 5 < min(losses[:5]) - 0.3, losses  # 0.3 nats below each of the first steps


def test_data_file_trains_next_token_prediction(tmp_path):
    """--data: a .npy of token ids (a repeating pattern, quick to learn) and a .jsonl of texts
    encoded with the checkpoint directory's tokenizer.json give the same stream of windows."""
    np = pytest.importorskip("numpy")
    tokenizers = pytest.importorskip("tokenizers")
    pattern = np.tile(np.arange(3, 19), 64)
    np.save(tmp_path / "tokens.npy", pattern)
    history = train.main(COMMON + ["--data", str(tmp_path / "tokens.npy"), "--seq-len", "32", "--steps", "30",
                                   "--out", str(tmp_path / "run")])["history"]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    stream = train.token_stream(str(tmp_path / "tokens.npy"))
    tokens, cu, labels = train.stream_batch(stream, 2, 32, step=1, rank=0, world=1)
    assert cu.tolist() == [0, 32, 64] and torch.equal(labels[:31], tokens[1:32]) and labels[31] == -100

    vocab = {f"w{i}": i for i in range(20)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps({"text": " ".join(f"w{i}" for i in range(3, 19))})
                                                    for _ in range(4)))
    encoded = train.token_stream(str(tmp_path / "texts.jsonl"), str(tmp_path))
    assert torch.equal(encoded, stream[:64])
    with pytest.raises(SystemExit, match="needs .*tokenizer.json"):
        train.token_stream(str(tmp_path / "texts.jsonl"), str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
    (["--queries", "5", "--pairs", "2"], r"--queries \(5\) cannot exceed --pairs \(2\)"),
    (["--seqs", "0"], "--seqs must be >= 1, got 0"),
    (["--micro-batches", "0"], "--micro-batches must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--pairs", "80", "--queries", "2"], r"--pairs \(80\) exceeds the 64 keys"),
])
def test_bad_flags_are_rejected_before_any_work(flags, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        train.main(COMMON + flags + ["--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_a_non_finite_loss_stops_before_the_update(tmp_path, monkeypatch):
    """The second step's loss is made NaN: the run stops there, naming the step, before the
    optimizer step would spread NaN gradients into the weights."""
    forward, calls = train.HybridModel.forward, []

    def poisoned(self, *a, **kw):
        out = forward(self, *a, **kw)
        calls.append(1)
        if len(calls) == 2:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(train.HybridModel, "forward", poisoned)
    with pytest.raises(SystemExit, match="step 2: the loss is not finite"):
        train.main(COMMON + ["--steps", "5", "--out", str(tmp_path / "run")])


def test_the_loss_curve_is_drawn_with_a_title(tmp_path, capsys):
    """With matplotlib (tools/demo.sh and tools/test.sh install it) each run writes loss.png; the
    title says what was trained on what."""
    pytest.importorskip("matplotlib")
    train.main(COMMON + ["--steps", "2", "--lora-rank", "4", "--out", str(tmp_path / "run")])
    assert (tmp_path / "run" / "loss.png").stat().st_size > 10_000
    assert "no loss curve" not in capsys.readouterr().out


def test_a_flipped_byte_in_a_checkpoint_stops_the_resume(tmp_path):
    out = str(tmp_path / "run")
    train.main(COMMON + ["--steps", "2", "--checkpoint-every", "1", "--out", out])
    latest = os.path.join(out, "latest")
    data = max((os.path.join(latest, f) for f in os.listdir(latest) if f.endswith(".distcp")), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(SystemExit, match=f"checkpoint {latest} is damaged: {data} is missing or does not match"):
        train.main(COMMON + ["--steps", "4", "--resume", "--out", out])


def test_a_crash_between_the_renames_resumes_from_the_previous_checkpoint(tmp_path):
    """save_checkpoint moves the old checkpoint aside before putting the new one in place: a crash
    in between leaves only <latest>.previous, and --resume takes it (and reproduces the run)."""
    straight = train.main(COMMON + ["--steps", "4", "--out", str(tmp_path / "a")])["history"]
    out = str(tmp_path / "b")
    train.main(COMMON + ["--steps", "2", "--checkpoint-every", "2", "--out", out])
    os.rename(os.path.join(out, "latest"), os.path.join(out, "latest.previous"))
    os.makedirs(os.path.join(out, "latest.partial"))  # and a save that had just begun
    resumed = train.main(COMMON + ["--steps", "4", "--resume", "--out", out])["history"]
    assert [h["loss"] for h in resumed] == [h["loss"] for h in straight[2:]]


def test_killing_a_run_while_it_saves_never_costs_the_checkpoint(tmp_path):
    """A run saving every step is killed (SIGKILL) at several moments of its save cycle (each time
    after it wrote a new checkpoint, at another delay); each time --resume finds a complete
    checkpoint, and the last resume finishes."""
    import signal
    import subprocess
    import sys
    import time

    out = str(tmp_path / "run")
    latest = os.path.join(out, "latest")
    argv = [sys.executable, "-m", "kda_dsa_ops.train"] + COMMON + ["--checkpoint-every", "1", "--out", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def saved_at() -> float:
        found = train.complete_checkpoint(latest)
        return os.path.getmtime(os.path.join(found, train.MANIFEST)) if found else 0.0

    for delay in (0.0, 0.02, 0.05, 0.1):
        before = saved_at()
        run = subprocess.Popen(argv + ["--steps", "100000", "--resume"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while saved_at() == before and time.time() < deadline:  # until this run has saved once
            time.sleep(0.005)
        time.sleep(delay)
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert train.complete_checkpoint(latest) is not None
    done = subprocess.run(argv + ["--steps", "1", "--resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
