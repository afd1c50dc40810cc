"""Training the shipped target and drafter on a GPU, in resumable stages (one command each):

1. ``python -m ddtree_jax.training.tokenizer --out RUN``: the standard library's source as data
   (``data``), a byte-level BPE tokenizer, token streams and ``data.json``.
2. ``python -m ddtree_jax.training.target --out RUN --minutes 8``: the Kimi-style MoE target.
3. ``python -m ddtree_jax.training.drafter --out RUN --minutes 8``: the DFlash drafter against the
   frozen target, on the target's own continuations.
4. ``python -m ddtree_jax.training.export --out RUN --dest DIR``: bfloat16 HF checkpoints of both
   and the tokenizer, ready to ship.

Each training command stops before its ``--minutes`` and resumes where it stopped when run again.
``ddtree_jax.train`` keeps the small CPU recipe of the built-in default.
"""
