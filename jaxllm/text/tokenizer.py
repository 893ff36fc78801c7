"""Tokenizers: text <-> token ids, chat templates, stop ids and streaming detokenization.

What this module owns:
- `load_tokenizer(path)`: a `Tokenizer` from a GGUF file (vocabulary, merges and special tokens
  in its metadata, rebuilt into a `tokenizers.Tokenizer` exactly as transformers' GGUF conversion
  does) or from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`, plus
  `chat_template.jinja` and `generation_config.json` when present).
- `Tokenizer.apply_chat_template`: the model's own Jinja template, rendered the way transformers
  renders it, but sandboxed and bounded in time and memory (`jaxllm.chat_template`): a template
  that comes with a downloaded checkpoint is untrusted code.
- `Tokenizer.eos_token_ids`: every id that ends a turn (eos, the generation config's ids, and the
  chat template's end-of-turn token), so generation stops where the model's authors meant.
- `Tokenizer.stream()`: incremental detokenization that never emits half a UTF-8 character.

transformers is only the test oracle; nothing here imports it.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from jaxllm.checks import flag
from jaxllm.io.paths import default_model_path
from jaxllm.model.config import END_OF_TURN_TOKENS
from jaxllm.text.chat_template import ChatTemplateError, render_chat_template
from jaxllm.text.detokenize import Detokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

@dataclasses.dataclass(frozen=True)
class _Specials:
    """The named special tokens (strings, as the chat template sees them) and the add-BOS/EOS flags."""

    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    pad: str | None = None
    extra: tuple[str, ...] = ()


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs around it: special ids, the chat
    template and the stop ids."""

    def __init__(self, backend: BackendTokenizer, *, specials: _Specials, chat_template: str | None,
                 extra_eos_ids: Iterable[int] = (), name: str = "tokenizer"):
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self._specials = specials
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)  # every id encode can produce
        self.bos_token_id = self.token_to_id(specials.bos)
        self.pad_token_id = self.token_to_id(specials.pad)
        self.unk_token_id = self.token_to_id(specials.unk)
        self.eos_token_id = self.token_to_id(specials.eos)
        eos = [self.eos_token_id, *extra_eos_ids]
        if chat_template:
            eos += [self.token_to_id(t) for t in END_OF_TURN_TOKENS if t in chat_template]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json (special tokens, chat template) and
        generation_config.json (stop ids): a directory `load_tokenizer` reads back as this one."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        sp = self._specials
        config = {"bos_token": sp.bos, "eos_token": sp.eos, "unk_token": sp.unk, "pad_token": sp.pad,
                  "extra_special_tokens": list(sp.extra)}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(self.eos_token_ids)}, indent=1))

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={self.chat_template is not None})")

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._specials.bos

    @property
    def eos_token(self) -> str | None:
        return self._specials.eos

    def token_to_id(self, token: str | None) -> int | None:
        """The id of the token spelled `token`; None when the vocabulary has no such token."""
        if token is None:
            return None
        if not isinstance(token, str):
            raise TypeError(f"token_to_id takes a token string, got {_described(token)}"
                            f"{'; id_to_token maps an id to its token' if isinstance(token, int) else ''}")
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(self._check_ids([token_id])[0])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) become their ids.
        `add_special_tokens` adds what the tokenizer's post-processor adds (BOS, for most llamas)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        add_special_tokens = flag("add_special_tokens", add_special_tokens, kind_error=TypeError)
        _check_utf8(text, "the text")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _check_ids(self, ids) -> list[int]:
        checked = []
        for i in ids:
            try:  # ints and numpy/jax integer scalars; int() would silently truncate 1.7
                checked.append(operator.index(i))
            except TypeError:
                raise ValueError(f"token ids must be integers, got {i!r}") from None
        bad = [i for i in checked if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}")
        return checked

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        # a str or bytes iterates as characters or byte values, a dict as its keys: never ids
        if (isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable)
                or getattr(ids, "ndim", None) == 0):
            one = "; for one token, decode([token_id])" if _is_integer(ids) else ""
            raise TypeError(f"decode takes a list of token ids, got {_described(ids)}{one}")
        skip_special_tokens = flag("skip_special_tokens", skip_special_tokens, kind_error=TypeError)
        return self.backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> "TextStream":
        """An incremental detokenizer: `.push(id)` returns the text that is now complete."""
        return TextStream(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[Mapping], add_generation_prompt: bool = True,
                            *, tools: list[dict] | None = None, chat_template: str | None = None,
                            **template_kwargs) -> str:
        """The conversation rendered by the model's chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` renders it. Extra keyword arguments reach the
        template (e.g. `enable_thinking=False` for Qwen3)."""
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise TypeError(f"chat_template must be a Jinja template string, got "
                                f"{_described(chat_template)}")
            if not chat_template:  # not "use the model's": None says that
                raise ValueError("chat_template is an empty string; pass a template, or None for the "
                                 "model's own")
        template = self.chat_template if chat_template is None else chat_template
        if template is None:
            raise ValueError(f"{self.name} has no chat template; pass chat_template= or encode raw text")
        add_generation_prompt = flag("add_generation_prompt", add_generation_prompt, kind_error=TypeError)
        messages = _conversation(messages)  # a list once: an iterator would be spent by the checks
        for n, message in enumerate(messages):
            if isinstance(message.get("content"), str):
                _check_utf8(message["content"], f"message {n}'s content")
        specials = {"bos_token": self._specials.bos, "eos_token": self._specials.eos,
                    "unk_token": self._specials.unk, "pad_token": self._specials.pad}
        context = {k: v for k, v in specials.items() if v is not None} | template_kwargs
        try:
            return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **context)
        except ChatTemplateError as e:
            if chat_template is not None:  # the caller's own template: the message says enough
                raise
            raise ChatTemplateError(f"{self.name}: {e}") from None  # the model file's template


def _is_integer(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _described(value) -> str:
    """A value named by its type, then shown, for an error message: `int 5`, `None`."""
    return "None" if value is None else f"{type(value).__name__} {value!r:.80}"




def _conversation(messages) -> list[Mapping]:
    """The messages as a list of message dicts: any iterable of them, taken once."""
    if messages is None or isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        one = " (one message? wrap it in a list)" if isinstance(messages, Mapping) else ""
        raise TypeError(f"the conversation must be a list of message dicts, got "
                        f"{_described(messages)}{one}")
    messages = list(messages)
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {n} must be a dict with a role and content, got {_described(message)}")
    return messages


def _check_utf8(text: str, what: str) -> None:
    """Refuse lone surrogates: Python hands undecodable input bytes (a prompt in another encoding on
    the command line) over as U+DC80..U+DCFF, which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        found = f"byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8: {found} at character {e.start}") from None


class TextStream(Detokenizer):
    """Turns token ids into text one id at a time, emitting only complete characters (see
    `Detokenizer`): the pieces joined equal `decode(all ids)`. Each id is checked first."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        super().__init__(tokenizer, flag("skip_special_tokens", skip_special_tokens, kind_error=TypeError))
        self._tok = tokenizer

    def push(self, token_id: int) -> str:
        """The text this id completes ('' while a character is unfinished)."""
        (token_id,) = self._tok._check_ids([token_id])
        return super().push(token_id)


# --- building from a GGUF file -----------------------------------------------------------------

@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token with these)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


# GGUF `tokenizer.ggml.pre` -> the split regex its merges were learned with (transformers'
# GGUF_PRE_TOKENIZER_SPLITS); other names keep GPT-2's own ByteLevel regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _byte_level_bpe(tokens: list[str], merges: list[str], plain: set[int] = frozenset()) -> BackendTokenizer:
    """GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`). The ids in `plain` (control,
    user-defined and named special tokens) keep the text the file gives them: llama.cpp's converter
    stores those decoded, as the text they match whole, not in the byte alphabet."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp writes a few ordinary tokens in plain UTF-8 rather than the byte alphabet; respell them
    vocab = {t if i in plain or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = BackendTokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                   dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scoring token first (transformers' `generate_merges`)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores,
                       add_space_prefix: bool = True) -> BackendTokenizer:
    """SentencePiece BPE with byte fallback (`tokenizer.ggml.model == "llama"`), as transformers'
    LlamaTokenizer builds it: `▁` for spaces, one prepended to the first word only unless the file
    says `add_space_prefix = false` (Gemma 3), and then none is stripped when decoding either."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif scores is not None:
        pairs = _sentencepiece_merges(tokens, scores)
    else:
        raise ValueError("a SentencePiece GGUF vocabulary needs merges or scores")
    backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                   dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _template_processing(specials: _Specials, add_bos: bool, add_eos: bool,
                         backend: BackendTokenizer) -> processors.TemplateProcessing:
    """BOS/EOS around `encode(..., add_special_tokens=True)`, as transformers' update_post_processor."""
    add_bos, add_eos = add_bos and specials.bos is not None, add_eos and specials.eos is not None
    single = f"{specials.bos + ':0 ' if add_bos else ''}$A:0{' ' + specials.eos + ':0' if add_eos else ''}"
    pair = (f"{single}{' ' + specials.bos + ':1' if add_bos else ''} $B:1"
            f"{' ' + specials.eos + ':1' if add_eos else ''}")
    special_tokens = ([(specials.bos, backend.token_to_id(specials.bos))] if add_bos else []) + \
                     ([(specials.eos, backend.token_to_id(specials.eos))] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


def _add_named_specials(backend: BackendTokenizer, specials: _Specials) -> None:
    """Named special tokens are matched whole in text and skipped by `skip_special_tokens`
    (transformers' `_post_init`)."""
    named = [specials.bos, specials.eos, specials.unk, specials.pad, *specials.extra]
    tokens = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named) if t is not None]
    if tokens:
        backend.add_special_tokens(tokens)


def _typed(info: dict, key: str, kind: type, path: Path):
    """`tokenizer.{key}` from GGUF metadata, None when absent; a value of another type is refused, not
    reinterpreted (a string "false" as a flag, a float as a token id, a string as a token list)."""
    value = info.get(key)
    if value is not None and type(value) is not kind:
        raise ValueError(f"{path}: tokenizer.{key} is a {type(value).__name__} ({value!r:.80}), "
                         f"expected a {kind.__name__}")
    return value


def _from_gguf(path: Path) -> Tokenizer:
    from jaxllm.io.gguf import GGUF_NO_TOKEN, gguf_tokenizer_info  # lazy: the gguf package is slow to import

    info = gguf_tokenizer_info(path)
    tokens = _typed(info, "ggml.tokens", list, path)
    if not all(type(t) is str for t in tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens is not a list of strings")
    types = _typed(info, "ggml.token_type", list, path) or []
    model = info.get("ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported "
                         f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    merges, scores = _typed(info, "ggml.merges", list, path), _typed(info, "ggml.scores", list, path)

    def token_id(key):
        i = _typed(info, f"ggml.{key}", int, path)
        if i in GGUF_NO_TOKEN:
            return None
        if i is not None and not 0 <= i < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key} = {i} is outside the vocabulary")
        return i

    named = {key: token_id(key) for key in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                            "padding_token_id", "eot_token_id", "eom_token_id")}
    # The file's ids are the truth: control and user-defined tokens (and the named ones, which
    # llama.cpp treats as control whatever their type) keep their text and id, and match whole.
    plain = {i for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)}
    plain |= {i for i in named.values() if i is not None}
    add_space_prefix = _typed(info, "ggml.add_space_prefix", bool, path)
    try:
        if model == "gpt2":
            backend = _byte_level_bpe(tokens, merges or [], plain)
        else:
            backend = _sentencepiece_bpe(tokens, merges, scores,
                                         True if add_space_prefix is None else add_space_prefix)
    except Exception as e:  # tokenizers raises plain Exceptions on bad vocabularies/merges
        raise ValueError(f"{path}: the GGUF tokenizer metadata is invalid: {e}") from None

    # Control tokens (<|im_start|>, <｜User｜>) are special: matched whole, skipped on request.
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == _CONTROL]
    if control:
        backend.add_special_tokens(control)
    # User-defined tokens (<think>) are matched whole too, but are ordinary text
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED]
    if user:
        backend.add_tokens(user)
    split = PRE_TOKENIZER_SPLITS.get(_typed(info, "ggml.pre", str, path))
    if split is not None and model == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def token(key):
        i = named[key]
        return None if i is None else tokens[i]

    specials = _Specials(bos=token("bos_token_id"), eos=token("eos_token_id"),
                         unk=token("unknown_token_id"), pad=token("padding_token_id"))
    _add_named_specials(backend, specials)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = _typed(info, "ggml.add_bos_token", bool, path)
    add_bos = model == "llama" if add_bos is None else add_bos
    add_eos = _typed(info, "ggml.add_eos_token", bool, path) or False
    backend.post_processor = _template_processing(specials, add_bos, add_eos, backend)
    # A token the vocabulary lacks would be appended past it, an id no embedding row holds
    # (two tokens of one spelling leave one of them unreachable, but inside the vocabulary).
    if backend.get_vocab_size(with_added_tokens=True) > len(tokens):
        past = sorted(t for t, i in backend.get_vocab(with_added_tokens=True).items() if i >= len(tokens))
        raise ValueError(f"{path}: tokens {past[:4]} would get ids past the {len(tokens)}-token "
                         "vocabulary")
    extra_eos = [i for k in ("eot_token_id", "eom_token_id") if (i := named[k]) is not None]
    return Tokenizer(backend, specials=specials, chat_template=_typed(info, "chat_template", str, path),
                     extra_eos_ids=extra_eos, name=str(path))


# --- building from a Hugging Face directory ----------------------------------------------------

def _token_content(value, what: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{what} is not a token (a string or an object with a \"content\" string): "
                     f"{value!r:.80}")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _present(path: Path) -> bool:
    """Whether the file is there; something else under its name (a directory) is refused, not
    passed over as if absent."""
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a file")
    return path.exists()


def _chat_template(directory: Path, config: dict) -> str | None:
    """`chat_template.jinja` wins over tokenizer_config's entry, as in transformers."""
    jinja_file = directory / "chat_template.jinja"
    if _present(jinja_file):
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{jinja_file}: cannot read: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: chat_template is a "
                         f"{type(template).__name__}, expected a string")
    return template


def _from_hf_directory(directory: Path) -> Tokenizer:
    files = {name: directory / name for name in ("tokenizer.json", "tokenizer_config.json")}
    missing = [str(p) for p in files.values() if not _present(p)]
    if missing:
        hint = (" (only a slow SentencePiece tokenizer.model is present; convert it with transformers' "
                "save_pretrained first)") if (directory / "tokenizer.model").is_file() else ""
        raise FileNotFoundError(f"{directory} is missing {', '.join(missing)}{hint}")
    try:
        backend = BackendTokenizer.from_file(str(files["tokenizer.json"]))
    except Exception as e:  # tokenizers raises a plain Exception on a malformed file
        raise ValueError(f"{files['tokenizer.json']}: cannot load: {e}") from None
    config = _read_json(files["tokenizer_config.json"])
    key = "extra_special_tokens" if "extra_special_tokens" in config else "additional_special_tokens"
    extra = config.get(key) or []
    if isinstance(extra, Mapping):  # v5 allows {name: token}
        extra = list(extra.values())
    if not isinstance(extra, list):  # as transformers; a string would make each letter a token
        raise ValueError(f"{files['tokenizer_config.json']}: {key} is a {type(extra).__name__}, "
                         f"expected a list or an object of tokens")

    def special(name, value):
        return _token_content(value, f"{files['tokenizer_config.json']}: {name}")

    specials = _Specials(bos=special("bos_token", config.get("bos_token")),
                         eos=special("eos_token", config.get("eos_token")),
                         unk=special("unk_token", config.get("unk_token")),
                         pad=special("pad_token", config.get("pad_token")),
                         extra=tuple(special(key, t) for t in extra))
    _add_named_specials(backend, specials)
    # With a tokenizer.json, transformers ignores tokenizer_config's add_bos/eos_token and keeps
    # the file's post-processor; only a missing one is rebuilt (adding nothing).
    if backend.post_processor is None:
        backend.post_processor = _template_processing(specials, False, False, backend)
    extra_eos = []
    for name in ("generation_config.json", "config.json"):
        if _present(directory / name):
            eos = _read_json(directory / name).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
            if not all(type(i) is int for i in eos):
                raise ValueError(f"{directory / name}: eos_token_id must be an int or a list of ints, "
                                 f"got {eos!r:.80}")
            extra_eos += eos
    return Tokenizer(backend, specials=specials, chat_template=_chat_template(directory, config),
                     extra_eos_ids=extra_eos, name=str(directory))


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of a model: None (the default model), a .gguf file, or an HF directory."""
    if path is None:
        path = default_model_path()
    path = Path(path)
    if path.is_dir():
        return _from_hf_directory(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_file() and path.name == "tokenizer.json":
        return _from_hf_directory(path.parent)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}")
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face tokenizer directory")


__all__ = ["ChatTemplateError", "END_OF_TURN_TOKENS", "TextStream", "Tokenizer", "load_tokenizer",
           "render_chat_template"]
