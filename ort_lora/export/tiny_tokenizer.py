"""A byte-level tokenizer for tiny random checkpoints, so their exports run end to end
(text prompts, detokenization, chat templates) like a real model's.

Ids 0..2 are the special tokens <pad>, <s>, </s> (bos 1, eos 2, as tiny configs use); the
other ids are single bytes of the byte-level alphabet (the first vocab_size - 3 of them).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_byte_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write tokenizer.json + tokenizer_config.json with exactly vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - len(SPECIALS)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
