"""Serve a checkpoint on one GPU (no mesh: every weight and slot on the one device).

    python examples/serve_single_gpu.py --target DIR --drafter DIR --tokenizer tokenizer.json \\
        [--method ddtree --budget 64] [--slots 16] [--port 8000] [--dtype bfloat16]

Mesh: none. The weights load in the checkpoint's dtype (``--dtype`` overrides) onto the default
device; the engine's ``--slots`` requests decode together in each compiled round. Equivalent to
``python -m ddtree_jax serve ...`` with the same options; every option of that command works here
(``--help``). Listens on 127.0.0.1 unless ``--host 0.0.0.0`` is given.
"""

import argparse

from ddtree_jax.serving.cli import add_arguments, run_serve

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_arguments(parser)
parser.set_defaults(slots=16)
args = parser.parse_args()
args.mesh = ""  # one device
run_serve(args, parser)
