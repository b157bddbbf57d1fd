"""Tokenize text into BIN.TOK shards: `python -m jaxllmq.data.prepare --helpfull`.

    python -m jaxllmq.data.prepare --input='corpus/*.jsonl' --tokenizer=path/to/model \\
        --out_dir=data/mine
    python -m jaxllmq.data.prepare --quickstart --out_dir=data/quickstart

Writes train-NNN.bin shards and eval.bin into --out_dir, plus a copy of the tokenizer files (the
trainer copies them into exported models) and eos.json, the EOS id (--document_masking reads it);
with --pack, pack.json (jaxllmq/data/pack.py). Each document is tokenized and EOS is appended. A
{"prompt": ..., "response": ...} record becomes prompt + response + EOS, masked so that only the
response and its EOS are trained on; a conversation (--messages_field) is rendered with the chat
template and only its assistant turns are trained on (jaxllmq/data/chat.py). Worker processes
tokenize chunks of documents and the results are written in input order (jaxllmq/data/split.py),
so the output depends only on the inputs and the flags.

--quickstart needs no data and no network: its corpus is this Python's own standard library
sources, and it trains a byte-level BPE tokenizer on them in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import multiprocessing
import os
import pathlib
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxllmq.data import chat
from jaxllmq.data.pack import (
    PackConfig,
    Packer,
    max_examples_per_window,
    whole_windows,
    write_pack_record,
)
from jaxllmq.data.shards import expand_files
from jaxllmq.data.split import PrepareError, Progress, Split
from jaxllmq.setting import SettingError, Settings, section, setting
from jaxllmq.tokenizer_files import copy_tokenizer_files, read_json, write_eos_id

SUFFIXES = (".txt", ".jsonl", ".parquet")
QUICKSTART_EOS = "<|endoftext|>"
CHUNK_CHARS = 1 << 20  # text per worker task: big enough to amortize the hand-off

Document = str | tuple[str, str] | list  # text, (prompt, response), or a conversation


@dataclasses.dataclass(frozen=True)
class PrepareConfig(Settings):
    """Data preparation: the text, its tokenizer, and the shards written."""

    input: tuple[str, ...] = setting(
        (),
        "Input files: paths or globs, comma-separated or the flag repeated; .txt, .jsonl, "
        ".parquet (globs sorted, order kept)",
        repeated=True,
    )
    tokenizer: str | None = setting(
        None, "A Hugging Face tokenizer.json, or a model directory holding one."
    )
    out_dir: str = setting(None, "Where train-NNN.bin, eval.bin and tokenizer files go.")
    text_field: str = setting("text", ".jsonl field / .parquet column holding the text.")
    prompt_field: str = setting(
        "prompt",
        "Records with this and --response_field are prompt/response pairs: only the response "
        "(and its EOS) is trained on.",
    )
    response_field: str = setting("response", "See --prompt_field.")
    chat: chat.ChatConfig = section(chat.ChatConfig)
    txt_documents: str = setting(
        "file",
        "One .txt document is: the whole file, each blank-line-separated paragraph, or each "
        "non-empty line.",
        choices=("file", "paragraph", "line"),
    )
    eos_token: str | None = setting(
        None,
        "Token appended to every document; default: eos_token in tokenizer_config.json, else "
        "eos_token_id in config.json, beside the tokenizer.",
    )
    add_special_tokens: bool = setting(
        True, "Apply the tokenizer's post-processor to each document (e.g. Llama 3's BOS)."
    )
    shard_tokens: int | None = setting(
        None, "Tokens per train shard (default 100M; 4M quickstart).", lower=1
    )
    eval_fraction: float = setting(
        0.01,
        "Share of tokens held out in eval.bin, as whole documents spread over the corpus (0: no "
        "eval.bin).",
        lower=0.0,
    )
    eval_tokens: int = setting(
        0,
        "If > 0, eval.bin takes the first documents until it has this many tokens instead "
        "(overrides --eval_fraction).",
        lower=0,
    )
    workers: int = setting(os.cpu_count() or 1, "Tokenizer processes.", lower=1)
    overwrite: bool = setting(False, "Replace train-*.bin, eval.bin in --out_dir.")
    quickstart: bool = setting(
        False,
        "No --input/--tokenizer: tokenize this Python's standard library with a BPE tokenizer "
        "trained on it (replaces an earlier quickstart).",
    )
    quickstart_mb: float = setting(32.0, "Quickstart corpus cap, MB of text.")
    vocab_size: int = setting(4096, "Quickstart tokenizer vocab, EOS included.", lower=1)
    packing: PackConfig = section(PackConfig)

    @property
    def tokens_per_shard(self) -> int:
        """--shard_tokens, else 4M for the quickstart's small corpus and 100M otherwise."""
        if self.shard_tokens is not None:
            return self.shard_tokens
        return 4_000_000 if self.quickstart else 100_000_000

    def check(self) -> None:
        if self.out_dir is None:
            raise SettingError("--out_dir is required: where the shards go")
        if self.quickstart and (self.input or self.tokenizer or self.chat.messages_field):
            raise SettingError("--quickstart makes its own corpus and tokenizer: drop --input, "
                               "--tokenizer and --messages_field")  # fmt: skip
        if not self.quickstart and not (self.input and self.tokenizer):
            raise SettingError("give --input and --tokenizer, or --quickstart")
        if self.eval_fraction >= 1:
            raise SettingError(f"--eval_fraction={self.eval_fraction}: must be < 1")


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by --input (paths or globs, comma-separated or repeated), in order."""
    paths = expand_files(patterns, "--input")
    for path in paths:
        if not path.endswith(SUFFIXES):
            raise PrepareError(f"--input: {path!r} is not one of {', '.join(SUFFIXES)}")
    return paths


def _document(record: dict, where: str, fields: tuple) -> Document | None:
    text, prompt, response, messages = fields
    if messages is not None:  # a conversation: chat.py checks its messages
        if messages not in record:
            raise PrepareError(f"{where}: record has no {messages!r} field (it has "
                               f"{sorted(record)[:8]}); set --messages_field")  # fmt: skip
        return record[messages] or []  # checked and counted (skipped) as it is encoded
    if prompt in record and response in record:
        doc = (record[prompt], record[response])
    elif text in record:
        doc = record[text]
    else:
        raise PrepareError(
            f"{where}: record has neither a {text!r} field nor {prompt!r} + {response!r} "
            f"(it has {sorted(record)[:8]}); set --text_field or --prompt_field/--response_field"
        )
    if not all(isinstance(s, str) for s in (doc if isinstance(doc, tuple) else [doc])):
        raise PrepareError(f"{where}: text fields must be strings")
    return doc if doc else None  # an empty text is skipped: it would be a lone EOS


def read_documents(paths: list[str], fields: tuple, txt: str) -> Iterator[Document]:
    """Documents of .txt (per --txt_documents), .jsonl and .parquet files, in order."""
    for path in paths:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            parts = {"file": [text], "paragraph": text.split("\n\n"), "line": text.splitlines()}
            yield from (part for part in parts[txt] if part.strip())
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise PrepareError(f"{path}:{number}: not JSON ({e})") from e
                        if (doc := _document(record, f"{path}:{number}", fields)) is not None:
                            yield doc
        else:
            yield from _parquet_documents(path, fields)


def _parquet_documents(path: str, fields: tuple) -> Iterator[Document]:
    import pyarrow.parquet as pq  # only parquet inputs need pyarrow

    file = pq.ParquetFile(path)
    names = set(file.schema_arrow.names)
    text, prompt, response, messages = fields
    columns = [prompt, response] if {prompt, response} <= names else [messages or text]
    if not set(columns) <= names:
        flag = "--messages_field" if messages else "--text_field"
        raise PrepareError(f"{path}: no column {columns[0]!r} (it has {sorted(names)}); set {flag}")
    row = 0
    for batch in file.iter_batches(columns=columns):
        for record in batch.to_pylist():
            if (doc := _document(record, f"{path} row {row}", fields)) is not None:
                yield doc
            row += 1


def find_tokenizer(path: str) -> tuple[str, str]:
    """(tokenizer.json, the directory with its config files) for a file or model directory."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise PrepareError(
                f"--tokenizer: no tokenizer.json in {os.path.dirname(path)!r}; only Hugging Face "
                f"fast tokenizers (tokenizer.json) are supported"
            )
    elif not os.path.isfile(path):
        raise PrepareError(f"--tokenizer: {path!r} does not exist")
    return path, os.path.dirname(os.path.abspath(path))


def resolve_eos(tokenizer: Tokenizer, config_dir: str, eos_token: str | None) -> int:
    """EOS id from --eos_token, else tokenizer_config.json's eos_token, else config.json's."""
    source = "--eos_token"
    if eos_token is None:
        eos_token = read_json(os.path.join(config_dir, "tokenizer_config.json")).get("eos_token")
        if isinstance(eos_token, dict):  # older configs: {"content": "</s>", ...}
            eos_token = eos_token.get("content")
        source = f"eos_token in {config_dir}/tokenizer_config.json"
    if eos_token is None:
        eos_id = read_json(os.path.join(config_dir, "config.json")).get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        if not isinstance(eos_id, int):
            raise PrepareError(
                f"no EOS token known for the tokenizer in {config_dir!r}: neither "
                f"tokenizer_config.json (eos_token) nor config.json (eos_token_id) names one; "
                f"pass --eos_token"
            )
        return eos_id
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise PrepareError(f"EOS token {eos_token!r} ({source}) is not in the tokenizer's vocab")
    return eos_id


_worker: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int, add_special_tokens: bool, pool: bool,
                 chat_spec: chat.ChatSpec | None) -> None:  # fmt: skip
    if pool:  # one process per core: the tokenizer's own threads would only oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_str(tokenizer_json)
    encoder = chat.ChatEncoder(chat_spec, tok) if chat_spec else None
    _worker.update(tok=tok, eos=eos_id, special=add_special_tokens, chat=encoder)


def _encode_chunk(docs: list[Document]) -> tuple:
    """Tokens of all docs (EOS appended), each doc's length, a mask if any doc is a pair or a
    conversation, and the conversations skipped, by reason."""
    if _worker["chat"] is not None:
        return _worker["chat"].encode_chunk(docs)
    tok, eos, special = _worker["tok"], _worker["eos"], _worker["special"]
    pairs = [d for d in docs if isinstance(d, tuple)]
    texts = tok.encode_batch([d for d in docs if isinstance(d, str)], add_special_tokens=special)
    prompts = tok.encode_batch([p for p, _ in pairs], add_special_tokens=special)
    replies = tok.encode_batch([r for _, r in pairs], add_special_tokens=False)
    texts, prompts, replies = iter(texts), iter(prompts), iter(replies)
    parts, masks = [], []
    for doc in docs:
        if isinstance(doc, str):
            ids, trained = next(texts).ids, 0
        else:
            prompt = next(prompts).ids
            ids, trained = prompt + next(replies).ids, len(prompt)
        if not ids or ids[-1] != eos:  # a post-processor may have appended EOS already
            ids = ids + [eos]
        parts.append(np.asarray(ids, dtype=np.int32))
        masks.append(np.arange(len(ids)) >= trained)
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    return np.concatenate(parts), lengths, np.concatenate(masks) if pairs else None, {}


def _chunks(docs: Iterable[Document]) -> Iterator[list[Document]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += (len(doc) if isinstance(doc, str) else len(doc[0]) + len(doc[1])
                  if isinstance(doc, tuple) else chat.characters(doc))  # fmt: skip
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def encode_in_order(docs: Iterable[Document], tokenizer_json: str, eos_id: int,
                    add_special_tokens: bool, workers: int,
                    chat_spec: chat.ChatSpec | None = None) -> Iterator[tuple]:  # fmt: skip
    """Tokenize chunks of documents on `workers` processes; yields results in input order."""
    init = (tokenizer_json, eos_id, add_special_tokens, workers > 1, chat_spec)
    if workers == 1:  # in this process (the tokenizer still uses its threads)
        _init_worker(*init)
        yield from map(_encode_chunk, _chunks(docs))
        return
    # spawn: the parent may hold tokenizer threads (quickstart training), which fork would copy.
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, init) as pool:
        pending: collections.deque = collections.deque()
        for chunk in _chunks(docs):  # a bounded queue, unlike Pool.imap: memory stays flat
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def stdlib_sources(max_chars: int) -> list[str]:
    """This Python's standard library .py sources, sorted by path, up to `max_chars` of text."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > max_chars:
            break
        texts.append(text)
        total += len(text)
    return texts


def train_quickstart_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> Tokenizer:
    """Train a byte-level BPE tokenizer (EOS <|endoftext|> = id 0) and save it in out_dir."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[QUICKSTART_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": QUICKSTART_EOS,
              "clean_up_tokenization_spaces": False}  # fmt: skip
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tokenizer


def _prepare_out_dir(out_dir: str, overwrite: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    old = sorted(glob.glob(os.path.join(out_dir, "train-*.bin")))
    old += glob.glob(os.path.join(out_dir, "eval.bin"))
    if old and not overwrite:
        raise PrepareError(
            f"--out_dir {out_dir!r} already holds {len(old)} shard(s) ({old[0]}, ...): pass "
            f"--overwrite to replace them, or choose another --out_dir"
        )
    for path in old:
        os.remove(path)


def run(args: PrepareConfig) -> dict:
    """Tokenize per `args` into args.out_dir; returns the summary it prints."""
    start = time.perf_counter()
    if args.quickstart:
        _prepare_out_dir(args.out_dir, overwrite=True)
        texts = stdlib_sources(int(args.quickstart_mb * 1e6))
        print(f"quickstart: {len(texts)} standard library files, "
              f"{sum(map(len, texts)) / 1e6:.1f}M characters; training the tokenizer")  # fmt: skip
        tokenizer = train_quickstart_tokenizer(texts, args.vocab_size, args.out_dir)
        eos_id = resolve_eos(tokenizer, args.out_dir, args.eos_token)
        docs: Iterable[Document] = texts
        chat_spec = None
    else:  # check inputs, tokenizer and EOS before touching --out_dir
        paths = expand_inputs(args.input)
        tokenizer_json, config_dir = find_tokenizer(args.tokenizer)
        tokenizer = Tokenizer.from_file(tokenizer_json)
        eos_id = resolve_eos(tokenizer, config_dir, args.eos_token)
        c = args.chat
        chat_spec = (chat.load_spec(config_dir, tokenizer, eos_id, c.chat_template, c.train_on,
                                    eos_given=args.eos_token is not None)
                     if c.messages_field else None)  # fmt: skip
        eos_id = chat_spec.eos_id if chat_spec else eos_id  # a conversation's end, not a turn's
        _prepare_out_dir(args.out_dir, args.overwrite)
        copy_tokenizer_files(config_dir, args.out_dir, tokenizer_json)
        if chat_spec is not None and c.chat_template is not None:  # the template travels along
            pathlib.Path(args.out_dir, "chat_template.jinja").write_text(chat_spec.template)
        fields = (args.text_field, args.prompt_field, args.response_field, c.messages_field)
        docs = read_documents(paths, fields, args.txt_documents)
    write_eos_id(args.out_dir, eos_id)
    write_pack_record(args.out_dir, args.packing.seq_len)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    progress = Progress()  # its clock times tokenizing alone: the throughput figure
    skipped: collections.Counter = collections.Counter()

    def encoded():
        for tokens, lengths, mask, skips in encode_in_order(
            docs, tokenizer.to_str(), eos_id, args.add_special_tokens, args.workers, chat_spec
        ):
            skipped.update(skips)
            if len(lengths):
                yield tokens, lengths, mask

    chunks, shard_tokens, pack = encoded(), args.tokens_per_shard, args.packing
    if pack.pack:  # whole windows of whole examples go to the train shards and eval.bin
        packer = Packer(pack.seq_len + 1, eos_id, pack.pack_overlong, max_examples_per_window(pack))
        chunks, shard_tokens = packer.pack(chunks), whole_windows(shard_tokens, packer.window)
    with Split(args.out_dir, vocab_size, shard_tokens, args.eval_fraction,
               args.eval_tokens) as split:  # fmt: skip
        for tokens, lengths, mask in chunks:
            split.add(tokens, lengths, mask)
            progress.update(split.documents, split.tokens)
        chat.report_skipped(skipped)  # before Split's check that anything was written
    rate = progress.update(split.documents, split.tokens, final=True)
    train_tokens = split.tokens - split.eval_written
    docs_, masked = ("windows", "prompt and pad") if pack.pack else ("documents", "prompt")
    print(
        f"wrote {split.shards_written} train shard(s) ({train_tokens:,} tokens, "
        f"{split.documents - split.eval_documents:,} {docs_}) and "
        + (f"eval.bin ({split.eval_written:,} tokens, {split.eval_documents:,} {docs_})"
           if split.eval_written else "no eval.bin")
        + f" to {args.out_dir}; vocab {vocab_size}, EOS id {eos_id}, {split.masked_out:,} {masked} "
        f"tokens masked out; {time.perf_counter() - start:.1f} s, tokenizing {rate:,.0f} tokens/s"
    )  # fmt: skip
    if pack.pack:
        print(packer.summary())
    return {"train_tokens": train_tokens, "eval_tokens": split.eval_written,
            "shards": split.shards_written, "vocab_size": vocab_size, "eos_id": eos_id,
            "tokens_per_s": rate, **({"pack": packer.stats()} if pack.pack else {})}  # fmt: skip


if __name__ == "__main__":
    from jaxllmq.cli.prepare import main

    main()
