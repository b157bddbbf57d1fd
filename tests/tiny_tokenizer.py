"""A tiny byte-level BPE tokenizer written as a Hugging Face model directory has it, for tests."""

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def write_tiny_tokenizer(path: pathlib.Path, texts: list[str], eos: str) -> Tokenizer:
    """Train a 300-id BPE on `texts`; save tokenizer.json and a tokenizer_config.json naming EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos], initial_alphabet=alphabet)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok
