"""Eval-loss parity with transformers for packed documents: on CPU in float32, a window packed by
prepare's Packer with three documents, masked apart as the pipeline masks them, gives each
document the loss transformers gives it run alone; so does the final eval of a run trained with
--document_masking and exported."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import transformers  # noqa: E402
from hf_models import tiny_llama  # noqa: E402
from train_here import train_here  # noqa: E402

from jaxllmq.data.pack import Packer  # noqa: E402
from jaxllmq.data.pipeline import documents  # noqa: E402
from jaxllmq.data.shards import write_shard  # noqa: E402
from jaxllmq.model import hf  # noqa: E402
from jaxllmq.tokenizer_files import write_eos_id  # noqa: E402

EOS = 2
T = 48  # --seq_len: a window of 49 tokens, the three documents' 39 and 10 of padding


def _losses(logits_TxV: np.ndarray, targets_T: np.ndarray, mask_T: np.ndarray) -> float:
    """Mean cross-entropy over the trained targets (float64)."""
    logits = logits_TxV.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    ce = lse - np.take_along_axis(logits, targets_T[:, None], axis=-1)[:, 0]
    return float(ce[mask_T].mean())


def test_each_packed_documents_eval_loss_matches_transformers_alone(tmp_path):
    ref = tiny_llama(str(tmp_path))
    model = hf.from_pretrained(str(tmp_path), attention="xla")
    rng = np.random.default_rng(0)
    lengths, prompts = [11, 17, 11], [4, 0, 6]  # prompt tokens (not trained on) of each
    docs = [np.r_[rng.integers(EOS + 1, 311, n - 1), EOS].astype(np.int32) for n in lengths]
    masks = [np.arange(n) >= p for n, p in zip(lengths, prompts, strict=True)]
    packer = Packer(T + 1, EOS, "truncate")
    chunk = (np.concatenate(docs), np.array(lengths), np.concatenate(masks))
    ((window, _, window_mask),) = packer.pack([chunk])
    assert packer.windows == 1
    # What the pipeline makes of the window (pipeline.py: inputs, targets, loss mask, documents).
    inputs, targets = window[None, :-1], window[None, 1:]
    segment_ids, positions, trained = documents(inputs, EOS, per_window=16)
    assert segment_ids.max() == 3  # the three documents, then the padding as one
    loss_mask = (window_mask[1:] & trained[0])[None]
    packed = np.asarray(model.logits(inputs, positions, segment_ids))[0]
    plain = np.asarray(model.logits(inputs))[0]  # the window as one sequence
    for doc, mask in zip(docs, masks, strict=True):
        start = next(i for i in range(T) if np.array_equal(window[i : i + len(doc)], doc))
        span = slice(start, start + len(doc) - 1)  # the inputs whose targets are doc[1:]
        np.testing.assert_array_equal(targets[0, span], doc[1:])
        np.testing.assert_array_equal(loss_mask[0, span], mask[1:])
        with torch.no_grad():
            alone = ref(torch.as_tensor(doc[None, :-1], dtype=torch.long)).logits[0].numpy()
        theirs = _losses(alone, doc[1:], mask[1:])
        assert abs(_losses(packed[span], targets[0, span], loss_mask[0, span]) - theirs) < 1e-5
        if start:  # after another document: unmasked, it would see that one
            assert abs(_losses(plain[span], doc[1:], mask[1:]) - theirs) > 1e-3


def test_a_trained_and_exported_models_eval_loss_is_transformers_per_document(tmp_path):
    """Train a tiny model with --document_masking, export it: the final eval loss equals the mean,
    over the eval documents' in-document targets, of transformers' loss on each document alone."""
    rng = np.random.default_rng(1)
    vocab, eos = 256, 2
    make = lambda n: [np.r_[rng.integers(3, vocab, k - 1), eos] for k in rng.integers(3, 30, n)]
    # Packed windows of whole documents: eval reads each document from position 0. Whole batches
    # only (8 devices x --batch_size=1 rows), as eval drops a partial one.
    windows = {}
    for name, docs in (("train-000.bin", make(300)), ("eval.bin", make(80))):
        packer = Packer(T + 1, eos, "truncate", max_examples=15)
        chunk = (np.concatenate(docs), np.array([len(d) for d in docs]), None)
        tokens, _, mask = map(np.concatenate, zip(*packer.pack([chunk]), strict=True))
        rows = len(tokens) // (T + 1) // 8 * 8
        tokens, mask = tokens[: rows * (T + 1)], mask[: rows * (T + 1)]
        write_shard(tmp_path / name, tokens, mask, vocab_size=vocab)
        windows[name] = tokens.reshape(rows, T + 1)
    write_eos_id(str(tmp_path), eos)
    out, log = tmp_path / "model", tmp_path / "log.jsonl"
    flags = ["--model=tiny", "--from_scratch", f"--train_file={tmp_path}/train-000.bin",
             f"--eval_file={tmp_path}/eval.bin", f"--seq_len={T}", "--batch_size=1", "--steps=6",
             "--lr=1e-2", "--matmul_dtype=float32", "--document_masking", f"--out_dir={out}",
             f"--log_file={log}", "--eval_every_n_steps=0"]  # fmt: skip
    proc = train_here(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(log) as f:
        (final,) = [r for r in map(json.loads, f) if r["log"] == "eval"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    total, count = 0.0, 0
    for window in windows["eval.bin"]:
        ends = np.flatnonzero(window == eos)  # the documents; after the last, padding
        for start, end in zip(np.r_[0, ends[:-1] + 1], ends + 1, strict=True):
            doc = window[start:end]
            with torch.no_grad():
                logits = ref(torch.as_tensor(doc[None, :-1], dtype=torch.long)).logits[0].numpy()
            total += _losses(logits, doc[1:], np.ones(len(doc) - 1, bool)) * (len(doc) - 1)
            count += len(doc) - 1
    assert final["tokens"] == count
    assert abs(final["loss"] / (total / count) - 1) < 1e-4, (final["loss"], total / count)
