"""The shipped default pair (``ddtree_jax/default_pair``): what it is, and that it decodes.

Checked: the files a loader needs, the 40 MB cap on the two checkpoints, bfloat16 weights (float32
routers), the records agree with the files (tokenizer hash, special-token ids, the drafter's mask
token and target layers), and on the CPU in float32 greedy DDTree and linear DFlash equal greedy
autoregressive decoding token for token on a code prompt while accepting more than one token per
target pass (the drafter was trained for this target).
"""

import hashlib
import json
import os

import jax.numpy as jnp
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

import ddtree_jax as dt
from ddtree_jax import _preflight as pf
from ddtree_jax.default_model import CODE_PROMPTS, SHIPPED_DIR, is_complete

CAP_BYTES = 40_000_000


def _load(name):
    with open(os.path.join(SHIPPED_DIR, name)) as f:
        return json.load(f)


def _weights(role):
    folder = os.path.join(SHIPPED_DIR, role)
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]


def test_shipped_pair_is_a_complete_checkpoint_pair_under_the_cap():
    assert is_complete(SHIPPED_DIR)
    target = pf.check_model_dir(os.path.join(SHIPPED_DIR, "target"), "target")
    drafter = pf.check_model_dir(os.path.join(SHIPPED_DIR, "drafter"), "drafter")
    pf.check_pair(target, drafter, "target", "drafter")
    assert target["model_type"] == "kimi_k2" and target["n_routed_experts"] == 16
    assert sum(os.path.getsize(f) for role in ("target", "drafter") for f in _weights(role)) <= CAP_BYTES
    for role in ("target", "drafter"):
        dtypes = {}
        for path in _weights(role):
            with safe_open(path, "np") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    dtypes[name] = f.get_slice(name).get_dtype()
        routers = {n for n in dtypes if n.endswith((".gate.weight", "e_score_correction_bias"))}
        assert {dtypes[n] for n in dtypes if n not in routers} == {"BF16"}, role
        assert all(dtypes[n] == "F32" for n in routers), role


def test_records_agree_with_the_files():
    data, gen = _load("data.json"), _load("generation_config.json")
    with open(os.path.join(SHIPPED_DIR, "tokenizer.json"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == data["tokenizer"]["sha256"]
    tok = Tokenizer.from_file(os.path.join(SHIPPED_DIR, "tokenizer.json"))
    assert tok.get_vocab_size() == data["tokenizer"]["vocab_size"] == _load("target/config.json")["vocab_size"]
    assert tok.token_to_id(data["tokenizer"]["eos"]) == gen["eos_token_id"] == data["tokenizer"]["eos_id"]
    drafter = _load("drafter/config.json")["dflash_config"]
    assert tok.token_to_id(data["tokenizer"]["mask"]) == drafter["mask_token_id"]
    training = _load("training.json")
    assert training["drafter"]["best_tau"] > 5 and training["target"]["best_heldout"] < 4


@pytest.fixture(scope="module")
def pair():
    target = dt.load_target(os.path.join(SHIPPED_DIR, "target"), dtype=jnp.float32)
    drafter = dt.load_drafter(os.path.join(SHIPPED_DIR, "drafter"), target)
    return target, drafter, Tokenizer.from_file(os.path.join(SHIPPED_DIR, "tokenizer.json"))


def test_shipped_pair_decodes_code_exactly_and_accepts_drafts(pair):
    target, drafter, tok = pair
    prompts = [tok.encode(CODE_PROMPTS[0]).ids]
    kw = dict(max_new_tokens=24, impl="reference")
    ar = dt.generate(target, None, prompts, method="ar", **kw)
    for method in ("ddtree", "dflash"):
        out = dt.generate(target, drafter, prompts, method=method, budget=16, **kw)
        assert out.tokens == ar.tokens, method
        assert out.mean_tau > 1.5, (method, out.mean_tau)  # a trained drafter: several tokens per pass
