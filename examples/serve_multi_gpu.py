"""Serve a checkpoint on all GPUs of one host (one process, one mesh over its devices).

    python examples/serve_multi_gpu.py --target DIR --drafter DIR --tokenizer tokenizer.json \\
        [--mesh expert=8] [--slots 32] [--port 8000]

Mesh: by default ``expert=<number of GPUs>``: the routed experts are split over every GPU (expert
parallelism) and so are the slots (data-parallel attention: each GPU holds and computes its own
slots; ``--slots`` must divide by the GPUs; ``--dp-attention off`` replicates them instead). Other
layouts: ``--mesh expert=4,tensor=2`` (experts over 4, the models' tensor-parallel dimensions over
2) or ``--mesh data=2,expert=4`` (slots over all 8, experts over the 4 of each data group); the
layouts: docs/sharding.md. Axes are named by ``ddtree_jax.serving.sharding``; one size may be
-1 ("the rest"). Listens on 127.0.0.1 unless ``--host 0.0.0.0`` is given.
"""

import argparse

import jax

from ddtree_jax.serving.cli import add_arguments, run_serve

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_arguments(parser)
parser.set_defaults(slots=32)
args = parser.parse_args()
if not args.mesh:
    args.mesh = f"expert={jax.local_device_count()}"
print(f"[serve_multi_gpu] {jax.local_device_count()} devices ({jax.devices()[0].platform}); mesh {args.mesh}")
run_serve(args, parser)
