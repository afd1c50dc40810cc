"""The OpenAI-compatible server on the built-in default model, and the Engine it runs on.

    python examples/serve.py                  # serves on http://127.0.0.1:8000 (Ctrl-C stops)
    python examples/serve.py --engine-only    # the Engine alone: streams two requests, no HTTP

Serves the shipped default pair (a Kimi-style MoE target and a DFlash drafter trained on the
Python standard library, with their tokenizer: ``ddtree_jax/default_pair``) with DDTree (budget
32) over 4 slots. Talk to it with any OpenAI client:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="default", prompt="def read_lines(path):\n", max_tokens=32, temperature=0)
    for chunk in client.completions.create(model="default", prompt="class Stack:\n", max_tokens=32,
                                           temperature=0.8, top_p=0.9, seed=1, stream=True):
        print(chunk.choices[0].text, end="", flush=True)

or ``curl -N http://127.0.0.1:8000/v1/completions -d '{"prompt": "import os\\n", "stream": true}'``;
``/metrics`` shows queue length, running requests, tokens/s, acceptance length, TTFT and
inter-token latency. The same server from the command line:
``python -m ddtree_jax serve --target DIR --drafter DIR --tokenizer tokenizer.json``.
"""

import sys

from tokenizers import Tokenizer

import ddtree_jax as dt
from ddtree_jax.default_model import SHIPPED_DIR
from ddtree_jax.serving import Engine, EngineConfig

path = SHIPPED_DIR
target = dt.load_target(f"{path}/target")
drafter = dt.load_drafter(f"{path}/drafter", target)
tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
eos = tokenizer.token_to_id("<|endoftext|>")
config = EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=32, stop_token_ids=[eos]), slots=4,
                      max_model_len=512)
engine = Engine(target, drafter, config, tokenizer=tokenizer)

if "--engine-only" in sys.argv:
    greedy = engine.submit(tokenizer.encode("def read_lines(path):\n").ids, max_tokens=32)
    sampled = engine.submit(tokenizer.encode("class Stack:\n").ids,
                            dt.SamplingParams(temperature=0.8, top_p=0.9, seed=1), max_tokens=32, stop=["\n\n"])
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
