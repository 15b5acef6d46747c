"""Trainer pieces: loss components on tiny tensors with known values, anchors and blocks, one real step
on stories260K lowers the loss, and a resumed run equals an uninterrupted one."""
import math
from pathlib import Path

import pytest
import torch

from specd.drafter.base import build_drafter
from specd.drafter.config import DrafterConfig
from specd.drafter.data import TrainSequence
from specd.drafter.losses import (confidence_label, dflash_loss, dspark_loss, eagle3_loss, l1_distance,
                                  position_weights, step_weights)
from specd.drafter.train import TrainConfig, Trainer, lr_factor, make_blocks, method_anchors, sample_anchors

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_position_and_step_weights():
    assert torch.allclose(position_weights(3), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    assert torch.allclose(step_weights(3), torch.tensor([1.0, 0.8, 0.64]))


def test_l1_and_confidence_label_known_values():
    p_d = torch.tensor([[[0.5, 0.5, 0.0]]])
    p_t = torch.tensor([[[0.0, 0.5, 0.5]]])
    assert l1_distance(p_d, p_t).item() == pytest.approx(1.0)
    assert confidence_label(p_d, p_t).item() == pytest.approx(0.5)       # Σ min(p_d, p_t)
    assert confidence_label(p_t, p_t).item() == pytest.approx(1.0)


def test_dspark_loss_components_known_values():
    v = 4
    logits = torch.zeros(1, 2, v)                    # p_d uniform
    target = torch.zeros(1, 2, v)
    target[0, 1, 0] = 100.0                          # slot 2: p_t one-hot on token 0; slot 1: uniform
    labels = torch.tensor([[1, 0]])
    valid = torch.tensor([[True, True]])
    conf = torch.zeros(1, 2)                         # sigmoid 0.5
    parts = dspark_loss(logits, target, labels, valid, conf)
    w = position_weights(2)
    assert parts.ce == pytest.approx(math.log(v))                       # uniform CE at both slots
    l1_slot2 = 0.75 + 3 * 0.25                                           # |0.25-1| + 3·|0.25-0|
    assert parts.l1 == pytest.approx(w[1].item() * l1_slot2 / w.sum().item(), rel=1e-5)
    # BCE(0.5 prob, label) = log 2 whatever the label
    assert parts.bce == pytest.approx(math.log(2), rel=1e-5)
    assert parts.total.item() == pytest.approx(0.1 * parts.ce + 0.9 * parts.l1 + 1.0 * parts.bce, rel=1e-5)


def test_invalid_slots_are_ignored_and_dflash_eagle_are_ce_only():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.tensor([[1, 2, 3], [4, 0, 9999]])           # garbage label where invalid
    valid = torch.tensor([[True, True, True], [True, True, False]])
    d = dflash_loss(logits, labels, valid)
    e = eagle3_loss(logits, labels, valid)
    assert d.total.item() == pytest.approx(d.ce) and d.l1 == 0.0 and d.bce == 0.0
    assert e.total.item() == pytest.approx(e.ce)
    d.total.backward()
    assert logits.grad[1, 2].abs().sum() == 0                 # the masked slot gets no gradient
    assert logits.grad[1, 1].abs().sum() > 0


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 100, 0.04) == pytest.approx(0.25)
    assert lr_factor(3, 100, 0.04) == pytest.approx(1.0)
    assert lr_factor(52, 100, 0.04) == pytest.approx(0.5)
    assert lr_factor(99, 100, 0.04) < 0.01


def test_anchors_and_blocks():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=4, length=10, n=100, gen=gen)
    assert a.tolist() == list(range(3, 9))                   # slot 0 always predicts an answer token
    seq = TrainSequence(list(range(20, 30)), prompt_len=4)
    e = method_anchors("eagle3", seq, gamma=3, n=100, gen=gen)
    assert int(e.min()) >= 1 and int(e.max()) <= 10 - 3
    tokens = torch.arange(20, 30)
    logits = torch.arange(10).float()[:, None].expand(10, 4)
    b = make_blocks(tokens, logits, torch.tensor([3, 8]), gamma=3)
    assert b.labels[0].tolist() == [24, 25, 26]
    assert b.prev[0].tolist() == [23, 24, 25]                # the anchor, then teacher-forced tokens
    assert b.valid[1].tolist() == [True, False, False]        # anchor 8: only token 9 exists
    assert b.target_logits[0, :, 0].tolist() == [3, 4, 5]    # the target's logits at a+k predict a+1+k


@pytest.fixture(scope="module")
def stories():
    from specd.loader import load_model
    target, _ = load_model(STORIES, "float32", "cpu")
    target.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(torch.randint(3, 512, (24,), generator=g).tolist(), prompt_len=6) for _ in range(6)]
    return target, seqs


def _trainer(target, seqs, out, steps):
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, "dspark", gamma=4, markov_rank=16)
    drafter = build_drafter(cfg, target)
    tc = TrainConfig(steps=steps, batch_size=2, anchors=4, log_every=1, ckpt_every=2, lr=3e-3)
    return Trainer(target, drafter, seqs, tc, out)


def test_training_lowers_the_loss(stories, tmp_path):
    target, seqs = stories
    curves = _trainer(target, seqs, tmp_path, 10).train(progress=False)
    assert len(curves.step) == 10 and curves.bce[0] > 0 and curves.l1[0] > 0
    assert sum(curves.total[-3:]) < sum(curves.total[:3])


def test_features_from_a_bf16_copy_train_an_fp32_drafter(stories, tmp_path):
    """The CUDA default (--features-dtype auto): the target pass runs in a bf16 copy, the drafter and
    the LM heads stay fp32. Its first step's loss is the fp32 step's up to bf16 rounding of the
    features, and a planted cast error (features left in bf16) is refused by the drafter's fp32 matmul."""
    from specd.drafter.data import served_copy
    from specd.drafter.train import in_dtype, target_states

    target, seqs = stories
    ref = _trainer(target, seqs, tmp_path / "fp32", 1).train_step()
    half = served_copy(target, "bfloat16")
    assert half is not target and half.embed_tokens.weight.dtype == torch.bfloat16
    assert target.embed_tokens.weight.dtype == torch.float32              # the target is untouched
    tr = _trainer(target, seqs, tmp_path / "bf16", 1)
    tr.features = half
    got = tr.train_step()
    assert torch.isfinite(got.total) and abs(got.total.item() - ref.total.item()) < 0.05 * ref.total.item()
    assert got.total.item() != ref.total.item()                           # the features did change
    hidden, feats = target_states(half, [seqs[0].tokens], tr.drafter.config.target_layers)
    assert hidden[0].dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        tr.drafter.fuse(feats[0])
    cast_h, cast_f = in_dtype(hidden, feats, torch.float32)
    assert cast_h[0].dtype == torch.float32 and tr.drafter.fuse(cast_f[0]).dtype == torch.float32


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_baseline_methods_train(stories, tmp_path, method):
    target, seqs = stories
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, method, gamma=3)
    tr = Trainer(target, build_drafter(cfg, target), seqs, TrainConfig(steps=2, batch_size=2, anchors=3), tmp_path)
    curves = tr.train(progress=False)
    assert curves.step == [2] and curves.ce[0] > 0 and curves.l1 == [0.0]


def test_resume_continues_from_checkpoint(stories, tmp_path):
    target, seqs = stories
    full = _trainer(target, seqs, tmp_path / "full", 4)
    full.out_dir.mkdir()
    full.train(progress=False)
    part = _trainer(target, seqs, tmp_path / "part", 4)
    part.out_dir.mkdir()
    part.cfg = TrainConfig(**{**part.cfg.__dict__, "steps": 4})
    # run 2 steps, "crash", then resume in a fresh trainer
    for _ in range(2):
        part.step += 1
        part._record(part.train_step())
    part.save_checkpoint()
    resumed = _trainer(target, seqs, tmp_path / "part", 4)
    assert resumed.load_checkpoint() == 2
    resumed.train(progress=False)
    assert resumed.curves.step == full.curves.step
    assert resumed.curves.total == pytest.approx(full.curves.total, rel=1e-5)
    for (k, a), b in zip(full.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def _session(sid: str, split: str) -> str:
    import json
    turns = [{"messages": [{"role": "user", "content": "Tell me a story about a cat."}], "max_tokens": 6},
             {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 5}]
    return json.dumps({"format_version": 1, "id": sid, "workload": "creative", "split": split, "arrival_s": 0.0,
                       "turns": turns, "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 0}})


def test_session_data_is_regenerated_turn_by_turn(stories, tmp_path):
    from specd.drafter.data import session_sequences
    from specd.loader import load_model

    _, tok = load_model(STORIES, "float32", "cpu")
    target = stories[0]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join([_session("a", "train"), _session("b", "eval"), _session("c", "train")]) + "\n")
    seqs = session_sequences(target, tok, path, "train", seed=0, max_len=256)
    again = session_sequences(target, tok, path, "train", seed=0, max_len=256)
    assert [s.tokens for s in seqs] == [s.tokens for s in again]            # seeded: reproducible
    assert len(seqs) == 4                                                   # 2 train sessions x 2 turns
    first, second = seqs[0], seqs[2]                                        # session a, turns 1 and 2
    assert len(first.tokens) - first.prompt_len <= 6 and len(second.tokens) - second.prompt_len <= 5
    # turn 2's prompt holds turn 1's prompt text and the target's answer to it
    answer = tok.decode(tok.encode(tok.decode(first.tokens[first.prompt_len:])))
    assert answer in tok.decode(second.tokens[:second.prompt_len])


def test_cli_writes_drafter_and_training_json_then_resumes(tmp_path):
    import json

    from specd.drafter.cli import main
    from specd.drafter.data import file_sha256

    out = tmp_path / "d"
    argv = ["--target", str(STORIES), "--self-prompts", "6", "--method", "dspark", "--out", str(out), "--steps", "3",
            "--layers", "1", "--markov-rank", "8", "--max-new-tokens", "20", "--batch-size", "2", "--anchors", "4",
            "--log-every", "1", "--ckpt-every", "2", "--holdout", "0.34"]
    assert main(argv) == 0
    report = json.loads((out / "training.json").read_text())
    assert report["steps_done"] == 3 and report["loss_curves"]["step"] == [1, 2, 3]
    assert report["weights_sha256"] == file_sha256(out / "drafter.safetensors")
    assert report["data"]["answers_sha256"] == file_sha256(out / "data.jsonl")
    cal = json.loads((out / "calibration.json").read_text())
    assert len(cal["temperatures"]) == 7 and report["sts"]["ece_after"] <= report["sts"]["ece_before"] + 1e-12
    # --resume of a finished run reloads the checkpoint (step 3) and the saved answers: nothing retrains
    assert main(argv + ["--resume"]) == 0
    again = json.loads((out / "training.json").read_text())
    assert again["loss_curves"] == report["loss_curves"]
    assert again["data"]["answers_sha256"] == report["data"]["answers_sha256"]


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3"])
def test_batched_block_loss_matches_the_per_sequence_reference(stories, method):
    """One drafter forward for the batch gives the reference's loss parts and gradients: ragged
    lengths, different anchor counts, an anchor at the last position (EAGLE-3: the last its unroll
    fits, and the first) and a sequence with none."""
    from specd.drafter.train import block_loss, block_loss_reference, target_states

    target, _ = stories
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 512, (n,), generator=g) for n in (30, 9, 17, 12)]
    if method == "eagle3":                  # 1 <= a <= T - γ (``method_anchors``)
        anchors = [torch.tensor([3, 10, 26]), torch.tensor([5]), torch.tensor([1, 5, 6, 13]),
                   torch.empty(0, dtype=torch.int64)]
    else:
        anchors = [torch.tensor([3, 10, 28]), torch.tensor([8]), torch.tensor([0, 5, 6, 15]),
                   torch.empty(0, dtype=torch.int64)]
    torch.manual_seed(0)
    overrides = {"markov_rank": 16} if method == "dspark" else {}
    drafter = build_drafter(DrafterConfig.for_target(target.config, method, gamma=4, **overrides), target)
    hidden, feats = target_states(target, [s.tolist() for s in seqs], drafter.config.target_layers)
    results = []
    for fn in (block_loss_reference, block_loss):
        drafter.zero_grad(set_to_none=True)
        loss = fn(drafter, method, feats, seqs, hidden, anchors, target.logits)
        loss.total.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results.append((loss, grads))
    (want, want_g), (got, got_g) = results
    for part in ("total", "ce", "l1", "bce"):
        torch.testing.assert_close(getattr(got, part), getattr(want, part), atol=1e-5, rtol=1e-5)
    assert want_g.keys() == got_g.keys() and want_g
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-5, rtol=1e-4, msg=name)


def test_batched_blocks_refuse_bad_anchors(stories):
    target, _ = stories
    drafter = build_drafter(DrafterConfig.for_target(target.config, "dspark", gamma=4, markov_rank=16), target)
    ctx = torch.zeros(5, target.config.hidden_size)
    toks = torch.arange(5)
    for bad in (torch.tensor([5]), torch.tensor([-1]), torch.empty(0, dtype=torch.int64)):
        with pytest.raises(Exception, match="anchors"):
            drafter.block_logits_batch([ctx], [toks], [bad])
