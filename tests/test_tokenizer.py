"""Tokenizer parity with transformers (the oracle) on the default model, chat templates in the
sandbox, stop ids, and the streaming detokenizer."""

import json
import re

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxllm.io.paths import default_model_path
from jaxllm.text.tokenizer import ChatTemplateError, load_tokenizer
from hangs import error_within

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "chinese": "你好，世界！今天的天气很好，我们去公园散步吧。",
    "code": "def f(x):\n\tif x > 0:\n\t\treturn x  # positive\n    else:\n        return -x\n",
    "emoji": "Launch 🚀 done 👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧",
    "whitespace": "  leading\n\n\n\nand   runs \t\t of \r\n   whitespace   \n ",
    "special": "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "numbers": "12345 + 0.001 = 12345.001; 1e-9, -42, 2024-11-29",
    "mixed": "Ünïcödé, ça va? Ωμέγα, русский, العربية, 日本語のテキスト ✓ ∑∫√",
    "empty": "",
}

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is 2+2?"}],
    "user only": [{"role": "user", "content": "Hi there 👋"}],
    "multi-turn": [{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": "Tell me a joke."},
                   {"role": "assistant", "content": "Why did the chicken cross the road?"},
                   {"role": "user", "content": "Why?\n\tTell me."}],
}


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer()


@pytest.fixture(scope="module")
def theirs():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_backend_is_transformers_gguf_conversion(ours, theirs):
    a, b = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "model", "decoder", "added_tokens", "post_processor"):
        assert a[part] == b[part], part


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEXTS))
def test_ids_match_transformers(ours, theirs, name):
    text = TEXTS[name]
    for add in (False, True):
        assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)


def test_special_tokens_in_text_are_single_ids(ours):
    assert ours.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEXTS))
def test_decode_round_trip(ours, theirs, name):
    text = TEXTS[name]
    ids = ours.encode(text)
    assert ours.decode(ids) == text == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_decode_rejects_out_of_range_ids(ours):
    with pytest.raises(ValueError, match="49152"):
        ours.decode([1, 49152])
    with pytest.raises(ValueError, match="-1"):
        ours.decode([-1])


@pytest.mark.slow
def test_special_ids_and_stop_ids(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.pad_token_id == theirs.pad_token_id == 2
    # SmolLM2-Instruct ends turns with <|im_end|>, which is also its eos
    assert ours.id_to_token(2) == "<|im_end|>"
    assert 2 in ours.eos_token_ids
    assert ours.eos_token_ids[0] == theirs.eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_matches_transformers(ours, theirs, name):
    messages = CONVERSATIONS[name]
    for add in (True, False):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert ours.chat_template == theirs.chat_template


@pytest.mark.slow
def test_chat_template_features_match_transformers(ours, theirs):
    # transformers' extras: tojson without HTML escaping, loop controls, raise_exception,
    # namespace, the {% generation %} tag, strftime_now, and the special-token variables
    template = (
        "{% set ns = namespace(n=0) %}{{ bos_token }}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% if ns.n > 3 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['role'] }}]{% endgeneration %} {{ m | tojson }}\n{% endfor %}"
        "{{ eos_token }}{{ strftime_now('%Y') }}{% if messages | length > 9 %}{{ raise_exception('long') }}{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>&'\"</b> ü"}, {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "ok", "tool_calls": None},
                {"role": "user", "content": "a"}, {"role": "user", "content": "never shown"}]
    expected = theirs.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(messages, chat_template=template, add_generation_prompt=False) == expected
    with pytest.raises(ChatTemplateError, match="long"):
        ours.apply_chat_template(messages * 2, chat_template=template)


UNSAFE_TEMPLATES = {
    "mro walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "function globals": "{{ raise_exception.__globals__['os'].system('touch {marker}') }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "mutation": "{% set x = messages %}{{ x.append({'role': 'user'}) }}",
    "namespace dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
}


@pytest.mark.parametrize("name", list(UNSAFE_TEMPLATES))
def test_chat_template_sandbox(ours, tmp_path, name):
    marker = tmp_path / "pwned"
    template = UNSAFE_TEMPLATES[name].replace("{marker}", str(marker))
    with pytest.raises(ChatTemplateError, match="sandbox forbids"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)
    assert not marker.exists()


def test_chat_template_errors_are_clear(ours):
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(ValueError, match="empty"):
        ours.apply_chat_template([])


def test_chat_template_takes_any_iterable_of_messages(ours):
    """A generator or map is read once, whole: the checks must not spend it before the render."""
    messages = CONVERSATIONS["system+user"]
    expected = ours.apply_chat_template(messages)
    assert "What is 2+2?" in expected
    assert ours.apply_chat_template(m for m in messages) == expected
    assert ours.apply_chat_template(map(dict, messages)) == expected
    assert ours.apply_chat_template(tuple(messages)) == expected


@pytest.mark.parametrize("messages, message", [
    ({"role": "user", "content": "x"}, "conversation must be a list of message dicts, got dict"),
    (None, "conversation must be a list of message dicts, got None"),
    ("hello", "conversation must be a list of message dicts, got str 'hello'"),
    (5, "conversation must be a list of message dicts, got int 5"),
    (["hello"], "message 0 must be a dict with a role and content, got str 'hello'"),
])
def test_chat_template_names_a_conversation_of_the_wrong_shape(ours, messages, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        ours.apply_chat_template(messages)


def test_an_empty_chat_template_is_refused(ours):
    """"" is not None: it must not fall back to the model's template without a word."""
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="chat_template is an empty string"):
        ours.apply_chat_template(messages, chat_template="")
    with pytest.raises(TypeError, match="chat_template must be a Jinja template string, got int 0"):
        ours.apply_chat_template(messages, chat_template=0)


def test_chat_template_nested_loops_trip_the_range_budget(ours):
    # 10**10 iterations without the budget; each range() alone is within jinja's own cap
    template = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    error = error_within(5, lambda: ours.apply_chat_template([{"role": "user", "content": "x"}],
                                                             chat_template=template), ChatTemplateError)
    assert "1000000 range() items" in str(error)
    # the budget is per render: a template within it still renders afterwards
    assert ours.apply_chat_template([{"role": "user", "content": "x"}],
                                    chat_template="{{ range(3) | list | length }}") == "3"


HUGE_TEMPLATES = {
    # each fails fast without the limits too, rather than exhausting memory or hanging
    "repeated str": ("{{ 'a' * 10**8 }}", "repeats a str to 100000000 items"),
    "repeated list": ("{{ 600000 * [1, 2] }}", "repeats a list to 1200000 items"),
    "power": ("{{ 2 ** 10000000 }}", "over 4300 digits with \\*\\*"),
    "squaring": ("{% set ns = namespace(x=10) %}{% for i in range(14) %}{% set ns.x = ns.x * ns.x %}"
                 "{% endfor %}{{ ns.x }}", "over 4300 digits with \\*"),
}


@pytest.mark.parametrize("name", list(HUGE_TEMPLATES))
def test_chat_template_refuses_huge_values(ours, name):
    template, message = HUGE_TEMPLATES[name]
    with pytest.raises(ChatTemplateError, match=message):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    # small values still work
    small = "{{ 'ab' * 2 }}{{ 3 * [0] }}{{ 2 ** 10 }}"
    assert ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=small) == "abab[0, 0, 0]1024"


FAILING_TEMPLATES = {
    "huge range": ("{{ range(10**9) }}", "OverflowError"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "wrong argument type": ("{{ strftime_now(5) }}", "TypeError"),
    "memory": ("{{ 'a'.ljust(10**10) }}", "MemoryError: it needed more than the 2048 MB"),
}


@pytest.mark.parametrize("name", list(FAILING_TEMPLATES))
def test_chat_template_exceptions_become_chat_template_errors(tmp_path, name):
    template, error = FAILING_TEMPLATES[name]
    # the model file's own template: the error names the file and the original error
    write_sentencepiece_gguf(tmp_path / "sp.gguf", [("add_string", "tokenizer.chat_template", template)])
    tok = load_tokenizer(tmp_path / "sp.gguf")
    with pytest.raises(ChatTemplateError, match=f"sp.gguf: the chat template failed: {error}"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


RUNAWAY_TEMPLATES = {
    # no budget names these: the render process's limits stop them
    "a reused range": ("{% set r = range(1000) %}{% for a in r %}{% for b in r %}{% for c in r %}"
                       "{% endfor %}{% endfor %}{% endfor %}", "ran for more than 2 s"),
    "a long string": ("{% set s = 'ab' * 400000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                      "ran for more than 2 s"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s | length }}", "(ran for more than 2 s|MemoryError)"),
    "lipsum": ("{{ lipsum(10**7) }}", "ran for more than 2 s"),
    "ljust": ("{{ 'a'.ljust(10**10) }}", "MemoryError"),
    "a format width": ("{{ '{:>10000000000}'.format(1) }}", "MemoryError"),
    "center": ("{{ 'x' | center(10**10) }}", "MemoryError"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNAWAY_TEMPLATES))
def test_chat_template_runaways_stop_at_the_render_limits(ours, monkeypatch, name):
    """A template that would hang or exhaust memory fails within the time limit, naming the limit,
    and the next render works (in a fresh render process where the last was stopped)."""
    monkeypatch.setattr("jaxllm.text.chat_template.RENDER_SECONDS", 2.0)
    template, message = RUNAWAY_TEMPLATES[name]
    chat = [{"role": "user", "content": "x"}]
    error = error_within(20, lambda: ours.apply_chat_template(chat, chat_template=template), ChatTemplateError)
    assert re.search(message, str(error)), error
    assert ours.apply_chat_template(chat, chat_template="{{ messages[0].content }}!") == "x!"


def test_a_text_longer_than_the_limit_is_refused(ours, monkeypatch):
    """A template's text past `RENDER_CHARS` is an error naming its length, never handed back (here
    a limit of 1000 characters; by default 32M, far past any model's context)."""
    monkeypatch.setattr("jaxllm.text.chat_template.RENDER_CHARS", 1000)
    chat = [{"role": "user", "content": "x" * 600}]
    assert len(ours.apply_chat_template(chat, chat_template="{{ messages[0].content }}")) == 600
    with pytest.raises(ChatTemplateError, match="text is 1200 characters long, more than the 1000 a render"):
        ours.apply_chat_template(chat, chat_template="{{ messages[0].content * 2 }}")
    assert ours.apply_chat_template(chat, chat_template="{{ messages[0].content[:3] }}!") == "xxx!"


def test_conversations_of_arrays_and_deep_nesting(ours):
    """Arrays reach the template as lists; a conversation nested past Python's recursion limit is
    a ChatTemplateError naming it (both were raw ValueError and RecursionError)."""
    template = "{{ messages[0].content }} {{ messages[0].content | sum }} {{ scale }}"
    chat = [{"role": "user", "content": np.array([1, 2, 3])}]
    assert ours.apply_chat_template(chat, chat_template=template, scale=np.float32(0.5)) == "[1, 2, 3] 6 0.5"
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        ours.apply_chat_template([{"role": "user", "content": deep}], chat_template=template)


def test_a_render_process_that_died_is_replaced(ours):
    from jaxllm.text.chat_template import _Worker

    chat = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(chat, chat_template="{{ 1 + 1 }}") == "2"
    _Worker._idle[-1].process.kill()
    _Worker._idle[-1].process.wait()
    assert ours.apply_chat_template(chat, chat_template="{{ 2 + 2 }}") == "4"


STREAM_TEXTS = [TEXTS["chinese"], TEXTS["emoji"], TEXTS["mixed"],
                "<|im_start|>assistant\n日本語 🙂 and ascii<|im_end|>"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_emits_whole_characters(ours, text):
    ids = ours.encode(text)
    # the point of the test: some token ends inside a UTF-8 character
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    stream = ours.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # text arrives as it completes, not all at the end
    assert sum(bool(p) for p in pieces[:-1]) >= len(text) // 4


def test_stream_skipping_special_tokens(ours):
    text = "<|im_start|>assistant\n你好 👋<|im_end|>"
    ids = ours.encode(text)
    stream = ours.stream(skip_special_tokens=True)
    out = "".join(stream.push(i) for i in ids) + stream.flush()
    assert out == ours.decode(ids, skip_special_tokens=True) == "assistant\n你好 👋"


def test_invalid_utf8_text_is_refused(ours):
    # what `jaxllm generate "$(printf 'a\\xffb')"` hands over: the byte escaped as a lone surrogate
    text = b"a\xffb".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="not valid UTF-8: byte 0xff at character 1"):
        ours.encode(text)
    with pytest.raises(ValueError, match="message 1's content is not valid UTF-8"):
        ours.apply_chat_template([{"role": "system", "content": "hi"}, {"role": "user", "content": text}])


def test_ids_must_be_integers_in_range(ours):
    with pytest.raises(ValueError, match="token id -1 is out of range for a vocabulary of 49152"):
        ours.id_to_token(-1)
    with pytest.raises(ValueError, match="integers, got 1.7"):
        ours.decode([1.7])
    with pytest.raises(ValueError, match="integers, got 2.5"):
        ours.stream().push(2.5)
    # integer scalars of any kind still work, and numpy's bools as flags
    assert ours.decode(np.array([1, 2], np.int32)) == ours.decode([1, 2]) == "<|im_start|><|im_end|>"
    assert ours.id_to_token(np.int64(2)) == "<|im_end|>"
    assert ours.decode([1, 2], skip_special_tokens=np.True_) == ours.decode([1, 2], skip_special_tokens=True)
    assert ours.encode("hi", add_special_tokens=np.False_) == ours.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("call, error, message", [
    (lambda t: t.decode(None), TypeError, "decode takes a list of token ids, got None"),
    (lambda t: t.decode(5), TypeError,
     "decode takes a list of token ids, got int 5; for one token, decode([token_id])"),
    (lambda t: t.decode(np.int64(5)), TypeError, "for one token, decode([token_id])"),
    (lambda t: t.decode("hi"), TypeError, "decode takes a list of token ids, got str 'hi'"),
    (lambda t: t.decode(b"hi"), TypeError, "decode takes a list of token ids, got bytes"),
    (lambda t: t.decode([1, 2], skip_special_tokens="yes"), TypeError,
     "skip_special_tokens must be True or False, got str 'yes'"),
    (lambda t: t.stream(skip_special_tokens="yes"), TypeError, "skip_special_tokens must be True or False"),
    (lambda t: t.encode("hi", add_special_tokens="no"), TypeError, "add_special_tokens must be True or False"),
    (lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt="no"),
     TypeError, "add_generation_prompt must be True or False, got str 'no'"),
    (lambda t: t.token_to_id(5), TypeError, "token_to_id takes a token string, got int 5"),
])
def test_bad_arguments_are_named(ours, call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call(ours)


def test_decode_still_takes_any_iterable_of_ids(ours):
    assert ours.decode(i for i in [1, 2]) == ours.decode((1, 2)) == "<|im_start|><|im_end|>"
    assert ours.token_to_id("<|im_end|>") == 2 and ours.token_to_id(None) is None


def test_stream_flushes_an_incomplete_tail(ours):
    ids = ours.encode("a🙂")
    stream = ours.stream()
    out = "".join(stream.push(i) for i in ids[:-1])
    assert "\ufffd" not in out
    assert out + stream.flush() == ours.decode(ids[:-1])


# --- Hugging Face directories ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(theirs, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    theirs.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_hf_directory_matches(ours, theirs, hf_dir):
    from_dir = load_tokenizer(hf_dir)
    reloaded = AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS.values():
        assert from_dir.encode(text) == ours.encode(text) == reloaded.encode(text, add_special_tokens=False)
        for add in (False, True):
            assert from_dir.encode(text, add_special_tokens=add) == reloaded.encode(text, add_special_tokens=add)
    for messages in CONVERSATIONS.values():
        assert from_dir.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (from_dir.eos_token_ids, from_dir.bos_token_id, from_dir.pad_token_id, from_dir.vocab_size) == \
           (ours.eos_token_ids, ours.bos_token_id, ours.pad_token_id, ours.vocab_size)


def test_hf_directory_generation_config_adds_stop_ids(hf_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    assert load_tokenizer(tmp_path).chat_template is None  # the template lived in chat_template.jinja
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2, 0)


BAD_CONFIG_ENTRIES = {
    "extra_special_tokens": "abc",
    "additional_special_tokens": "abc",
    "eos_token": 5,
}


@pytest.mark.parametrize("key", list(BAD_CONFIG_ENTRIES))
def test_hf_directory_mistyped_config(hf_dir, tmp_path, key):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config.pop("extra_special_tokens", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {key: BAD_CONFIG_ENTRIES[key]}))
    with pytest.raises(ValueError, match=f"tokenizer_config.json: {key} is"):
        load_tokenizer(tmp_path)


def test_hf_directory_unreadable_chat_template_file(hf_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    with pytest.raises(ValueError, match="chat_template.jinja: cannot read"):
        load_tokenizer(tmp_path)


def test_hf_directory_missing_files(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "chat_template.jinja",
                                  "tokenizer_config.json"])
def test_hf_directory_entry_that_is_a_directory(hf_dir, tmp_path, name):
    """A directory where a file belongs is named, not passed over as if the file were absent."""
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((hf_dir / file).read_bytes())
    (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name} is not a file")):
        load_tokenizer(tmp_path)


# --- a SentencePiece-style GGUF vocabulary (tokenizer.ggml.model == "llama") -------------------

def write_sentencepiece_gguf(path, metadata=()):
    """A tiny llama-2 style vocabulary: byte fallback, merges implied by scores, a user-defined
    token and a ChatML end-of-turn control token. `metadata`: (writer method, key, value) entries
    written last, replacing a key written before."""
    pieces = ["▁", "e", "t", "h", "a", "o", "l", "r", "d", "w", "n", "i", "s", ",", ".", "!",
              "▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁h", "ll", "▁w", "or", "ld", "▁wor",
              "▁world", "▁he", "▁hell", "▁hello", "ell", "hell", "ello", "hello", "▁▁", "▁▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<think>", "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}")
    for method, key, value in metadata:
        getattr(w, method)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = load_tokenizer(tmp_path / "sp.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    a, b = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "model", "decoder", "added_tokens", "post_processor"):
        assert a[part] == b[part], part
    for text in ["hello world", "  hello  world ", "Hello, the world! <think>in</think> é😀Z",
                 "<s>the</s><|im_end|>", ""]:
        for add in (False, True):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == theirs.encode(text, add_special_tokens=add)
            assert ours.decode(ids) == theirs.decode(ids)
            stream = ours.stream()
            assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)
    assert ours.encode("hello", add_special_tokens=True)[0] == 1  # llama vocabularies add BOS
    # eos, plus <|im_end|> because the template ends turns with it
    assert ours.eos_token_ids == (2, ours.token_to_id("<|im_end|>"))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_gguf_without_tokenizer(tmp_path):
    path = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "absent.gguf")


def test_gguf_no_token_id_means_none(tmp_path):
    """llama.cpp writes 2**32 - 1 (LLAMA_TOKEN_NULL) for a token a model lacks; published GGUFs
    carry it as the padding id. It was refused, as outside the vocabulary and past int32."""
    from jaxllm.io.gguf import gguf_to_hf_config

    write_sentencepiece_gguf(tmp_path / "sp.gguf", [("add_uint32", "tokenizer.ggml.padding_token_id", 2**32 - 1)])
    tok = load_tokenizer(tmp_path / "sp.gguf")
    assert tok.encode("hello", add_special_tokens=True)[0] == 1 and tok.eos_token_ids[0] == 2
    config = gguf_to_hf_config(tmp_path / "sp.gguf")
    assert "pad_token_id" not in config and config["eos_token_id"] == 2


MISTYPED_GGUF_KEYS = {
    "bos id as a string": ("add_string", "tokenizer.ggml.bos_token_id", "1", "str"),
    "eos id as a float": ("add_float32", "tokenizer.ggml.eos_token_id", 2.0, "float"),
    "eot id as a string": ("add_string", "tokenizer.ggml.eot_token_id", "2", "str"),
    "template as an int": ("add_uint32", "tokenizer.chat_template", 5, "int"),
    "template as a list": ("add_array", "tokenizer.chat_template", ["{{ a }}", "{{ b }}"], "list"),
    "add_bos as a string": ("add_string", "tokenizer.ggml.add_bos_token", "false", "str"),
}


@pytest.mark.parametrize("name", list(MISTYPED_GGUF_KEYS))
def test_gguf_mistyped_tokenizer_metadata(tmp_path, name):
    method, key, value, found = MISTYPED_GGUF_KEYS[name]
    write_sentencepiece_gguf(tmp_path / "sp.gguf", [(method, key, value)])
    with pytest.raises(ValueError, match=f"sp.gguf: {key} is a {found} "):
        load_tokenizer(tmp_path / "sp.gguf")


# --- a byte-level GGUF vocabulary whose control tokens are outside the byte alphabet ----------

DEEPSEEK_SPECIALS = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>"]


def write_byte_level_gguf(path):
    """A tiny DeepSeek-R1-Distill-Qwen style vocabulary: the 256 byte tokens, a few merges, then
    control tokens spelled in plain UTF-8 (`｜`, `▁`) as llama.cpp's converter writes them, a
    user-defined token with a space, and BOS/EOS ids pointing at two of them."""
    from jaxllm.text.tokenizer import _bytes_to_unicode

    spell = _bytes_to_unicode()
    byte_tokens = [spell[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    words = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld"]
    tokens = byte_tokens + words + DEEPSEEK_SPECIALS + ["<think>", "a b"]
    types = [1] * (256 + len(words)) + [3] * len(DEEPSEEK_SPECIALS) + [4, 4]
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-r1-qwen")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<｜begin▁of▁sentence｜>"))
    w.add_eos_token_id(tokens.index("<｜end▁of▁sentence｜>"))
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_byte_level_control_tokens_keep_the_files_ids(tmp_path):
    tokens = write_byte_level_gguf(tmp_path / "ds.gguf")
    tok = load_tokenizer(tmp_path / "ds.gguf")
    ids = {t: tokens.index(t) for t in DEEPSEEK_SPECIALS + ["<think>", "a b"]}
    for text, i in ids.items():
        assert tok.token_to_id(text) == i
        assert tok.encode(text) == [i]  # one token, not its characters
    assert tok.backend.get_vocab_size(with_added_tokens=True) == len(tokens)  # nothing appended
    assert tok.bos_token_id == ids["<｜begin▁of▁sentence｜>"]
    assert tok.eos_token_ids[0] == ids["<｜end▁of▁sentence｜>"]
    text = "<｜User｜>hello world<think>a b<｜Assistant｜>"
    encoded = tok.encode(text, add_special_tokens=True)
    assert encoded == [ids["<｜begin▁of▁sentence｜>"], ids["<｜User｜>"], tokens.index("hello"),
                       tokens.index("Ġworld"), ids["<think>"], ids["a b"], ids["<｜Assistant｜>"]]
    assert max(encoded) < len(tokens)
    assert tok.decode(encoded[1:]) == text
    assert tok.decode(encoded, skip_special_tokens=True) == "hello world<think>a b"
    stream = tok.stream()
    assert "".join(stream.push(i) for i in encoded[1:]) + stream.flush() == text


@pytest.mark.parametrize("add_space_prefix", [None, True, False])
def test_sentencepiece_add_space_prefix(tmp_path, add_space_prefix):
    """Gemma 3's files say add_space_prefix = false: "hello" at the start is 'hello', not '▁hello'."""
    extra = [] if add_space_prefix is None else [("add_bool", "tokenizer.ggml.add_space_prefix",
                                                   add_space_prefix)]
    write_sentencepiece_gguf(tmp_path / "sp.gguf", extra)
    tok = load_tokenizer(tmp_path / "sp.gguf")
    prefix = add_space_prefix is not False  # llama.cpp's default is true
    first = tok.encode("hello world")[0]
    assert tok.backend.id_to_token(first) == ("▁hello" if prefix else "hello")
    for text in ["hello world", "hello  world ", "the world, hello!", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.backend.get_vocab_size(with_added_tokens=True) for i in ids)
    assert tok.backend.id_to_token(tok.encode("world hello")[-1]) == "▁hello"  # later words keep theirs
