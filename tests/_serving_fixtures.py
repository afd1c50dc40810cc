"""Shared pieces of the serving tests: a character-level tokenizer over the tiny models' 128-token
vocabulary (built in milliseconds) and tiny checkpoints with it, as the server loads them."""

from __future__ import annotations

import json
import os

VOCAB = 128
EOS, MASK = "<|endoftext|>", "<|mask|>"
_PAIRS = ("th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed", "is",
          "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le")
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer():
    """Id 0 = EOS, then printable ASCII and newline one character each, two-letter tokens (decoded,
    never produced by encoding), and id 127 = the drafters' mask token."""
    from tokenizers import Tokenizer, decoders, models

    pieces = [EOS] + [chr(c) for c in range(32, 127)] + ["\n"] + list(_PAIRS)
    assert len(pieces) == VOCAB - 1, len(pieces)
    vocab = {p: i for i, p in enumerate(pieces + [MASK])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS, MASK])
    return tok


def write_tiny_checkpoints(path: str, *, chat_template: bool = True) -> dict[str, str]:
    """Tiny random target + drafter checkpoints, ``tokenizer.json`` (+ ``tokenizer_config.json``
    with a chat template) under ``path``; returns their paths."""
    from ddtree_jax.checkpoints import save_checkpoint
    from tests._model_fixtures import tiny_dflash, tiny_kimi

    target = tiny_kimi(0)
    save_checkpoint(target, os.path.join(path, "target"))
    save_checkpoint(tiny_dflash(target, 1), os.path.join(path, "drafter"))
    char_tokenizer().save(os.path.join(path, "tokenizer.json"))
    if chat_template:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": EOS}, f)
    return dict(target=os.path.join(path, "target"), drafter=os.path.join(path, "drafter"),
                tokenizer=os.path.join(path, "tokenizer.json"))
