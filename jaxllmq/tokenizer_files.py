"""The Hugging Face tokenizer files that travel with a model or a tokenized data set."""

import json
import os
import shutil

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def copy_tokenizer_files(src_dir: str, dst_dir: str, tokenizer_json: str | None = None) -> None:
    """Copy the tokenizer files present in `src_dir` into `dst_dir`; tokenizer.json is read from
    `tokenizer_json` where given (a file that may stand elsewhere or have another name)."""
    sources = {name: os.path.join(src_dir, name) for name in TOKENIZER_FILES}
    if tokenizer_json is not None:
        sources["tokenizer.json"] = tokenizer_json
    for name, source in sources.items():
        target = os.path.join(dst_dir, name)
        if os.path.isfile(source) and not (
            os.path.exists(target) and os.path.samefile(source, target)
        ):
            shutil.copyfile(source, target)


def read_json(path: str) -> dict:
    """A JSON config file's object; {} if the file is absent."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# Beside the tokenizer files in a prepared data directory: {"eos_id": N}, the end-of-document id
# every document of its shards ends with.
EOS_FILE = "eos.json"


def write_eos_id(data_dir: str, eos_id: int) -> None:
    """Record the end-of-document id of the shards in `data_dir`."""
    with open(os.path.join(data_dir, EOS_FILE), "w") as f:
        json.dump({"eos_id": eos_id}, f)


def read_eos_id(data_dir: str) -> int | None:
    """The end-of-document id prepare recorded in `data_dir`, or None if it recorded none."""
    path = os.path.join(data_dir, EOS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(json.load(f)["eos_id"])
