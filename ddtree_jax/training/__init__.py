"""Training the target and drafter: the shipped pair's GPU stages and the small CPU recipe.

The GPU stages, resumable (one command each):

1. ``python -m ddtree_jax.training.tokenizer --out RUN``: the standard library's source as data
   (``data``), a byte-level BPE tokenizer, token streams and ``data.json``.
2. ``python -m ddtree_jax.training.target --out RUN --minutes 8``: the Kimi-style MoE target.
3. ``python -m ddtree_jax.training.drafter --out RUN --minutes 8``: the DFlash drafter against the
   frozen target, on the target's own continuations.
4. ``python -m ddtree_jax.training.export --out RUN --dest DIR``: bfloat16 HF checkpoints of both
   and the tokenizer, ready to ship.

Each training command stops before its ``--minutes`` and resumes where it stopped when run again.
``recipe.make_default`` is the same recipe at a small size on a built-in corpus, on the CPU
(``python -m ddtree_jax demo --retrain``). Shared by all: the optimiser and mixed precision
(``optim``), the loop (``loop``), the compiled step (``ddtree_jax.compiled``); the stages' run
folder and clock are in ``run``, their resumable state in ``state``, their sizes in ``configs``.
Importing this package imports nothing else.
"""
