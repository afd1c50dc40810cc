"""Stage 1: the data and the tokenizer. ``python -m ddtree_jax.training.tokenizer --out RUN``

Lists this interpreter's standard library (``ddtree_jax.training.data``), splits it by file,
trains a byte-level BPE on the training files with the ``tokenizers`` library (special tokens
``<|endoftext|>`` between files and ``<|mask|>`` for the drafter's block) and encodes both
splits. Writes into ``RUN``: ``tokenizer.json``, ``train_tokens.npy`` and
``heldout_tokens.npy`` (uint16 streams, files joined by ``<|endoftext|>``) and ``data.json``
(what was used: Python version, file list hash, split, token counts). Takes ~1 minute on the
whole library; ``--max-files`` takes an evenly spaced subset (smoke tests).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np

from ddtree_jax.training.data import is_heldout, list_stdlib, read_source, stdlib_manifest, stdlib_root, write_json

__all__ = ["EOS", "MASK", "build_tokenizer", "main", "prepare_data"]

EOS, MASK = "<|endoftext|>", "<|mask|>"


def build_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _encode_stream(tok, texts: list[str], eos: int) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.uint16)


def prepare_data(out: str, *, vocab_size: int = 4096, heldout_fraction: float = 0.05, max_files: int | None = None,
                 root: str | None = None, log=print) -> dict:
    """Writes tokenizer.json, the token streams and data.json into ``out``; returns data.json's dict."""
    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    root = root or stdlib_root()
    paths = list_stdlib(root)
    manifest = stdlib_manifest(paths, root)
    log(f"[data] {manifest['files']} stdlib files ({manifest['bytes'] / 1e6:.1f} MB) of Python {manifest['python']} "
        f"under {root}; sha256 {manifest['sha256'][:16]}...")
    if max_files is not None and max_files < len(paths):
        paths = [paths[i] for i in np.unique(np.linspace(0, len(paths) - 1, max_files).astype(int))]
        log(f"[data] using {len(paths)} evenly spaced files (--max-files)")
    heldout = [p for p in paths if is_heldout(p, heldout_fraction)]
    train = [p for p in paths if not is_heldout(p, heldout_fraction)]
    train_texts = [read_source(root, p) for p in train]
    heldout_texts = [read_source(root, p) for p in heldout]
    if vocab_size > 65535:
        raise ValueError("vocab_size must fit uint16 token streams (<= 65535)")
    tok = build_tokenizer(train_texts, vocab_size)
    tok_path = os.path.join(out, "tokenizer.json")
    tok.save(tok_path)
    eos = tok.token_to_id(EOS)
    streams = {"train": _encode_stream(tok, train_texts, eos), "heldout": _encode_stream(tok, heldout_texts, eos)}
    for name, s in streams.items():
        np.save(os.path.join(out, f"{name}_tokens.npy"), s)
    with open(tok_path, "rb") as f:
        tok_sha = hashlib.sha256(f.read()).hexdigest()
    info = dict(
        stdlib=manifest, used_files=len(paths), max_files=max_files, heldout_fraction=heldout_fraction,
        split_rule="sha256(path)[:8] as a fraction of 2**64 < heldout_fraction -> held out",
        train_files=len(train), heldout_files=len(heldout), heldout_paths=heldout,
        list_sha256=hashlib.sha256("\n".join(paths).encode()).hexdigest(),
        tokenizer=dict(file="tokenizer.json", sha256=tok_sha, vocab_size=tok.get_vocab_size(), eos=EOS,
                       eos_id=eos, mask=MASK, mask_id=tok.token_to_id(MASK), kind="byte-level BPE (tokenizers)"),
        tokens={name: int(len(s)) for name, s in streams.items()},
        bytes_per_token=round(sum(map(len, train_texts)) / max(1, len(streams["train"])), 3),
    )
    write_json(os.path.join(out, "data.json"), info)
    log(f"[data] {len(train)} train / {len(heldout)} held-out files -> {info['tokens']['train']:,} / "
        f"{info['tokens']['heldout']:,} tokens (vocabulary {info['tokenizer']['vocab_size']}, "
        f"{info['bytes_per_token']} bytes per token) in {time.perf_counter() - t0:.0f}s -> {out}")
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.training.tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run folder (created)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--max-files", type=int, default=None, help="an evenly spaced subset of the files (smoke)")
    args = p.parse_args(argv)
    prepare_data(args.out, vocab_size=args.vocab_size, heldout_fraction=args.heldout_fraction,
                 max_files=args.max_files)


if __name__ == "__main__":
    main()
