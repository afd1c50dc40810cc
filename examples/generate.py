"""The smallest complete research use of ddtree_jax.generate.

    python examples/generate.py

Builds the built-in default (a small Kimi-style MoE target, a DFlash drafter and a tokenizer,
trained and written once as HF checkpoints under ~/.cache/ddtree_jax), loads it like any checkpoint, and
decodes a mixed batch (one greedy request, one sampled with top-k + top-p) with DDTree, then
checks the greedy request against plain autoregressive decoding.
"""

import ddtree_jax as dt
from ddtree_jax.default_model import make_default
from tokenizers import Tokenizer

path = make_default()
target = dt.load_target(f"{path}/target")
drafter = dt.load_drafter(f"{path}/drafter", target)
tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")

prompts = [tokenizer.encode(p).ids for p in ["A draft tree keeps", "Mixture-of-experts models"]]
sampling = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)]

out = dt.generate(target, drafter, prompts, method="ddtree", budget=32, sampling=sampling, max_new_tokens=24)
for r in out.requests:
    print(f"{r.finish_reason:>6} | rounds {r.rounds:2d} | tau {r.tau:.2f} | {tokenizer.decode(r.tokens)!r}")

ar = dt.generate(target, None, prompts[:1], method="ar", max_new_tokens=24)
print("greedy DDTree == greedy autoregressive:", out.tokens[0] == ar.tokens[0])
