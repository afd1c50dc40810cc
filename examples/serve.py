"""The OpenAI-compatible server on the built-in default model, and the Engine it runs on.

    python examples/serve.py                  # serves on http://127.0.0.1:8000 (Ctrl-C stops)
    python examples/serve.py --engine-only    # the Engine alone: streams two requests, no HTTP

Builds the built-in default once (a small Kimi-style MoE target, a DFlash drafter and a tokenizer
under ~/.cache/ddtree_jax; a few minutes the first time), then serves it with DDTree (budget 32)
over 4 slots. Talk to it with any OpenAI client:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="default", prompt="A draft tree keeps", max_tokens=32, temperature=0)
    for chunk in client.completions.create(model="default", prompt="Speculative decoding", max_tokens=32,
                                           temperature=0.8, top_p=0.9, seed=1, stream=True):
        print(chunk.choices[0].text, end="", flush=True)

or ``curl -N http://127.0.0.1:8000/v1/completions -d '{"prompt": "A draft tree", "stream": true}'``;
``/metrics`` shows queue length, running requests, tokens/s, acceptance length, TTFT and
inter-token latency. The same server from the command line:
``python -m ddtree_jax serve --target DIR --drafter DIR --tokenizer tokenizer.json``.
"""

import sys

from tokenizers import Tokenizer

import ddtree_jax as dt
from ddtree_jax.default_model import make_default
from ddtree_jax.serving import Engine

path = make_default()
target = dt.load_target(f"{path}/target")
drafter = dt.load_drafter(f"{path}/drafter", target)
tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
eos = tokenizer.token_to_id("<|endoftext|>")
engine = Engine(target, drafter, method="ddtree", budget=32, slots=4, tokenizer=tokenizer, max_model_len=512,
                stop_token_ids=[eos])

if "--engine-only" in sys.argv:
    greedy = engine.submit(tokenizer.encode("A draft tree keeps").ids, max_tokens=32)
    sampled = engine.submit(tokenizer.encode("Speculative decoding").ids,
                            dt.SamplingParams(temperature=0.8, top_p=0.9, seed=1), max_tokens=32, stop=["."])
    engine.start()
    for chunk in greedy.stream():
        print(chunk.text, end="", flush=True)
    print()
    for r in (greedy.result(), sampled.result()):
        print(f"{r.finish_reason:>6} | rounds {r.rounds:2d} | tau {r.tau:.2f} | ttft {r.ttft:.3f}s | {r.text!r}")
    engine.stop()
else:
    from ddtree_jax.serving.server import serve

    engine.warmup()
    serve(engine, model_name="default", host="127.0.0.1", port=8000)
