"""The smallest complete research use of ddtree_jax.generate.

    python examples/generate.py

Loads the shipped default pair (a Kimi-style MoE target and a DFlash drafter trained on the
Python standard library, with their tokenizer: ``ddtree_jax/default_pair``) like any checkpoint,
and decodes a mixed batch of code prompts (one greedy request, one sampled with top-k + top-p)
with DDTree, then checks the greedy request against plain autoregressive decoding. Float32 on
the CPU, so the greedy check is exact. Progress goes to stderr; compiled programs persist in
JAX's compilation cache (``DDTREE_JAX_COMPILATION_CACHE``, ``off`` disables), so a second run
skips most compilation.
"""

import sys
import time

import jax.numpy as jnp
from tokenizers import Tokenizer

import ddtree_jax as dt
from ddtree_jax import compilation_cache
from ddtree_jax.default_model import SHIPPED_DIR


def log(msg):
    print(msg, file=sys.stderr, flush=True)


cache = compilation_cache.enable(compilation_cache.resolve())
log(f"[example] compilation cache: {cache or 'off'}")
path = SHIPPED_DIR
target = dt.load_target(f"{path}/target", dtype=jnp.float32)
drafter = dt.load_drafter(f"{path}/drafter", target)
tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")

prompts = [tokenizer.encode(p).ids for p in ["def read_lines(path):\n    with open(path) as f:\n",
                                             "class Point:\n    def __init__(self, x, y):\n"]]
sampling = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)]


def progress(name, max_new):
    """An ``on_progress`` callback: called after each host sync with (tokens [B, max_new], generated [B])."""
    t0 = time.perf_counter()
    log(f"[example] {name}: compiling on first use (or loading from the compilation cache), then decoding ...")
    return lambda tokens, generated: log(
        f"[example] {name}: {int(generated.sum())}/{len(generated) * max_new} tokens ({time.perf_counter() - t0:.0f}s)")


with compilation_cache.CompileWatch(log=log, prefix="[example]   "):  # announces compilations longer than 3 s
    out = dt.generate(target, drafter, prompts, method="ddtree", budget=32, sampling=sampling, max_new_tokens=24,
                      on_progress=progress("ddtree, budget 32", 24))
    ar = dt.generate(target, None, prompts[:1], method="ar", max_new_tokens=24,
                     on_progress=progress("autoregressive", 24))
for r in out.requests:
    print(f"{r.finish_reason:>6} | rounds {r.rounds:2d} | tau {r.tau:.2f} | {tokenizer.decode(r.tokens)!r}")
print("greedy DDTree == greedy autoregressive:", out.tokens[0] == ar.tokens[0])
