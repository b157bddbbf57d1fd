"""Chat conversations into token ids and loss masks, rendered with the tokenizer's chat template.

A conversation is a list of messages ({"role": "system"|"user"|"assistant"|"tool", "content":
...}). It is rendered by the chat template the tokenizer directory carries (chat_template.jinja,
else `chat_template` in tokenizer_config.json) or --chat_template, and the text is tokenized without
the tokenizer's post-processor: the template writes the BOS text itself, so the ids are those
transformers' `apply_chat_template(messages, tokenize=True)` gives.

Assistant spans are found from renders of the conversation's beginnings: an assistant message i
starts where the render of messages[:i] with the generation prompt ends, and ends where the render
of messages[:i + 1] ends, trimmed after its last end-of-turn token (the tokenizer's EOS ids and
generation_config.json's eos_token_id: <|eot_id|>, <|im_end|>, <end_of_turn>); the characters
between are mapped to the tokens that cover them. So a mask holds the assistant's content and its
end-of-turn token, never its role header nor the newline some templates write after the turn.
Where a turn renders differently as the last message than inside the whole conversation (Qwen3
writes an empty <think> block into the last assistant turn only), it ends at its first
end-of-turn token instead.

A conversation is one document. Its boundary (the id --document_masking splits at, recorded in
eos.json) is the EOS id, unless the template writes that inside conversations (Llama 3's
<|eot_id|> and Qwen's <|im_end|> end every turn): then the first end-of-turn id it never writes
there (<|end_of_text|>, <|endoftext|>), so that a conversation stays whole. If the conversation's
last token is not that id, it is appended, masked out of the loss: the model learns to stop at the
template's end-of-turn token, and the boundary only separates conversations.

Templates are data: they run in Jinja's immutable sandbox, with no loader (no file access), and a
template naming an underscore attribute (`__class__`, `__globals__`, ...) or including, importing or
extending another is refused before anything runs. They get the helpers real templates use:
raise_exception, strftime_now, a tojson that leaves non-ASCII and HTML characters as they are, the
loop controls, a `{% generation %}` block, and trim_blocks/lstrip_blocks, as transformers sets them.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from jaxllmq.setting import Settings, setting
from jaxllmq.tokenizer_files import read_json

TRAIN_ON = ("assistant", "last_assistant", "all")
# tokenizer_config.json's special tokens, passed to the template by name (e.g. {{ bos_token }}).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat template that is missing or refused; the message names it and what to do."""


class Skip(Exception):
    """A conversation that cannot be used; the message is the reason, counted per reason."""


@dataclasses.dataclass(frozen=True)
class ChatConfig(Settings):
    """Chat data: conversations rendered with a chat template."""

    messages_field: str | None = setting(
        None,
        "Records are conversations: this .jsonl field / .parquet column holds the list of "
        "messages ({role, content}), rendered with the tokenizer's chat template.",
    )
    chat_template: str | None = setting(
        None,
        "A Jinja chat template file for --messages_field (default: chat_template.jinja, else "
        "chat_template in tokenizer_config.json, beside the tokenizer); copied to --out_dir.",
    )
    train_on: str = setting(
        "assistant",
        "With --messages_field, the tokens trained on: every assistant turn (its content and "
        "end-of-turn token), the last assistant turn only, or all tokens.",
        choices=TRAIN_ON,
    )


# ---- the sandbox ----


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (templates mark assistant text
    with it for transformers' assistant masks; the spans here come from prefix renders)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so a template cannot store onto internals."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
        dict=lambda *args, **kwargs: dict(*args, **kwargs),
        namespace=_Namespace,
    )
    return env


_FILE_NODES = (jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
               jinja2.nodes.Extends)  # fmt: skip


def compile_template(source: str, where: str) -> jinja2.Template:
    """The template, refused (one line naming `where`) if it cannot parse or reaches past data."""
    env = _environment()
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template {where}: line {e.lineno}: {e.message}") from e
    for node in tree.find_all(_FILE_NODES):
        raise ChatTemplateError(
            f"chat template {where} is refused: line {node.lineno} reads another template (a "
            f"file); chat templates are data and may not include, import or extend"
        )
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.NSRef, jinja2.nodes.Getitem)):
        if isinstance(node, jinja2.nodes.Getitem):  # x['__class__']; a computed key: see render
            name = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
        else:
            name = node.attr
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(
                f"chat template {where} is refused: line {node.lineno} reaches {name!r}; chat "
                f"templates may not touch underscore attributes"
            )
    return env.from_string(source)


# ---- the tokenizer directory's files ----


def find_template(directory: str, override: str | None = None) -> tuple[str, str]:
    """(template source, where it came from): `override`, else chat_template.jinja, else
    tokenizer_config.json's chat_template (its "default" one where it lists several)."""
    if override is not None:
        if not os.path.isfile(override):
            raise ChatTemplateError(f"--chat_template: {override!r} does not exist")
        with open(override, encoding="utf-8") as f:
            return f.read(), override
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    config = os.path.join(directory, "tokenizer_config.json")
    template = read_json(config).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str):
        raise ChatTemplateError(
            f"no chat template in {directory!r} (neither chat_template.jinja nor chat_template in "
            f"tokenizer_config.json): write it to {jinja_file}, or give prepare --chat_template=FILE"
        )
    return template, config


def special_tokens(directory: str) -> dict[str, str]:
    """tokenizer_config.json's special tokens as the template sees them ({{ bos_token }})."""
    config = read_json(os.path.join(directory, "tokenizer_config.json"))
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def end_of_turn_ids(directory: str, tok: Tokenizer) -> tuple[int, ...]:
    """The ids a reply ends with: tokenizer_config.json's eos_token, generation_config.json's and
    config.json's eos_token_id (an id or a list), in that order."""
    ids = []
    eos = special_tokens(directory).get("eos_token")
    if eos is not None and tok.token_to_id(eos) is not None:
        ids.append(tok.token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        value = read_json(os.path.join(directory, name)).get("eos_token_id")
        ids += [value] if isinstance(value, int) else value if isinstance(value, list) else []
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


# ---- rendering and masks ----


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """What a tokenizing process needs to encode conversations (plain data: it is pickled)."""

    template: str
    where: str
    variables: dict[str, str]  # the special tokens
    end_ids: tuple[int, ...]
    eos_id: int | None = None  # the document boundary appended by encode(); None: prompts only
    train_on: str = "assistant"


# A conversation rendered to see which tokens a template writes inside conversations.
PROBE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye."}]  # fmt: skip


def load_spec(directory: str, tok: Tokenizer, eos_id: int | None = None,
              override: str | None = None, train_on: str = "assistant",
              eos_given: bool = False) -> ChatSpec:  # fmt: skip
    """The chat template of the tokenizer in `directory` (or `override`), checked, and the id
    that ends each conversation: `eos_id`, unless the template writes it inside conversations
    (Llama 3's <|eot_id|> and Qwen's <|im_end|> end every turn), where --document_masking would
    split a conversation into its turns; then the first of the end-of-turn ids it never writes
    there (<|end_of_text|>, <|endoftext|>). An `eos_given` (--eos_token) written there is refused."""
    source, where = find_template(directory, override)
    compile_template(source, where)
    spec = ChatSpec(source, where, special_tokens(directory), end_of_turn_ids(directory, tok),
                    eos_id, train_on)  # fmt: skip
    if eos_id is None:
        return spec
    try:
        text = ChatEncoder(spec, tok).render(PROBE, add_generation_prompt=False)
    except Skip:  # a template that refuses the probe: nothing to learn from it
        return spec
    inside = set(tok.encode(text, add_special_tokens=False).ids[:-1])
    if eos_id not in inside:
        return spec
    name = tok.id_to_token(eos_id)
    if eos_given:
        raise ChatTemplateError(
            f"--eos_token={name}: the chat template writes it inside conversations, so with "
            f"--document_masking it would split them; leave --eos_token out, or give a token "
            f"the template does not write"
        )
    for other in spec.end_ids:
        if other not in inside:
            print(f"chat: the template writes EOS {name} inside conversations; each conversation "
                  f"ends with {tok.id_to_token(other)} (id {other}) instead, its document "
                  f"boundary")  # fmt: skip
            return dataclasses.replace(spec, eos_id=other)
    print(f"warning: the chat template writes EOS {name} inside conversations and no other "
          f"end-of-turn id is known: --document_masking would split conversations there; "
          f"give --eos_token naming a token it does not write")  # fmt: skip
    return spec


class ChatEncoder:
    """Renders and tokenizes conversations per a ChatSpec. As transformers does, a message's keys
    whose value is None (OpenAI's `content: null`) are dropped, and `tools` and `documents` are
    None."""

    def __init__(self, spec: ChatSpec, tok: Tokenizer):
        self.spec, self.tok = spec, tok
        self.template = compile_template(spec.template, spec.where)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text; Skip with the template's reason if it refuses the messages."""
        try:
            return self.template.render(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **self.spec.variables,
            )  # fmt: skip
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template {self.spec.where} is refused: {e}") from e
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
            raise Skip(f"the chat template refuses it: {e}") from e

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt (what a reply continues)."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, messages: list[dict]) -> tuple[list[int], np.ndarray]:
        """(token ids, loss mask) of one conversation, EOS-terminated; Skip if unusable."""
        _check_messages(messages)
        text = self.render(messages, add_generation_prompt=False)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        if self.spec.train_on == "all":
            mask = np.ones(len(ids), dtype=bool)
        else:
            mask = self._assistant_mask(messages, text, ids, enc.offsets)
        if not ids or ids[-1] != self.spec.eos_id:
            ids.append(self.spec.eos_id)
            mask = np.append(mask, False)
        return ids, mask

    def _assistant_mask(self, messages, text, ids, offsets) -> np.ndarray:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise Skip("no assistant message")
        if self.spec.train_on == "last_assistant":
            turns = turns[-1:]
        starts, ends = np.array(offsets, dtype=np.int64).reshape(-1, 2).T
        is_end = np.isin(np.asarray(ids), self.spec.end_ids)
        mask = np.zeros(len(ids), dtype=bool)
        for i in turns:
            begin = self.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(begin):
                raise Skip(
                    "the chat template renders the conversation's first turns differently from "
                    "the whole, so its assistant turns cannot be located"
                )
            turn = self.render(messages[: i + 1], add_generation_prompt=False)
            span = np.flatnonzero(ends > len(begin))
            if text.startswith(turn):  # the turn ends where its render does, at its last end id
                span = span[starts[span] < len(turn)]
                last = span[is_end[span]]
                span = span[span <= last[-1]] if len(last) else span
            else:  # it renders otherwise when last (Qwen3's empty <think>): to its first end id
                first = span[is_end[span]]
                if not len(first):
                    raise Skip(
                        "the chat template renders an assistant turn differently when it is the "
                        "last one, and no end-of-turn id (eos_token_id) marks where it ends"
                    )
                span = span[span <= first[0]]
            mask[span] = True
        return mask

    def encode_chunk(self, conversations: list[list[dict]]) -> tuple:
        """encode() of each conversation: (tokens, lengths, mask, {reason: skipped count})."""
        parts, masks, skipped = [], [], collections.Counter()
        for messages in conversations:
            try:
                ids, mask = self.encode(messages)
            except Skip as e:
                skipped[str(e)] += 1
                continue
            parts.append(np.asarray(ids, dtype=np.int32))
            masks.append(mask)
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        if not parts:
            return np.zeros(0, np.int32), lengths, np.zeros(0, bool), dict(skipped)
        return np.concatenate(parts), lengths, np.concatenate(masks), dict(skipped)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise Skip("the messages are not a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Skip("a message is not an object with a string 'role'")


def characters(messages) -> int:
    """Roughly how much text a conversation holds (for sizing work chunks)."""
    if not isinstance(messages, list):
        return 1
    return sum(len(str(m.get("content", ""))) if isinstance(m, dict) else 1 for m in messages)


def report_skipped(skipped: collections.Counter) -> None:
    """One line per reason conversations were skipped, with its count."""
    for reason, count in sorted(skipped.items(), key=lambda kv: -kv[1]):
        print(f"skipped {count:,} conversation(s): {reason}")
