"""Chat data: conversations rendered with Llama 3-, Qwen2.5-, Qwen3- and Gemma-style chat templates
give transformers' apply_chat_template ids, and masks that hold the assistant turns alone; prepare
--messages_field writes them; hostile templates are refused; a chat fine-tune learns its replies
and generate --chat stops at the end of a turn."""

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from test_data_prepare import prepare_here
from tiny_tokenizer import write_tiny_tokenizer
from tokenizers import Tokenizer, processors
from train_here import train_here

from jaxllmq import generate as gen
from jaxllmq.data import chat
from jaxllmq.data.shards import open_shard, write_shard
from jaxllmq.setting import SettingError
from jaxllmq.settings import DataConfig, ModelSpec, TrainConfig

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

# Each family's format, written for these tests: the header before an assistant turn's text and
# the end-of-turn text after it (the spans the masks must hold, found independently here).
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{%- if system %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nYear: ' + strftime_now('%Y') + '\\n\\n' }}
    {{- system + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
    {%- if message['tool_calls'] is defined %}
        {%- for call in message['tool_calls'] %}
            {{- {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}
        {%- endfor %}
    {%- else %}
        {{- message['content'] | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# As Qwen2.5 without the default system prompt, plus Qwen3's thinking: an assistant turn after the
# last user message writes its reasoning (an empty <think> block if none) when it is the last
# message or has reasoning, so a turn renders otherwise when last than inside the conversation.
QWEN3 = """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- set reasoning = message.reasoning_content | default('') %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- message.content | default('') }}
        {%- for call in message.tool_calls | default([]) %}
            {{- '\n<tool_call>\n' + call.function | tojson + '\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

GEMMA = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set prefix = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}
    {{- message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# name: (template, special tokens, BOS, EOS, end-of-turn, assistant header, extra EOS ids)
FAMILIES = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>",
               "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n",
               ["<|end_of_text|>"]),
    "qwen2.5": (QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
                "<|im_end|>", "<|im_start|>assistant\n", ["<|endoftext|>"]),
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
              "<|im_end|>", "<|im_start|>assistant\n", ["<|endoftext|>"]),
    "gemma": (GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>",
              "<eos>", "<end_of_turn>", "<start_of_turn>model\n", ["<end_of_turn>"]),
}  # fmt: skip

# The id each conversation ends with (its document boundary): the EOS, unless the template writes
# it inside conversations.
BOUNDARY = {"llama3": "<|end_of_text|>", "qwen2.5": "<|endoftext|>", "qwen3": "<|endoftext|>",
            "gemma": "<eos>"}  # fmt: skip

CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "café ☕"}}}
CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "alpha beta?"},
        {"role": "assistant", "content": " gamma delta. "},
    ],
    "multi": [
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": "beta gamma."},
        {"role": "user", "content": "delta\n\nepsilon?"},
        {"role": "assistant", "content": "zeta, eta é theta."},
    ],
    "system": [
        {"role": "system", "content": "You are iota."},
        {"role": "user", "content": "kappa?"},
        {"role": "assistant", "content": "lambda."},
        {"role": "user", "content": "mu?"},
        {"role": "assistant", "content": "alpha alpha."},
    ],
    "tool": [
        {"role": "system", "content": "Tools: lookup."},
        {"role": "user", "content": "look up café"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "beta"},
        {"role": "assistant", "content": "It is beta."},
    ],
}


def write_chat_tokenizer(path, family: str) -> Tokenizer:
    """A tiny BPE with the family's special tokens and configs, as a model directory has them."""
    template, specials, bos, eos, _, _, extra_eos = FAMILIES[family]
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 5
    write_tiny_tokenizer(path, texts, specials[0])
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(specials[1:])
    if bos is not None:  # the tokenizer adds BOS itself: the template's BOS must not double it
        pair = f"{bos} $A {bos} $B"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=pair, special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "chat_template": template}  # fmt: skip
    if bos is not None:
        config["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tok.token_to_id(t) for t in [eos, *extra_eos]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, tokenizer directory, our tokenizer, transformers' tokenizer)."""
    path = tmp_path_factory.mktemp(request.param)
    tok = write_chat_tokenizer(path, request.param)
    return request.param, path, tok, transformers.AutoTokenizer.from_pretrained(str(path))


def assistant_spans(name: str, hf_tok, text: str, ids: list[int]) -> list[np.ndarray]:
    """Each assistant turn's token mask, found from the family's format: from the end of its
    header to the end of its end-of-turn text, mapped to tokens by transformers' offsets."""
    _, _, _, _, end, header, _ = FAMILIES[name]
    offsets = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert offsets["input_ids"] == ids
    spans = []
    for m in re.finditer(re.escape(header), text):
        stop = text.index(end, m.end()) + len(end)
        spans.append(np.array([m.end() <= a and b <= stop for a, b in offsets["offset_mapping"]]))
    return spans


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_ids_equal_transformers_and_masks_hold_the_assistant_turns(family, conversation):
    name, path, tok, hf_tok = family
    messages = CONVERSATIONS[conversation]
    eos_id = tok.token_to_id(FAMILIES[name][3])
    encoders = {
        train_on: chat.ChatEncoder(chat.load_spec(str(path), tok, eos_id, train_on=train_on), tok)
        for train_on in chat.TRAIN_ON
    }
    try:
        hf_ids = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    except Exception as refused:  # the Gemma format has no tool role: it is refused as there
        assert name == "gemma" and conversation == "tool", refused
        with pytest.raises(chat.Skip, match="refuses it: Conversation roles must alternate"):
            encoders["assistant"].encode(messages)
        return
    text = hf_tok.apply_chat_template(messages, tokenize=False)
    spans = assistant_spans(name, hf_tok, text, hf_ids)
    assert len(spans) == sum(m["role"] == "assistant" for m in messages)
    boundary = tok.token_to_id(BOUNDARY[name])
    assert all(e.spec.eos_id == boundary for e in encoders.values())
    appended = [boundary]  # none of these templates ends a conversation with its boundary
    expected = {
        "assistant": np.any(spans, axis=0),
        "last_assistant": spans[-1],
        "all": np.ones(len(hf_ids), dtype=bool),
    }
    for train_on, encoder in encoders.items():
        ids, mask = encoder.encode(messages)
        assert ids == hf_ids + appended
        np.testing.assert_array_equal(mask, np.r_[expected[train_on], [False] * len(appended)])
    if FAMILIES[name][2] is not None:  # BOS once, though the tokenizer's post-processor adds it
        assert ids.count(tok.token_to_id(FAMILIES[name][2])) == 1
    assert ids.count(boundary) == 1  # one document for --document_masking
    # The mask holds each assistant text and its end-of-turn token, no header, no newline after.
    ids, mask = encoders["assistant"].encode(messages)
    trained = tok.decode([ids[i] for i in np.flatnonzero(mask)], skip_special_tokens=False)
    assert trained.count(FAMILIES[name][4]) == len(spans) and trained.endswith(FAMILIES[name][4])
    end, header = FAMILIES[name][4:6]
    assert header not in trained and end + "\n" not in trained
    # A reply's prompt is what transformers gives with the generation prompt.
    prompt = messages[: max(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
    assert encoders["assistant"].prompt_ids(prompt) == hf_tok.apply_chat_template(
        prompt, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_prepare_writes_conversations_and_counts_the_skipped(tmp_path, capsys):
    path = tmp_path / "tok"
    path.mkdir()
    tok = write_chat_tokenizer(path, "qwen2.5")
    good = [CONVERSATIONS[c] for c in sorted(CONVERSATIONS)]
    no_reply = [{"role": "user", "content": "alpha?"}]
    bad_role = [{"content": "alpha"}]
    rows = [*good, no_reply, bad_role, no_reply, None, {"role": "user"}, "alpha"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    pq.write_table(pa.table({"messages": good}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    error = prepare_here(f"--input={tmp_path}/a.jsonl,{tmp_path}/b.parquet", f"--tokenizer={path}",
                         f"--out_dir={out}", "--messages_field=messages", "--eval_fraction=0",
                         "--workers=2")  # fmt: skip
    assert error is None
    printed = capsys.readouterr().out
    assert "skipped 2 conversation(s): no assistant message\n" in printed
    assert "skipped 1 conversation(s): a message is not an object with a string 'role'" in printed
    assert "skipped 3 conversation(s): the messages are not a non-empty list" in printed
    encoder = chat.ChatEncoder(chat.load_spec(str(path), tok, tok.token_to_id("<|im_end|>")), tok)
    expected = [encoder.encode(m) for m in good + good]
    shard = open_shard(out / "train-000.bin")
    assert shard.tokens.tolist() == [t for ids, _ in expected for t in ids]
    np.testing.assert_array_equal(shard.mask(0, shard.num_tokens), np.concatenate(
        [mask for _, mask in expected]))  # fmt: skip
    # <|im_end|> ends every turn: <|endoftext|> ends each conversation, the document boundary.
    boundary = tok.token_to_id("<|endoftext|>")
    assert json.loads((out / "eos.json").read_text())["eos_id"] == boundary
    assert "ends with <|endoftext|> (id" in printed
    assert shard.tokens.tolist().count(boundary) == len(expected)
    error = prepare_here(f"--input={tmp_path}/a.jsonl", f"--tokenizer={path}", "--overwrite",
                         f"--out_dir={out}", "--messages_field=messages", "--eos_token=<|im_end|>")  # fmt: skip
    assert error == (
        "error: --eos_token=<|im_end|>: the chat template writes it inside conversations, so "
        "with --document_masking it would split them; leave --eos_token out, or give a token "
        "the template does not write"
    )


def test_a_template_whose_beginnings_render_differently_is_skipped_unless_training_on_all(tmp_path):
    # It writes the message count first, so no render of the first turns is a prefix of the whole.
    tok = Tokenizer.from_str(_any_tokenizer(tmp_path))
    source = (
        "{{ messages | length }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    spec = chat.ChatSpec(source, "t.jinja", {}, (), eos_id=0)
    with pytest.raises(chat.Skip, match="assistant turns cannot be located"):
        chat.ChatEncoder(spec, tok).encode(CONVERSATIONS["single"])
    spec = chat.ChatSpec(source, "t.jinja", {}, (), eos_id=0, train_on="all")
    ids, mask = chat.ChatEncoder(spec, tok).encode(CONVERSATIONS["single"])
    assert ids[-1] == 0 and mask[:-1].all() and not mask[-1]


def test_a_conversation_ending_with_its_boundary_gets_no_second_one(tmp_path):
    # As Llama 2's format: EOS closes each assistant turn, so it is the reply's end, trained.
    tok = Tokenizer.from_str(_any_tokenizer(tmp_path))
    eos = tok.token_to_id("<eos>")
    source = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}<eos>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    spec = chat.ChatSpec(source, "t.jinja", {}, (eos,), eos_id=eos)
    ids, mask = chat.ChatEncoder(spec, tok).encode(CONVERSATIONS["single"])
    text = "user: alpha beta?assistant:  gamma delta. <eos>"
    assert ids == tok.encode(text, add_special_tokens=False).ids
    trained = tok.decode(
        [i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
    )
    assert trained == " gamma delta. <eos>"


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "no chat template in .* or give prepare --chat_template=FILE"),
        (["--chat_template=missing.jinja"], "--chat_template: 'missing.jinja' does not exist"),
        (["--chat_template={bad}"], "chat template .*bad.jinja: line 1: "),
        (
            ["--messages_field=turns", "--chat_template={good}"],
            "a.jsonl:1: record has no 'turns' field .* --messages_field",
        ),
        (["--quickstart"], "--quickstart makes its own corpus .* --messages_field"),
    ],
)
def test_bad_chat_input_is_one_line(tmp_path, flags, message):
    write_tiny_tokenizer(tmp_path, WORDS, "</s>")  # no chat template
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "good.jinja").write_text(QWEN25)
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": CONVERSATIONS["single"]}) + "\n")
    flags = [f.format(bad=tmp_path / "bad.jinja", good=tmp_path / "good.jinja") for f in flags]
    error = prepare_here(f"--input={tmp_path}/a.jsonl", f"--tokenizer={tmp_path}",
                         f"--out_dir={tmp_path / 'out'}", "--messages_field=messages", *flags)  # fmt: skip
    assert error.startswith("error:") and "\n" not in error
    assert re.search(message, error), error


def test_generate_chat_needs_a_template(tmp_path):
    tok = write_tiny_tokenizer(tmp_path, WORDS, "</s>")
    with pytest.raises(gen.GenerateError, match="^no chat template in .*chat_template.jinja"):
        gen.encode_prompt(tok, "alpha?", 300, chat_dir=str(tmp_path))


def test_sample_chat_without_samples_is_refused(tmp_path):
    write_shard(tmp_path / "t.bin", np.arange(64, dtype=np.int32), vocab_size=64)
    data = DataConfig(train_files=(str(tmp_path / "t.bin"),))
    with pytest.raises(SettingError, match="^--sample_chat needs --sample_every_n_steps"):
        TrainConfig(model=ModelSpec(model="tiny", from_scratch=True), data=data, steps=1,
                    sample_chat=True)  # fmt: skip


HOSTILE = {
    "class": "{{ messages.__class__.__mro__ }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "item": "{{ messages['__class__'] }}",
    "namespace": "{% set ns = namespace(a=1) %}{% set ns.__dict__ = 1 %}",
    "include": "{% include '/etc/passwd' %}",
    "import": "{% from '/etc/hosts' import x %}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_templates_are_refused_in_one_line(tmp_path, kind):
    path = tmp_path / "tok"
    path.mkdir()
    write_chat_tokenizer(path, "qwen2.5")
    (tmp_path / "evil.jinja").write_text(HOSTILE[kind])
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": CONVERSATIONS["single"]}) + "\n")
    error = prepare_here(f"--input={tmp_path}/a.jsonl", f"--tokenizer={path}",
                         f"--out_dir={tmp_path / 'out'}", "--messages_field=messages",
                         f"--chat_template={tmp_path / 'evil.jinja'}", "--workers=1")  # fmt: skip
    assert error.startswith("error: chat template") and "\n" not in error
    assert "is refused" in error and "evil.jinja" in error
    assert not (tmp_path / "out").exists()


def test_a_sandbox_escape_at_render_time_is_refused(tmp_path):
    # A name built at run time passes the static check; the sandbox stops it while rendering.
    source = "{% set name = '_' ~ '_class__' %}{{ messages[0][name].mro() }}"
    spec = chat.ChatSpec(source, "t.jinja", {}, (), 0)
    encoder = chat.ChatEncoder(spec, Tokenizer.from_str(_any_tokenizer(tmp_path)))
    with pytest.raises(chat.ChatTemplateError, match="chat template t.jinja is refused"):
        encoder.encode(CONVERSATIONS["single"])


def _any_tokenizer(tmp_path) -> str:
    write_chat_tokenizer(tmp_path, "gemma")
    return (tmp_path / "tokenizer.json").read_text()


def test_a_chat_fine_tune_learns_the_replies_and_generate_chat_stops_at_end_of_turn(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    write_chat_tokenizer(tok_dir, "gemma")  # EOS <eos>; a reply ends at <end_of_turn>
    # The template comes as a file: prepare copies it to the data, the export takes it along.
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "gemma.jinja").write_text(config.pop("chat_template"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    questions = WORDS[:4]
    reply = {w: f"{WORDS[i + 4]} {WORDS[i + 8]}." for i, w in enumerate(questions)}
    asked = np.random.default_rng(0).choice(questions, 300)
    rows = [[{"role": "user", "content": f"{w}?"}, {"role": "assistant", "content": reply[w]}]
            for w in asked]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    data = tmp_path / "data"
    assert prepare_here(f"--input={tmp_path}/chat.jsonl", f"--tokenizer={tok_dir}",
                        f"--out_dir={data}", "--messages_field=messages", "--eval_fraction=0",
                        f"--chat_template={tmp_path}/gemma.jinja", "--workers=1") is None  # fmt: skip
    assert (data / "chat_template.jinja").read_text() == GEMMA
    model = tmp_path / "small"  # a config.json for --from_scratch: smaller than the tiny preset
    transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, architectures=["LlamaForCausalLM"]
                             ).save_pretrained(model)  # fmt: skip
    flags = [f"--model={model}", "--from_scratch", f"--train_file={data}/train-*.bin",
             "--document_masking", "--seq_len=64", "--gpus=1", "--batch_size=8",
             "--matmul_dtype=float32", "--steps=150", "--lr=1e-2", "--warmup=5",
             "--sample_every_n_steps=150", "--sample_chat", f"--sample_prompts={questions[2]}?",
             "--sample_max_new_tokens=8", f"--out_dir={tmp_path}/model",
             f"--log_file={tmp_path}/log.jsonl"]  # fmt: skip
    done = train_here(*flags)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["log"] == "step"]
    # Only the replies are trained on: their tokens are a fraction of each window.
    assert all(r["trained_tokens"] < r["tokens"] / 2 for r in steps)
    assert steps[-1]["loss"] < 0.1 * steps[0]["loss"]
    [sample] = [r for r in records if r["log"] == "sample"]
    assert sample["text"] == reply[questions[2]]  # the reply, cut at <end_of_turn>
    proc = subprocess.run([sys.executable, "-m", "jaxllmq.generate", f"--model={tmp_path}/model",
                           "--chat", f"--prompt={questions[2]}?", "--temperature=0"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == reply[questions[2]] + "\n"
