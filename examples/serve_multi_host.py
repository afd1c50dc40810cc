"""Serve one model across several hosts: ``jax.distributed``, one process per host using all its GPUs.

    # the same command on every host, with its own --process-id (0 .. N-1); host 0 runs the server:
    python examples/serve_multi_host.py --coordinator HOST0:12355 --num-processes 2 --process-id 0 \\
        --target DIR --drafter DIR --tokenizer tokenizer.json [--mesh data=2,expert=8] [--host 0.0.0.0]

Mesh: one global mesh over every process's devices, hosts along the leading axis. Default
``data=<processes>,expert=<GPUs per host>``: each host decodes its own share of the slots (``data``
spans the hosts) with the routed experts split over its own GPUs, so the experts' token exchange stays
inside a host; ``--mesh expert=16`` (experts over all GPUs of both hosts) or
``--mesh data=2,expert=4,tensor=2`` work too. ``--slots`` must divide by the devices the slots
split over (data x expert: data-parallel attention, docs/sharding.md).

Requests enter on process 0 only (its HTTP server); before every engine step process 0 broadcasts
the new requests and cancellations to the others with
``jax.experimental.multihost_utils.broadcast_one_to_all`` (``ddtree_jax.serving.multihost``), and all
processes run the same step. Stopping process 0 (Ctrl-C) stops the others.
"""

import argparse

import jax

from ddtree_jax.serving.cli import add_arguments, build_engine

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--coordinator", required=True, help="host:port of process 0")
parser.add_argument("--num-processes", type=int, required=True)
parser.add_argument("--process-id", type=int, required=True)
add_arguments(parser)
parser.set_defaults(slots=32)
args = parser.parse_args()

jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
if not args.mesh:
    args.mesh = f"data={jax.process_count()},expert={jax.local_device_count()}"
print(f"[serve_multi_host] process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local "
      f"of {jax.device_count()} devices; mesh {args.mesh}", flush=True)

from ddtree_jax.serving.multihost import LockstepEngine  # noqa: E402
from ddtree_jax.serving.server import serve  # noqa: E402

engine, name, template, specials = build_engine(args, parser)
if not args.no_warmup:
    engine.warmup()  # every process compiles and runs the same warm-up step
driver = LockstepEngine(engine)
if jax.process_index() == 0:
    serve(driver, model_name=name, host=args.host, port=args.port, chat_template=template, specials=specials,
          log_level=args.log_level)
else:
    driver.run()
