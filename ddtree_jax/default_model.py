"""The built-in defaults the command line chooses between, and how to tell a finished one.

``SHIPPED_DIR`` (inside the package, ``ddtree_jax/default_pair/``) holds the default that the
command line, the examples and the serving bench load: a Kimi-style MoE target (16.0M parameters,
MLA + sigmoid group-routed experts with a shared expert) and a 2-layer DFlash drafter (2.9M),
trained on the Python standard library by the GPU stages of ``ddtree_jax.training``, as bfloat16
HF checkpoints (37.8 MB together) with their byte-level BPE ``tokenizer.json``, the data record
(``data.json``) and the training record (``training.json``). Its ``README.md`` says how it was
made and what it measures. Nothing is trained at first use.

``RECIPE_DIR`` is where the CPU recipe (``ddtree_jax.training.recipe.make_default``, ``python -m
ddtree_jax demo --retrain``) writes a small pair by default; ``is_complete`` tells whether a
folder holds a finished default. Nothing here imports JAX: the command line reads it before its
checks.
"""

from __future__ import annotations

import os

__all__ = ["CODE_PROMPTS", "CORPUS_PROMPTS", "RECIPE_DIR", "SHIPPED_DIR", "is_complete", "mark_complete"]

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_pair")
RECIPE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                          "ddtree_jax", "default-v2")
# Prompts each default knows what to do with: code for the shipped pair (it learned the standard
# library), the corpus's own sentences for the CPU recipe.
CODE_PROMPTS = (
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
)
CORPUS_PROMPTS = ("Speculative decoding lets", "A draft tree", "With sampling, every node")
_COMPLETE = "COMPLETE"


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a finished default: the shipped pair, or a folder the CPU recipe
    marked complete (``mark_complete``) after writing everything."""
    if os.path.abspath(path) == SHIPPED_DIR:
        return True
    return os.path.isfile(os.path.join(path, _COMPLETE))


def mark_complete(path: str) -> None:
    """Marks ``path`` as a finished default (the CPU recipe's last write)."""
    open(os.path.join(path, _COMPLETE), "w").close()
