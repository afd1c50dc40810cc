"""The GPU training stages at tiny sizes on the CPU: data listing and split, tokenizer, sharded
state, one target and one drafter step lowering the loss, the loop's hooks and stops, resuming =
not stopping. The CPU recipe that uses the same pieces: tests/test_cli.py (``default_dir``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.compiled import CompiledFn
from ddtree_jax.models import DFlashDrafter, KimiForCausalLM
from ddtree_jax.training import data
from ddtree_jax.training.configs import SIZES, drafter_config, target_config
from ddtree_jax.training.drafter import drafter_batch, drafter_train_step, sample_anchors
from ddtree_jax.training.loop import train_steps
from ddtree_jax.training.optim import make_optimizer
from ddtree_jax.training.run import Clock
from ddtree_jax.training.state import load_state, save_state
from ddtree_jax.training.target import TRAINABLE, init_target, target_train_step, train_target_stage
from ddtree_jax.training.tokenizer import EOS, MASK, build_tokenizer, prepare_data

TINY = SIZES["tiny"]
TARGET_OPT = dict(lr=3e-3, total_steps=5, warmup=1)


def test_list_stdlib_filters_and_sorts(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/test/t.py", "tests/x.py", "site-packages/y.py", "pkg/__pycache__/c.py",
                "test_z.py", "idlelib/idle_test/w.py", "notes.txt", "z/test_dir/q.py"]:
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    assert data.list_stdlib(str(tmp_path)) == ["a.py", "pkg/b.py"]
    m1 = data.stdlib_manifest(["a.py", "pkg/b.py"], str(tmp_path))
    (tmp_path / "a.py").write_text("# changed\n")
    assert m1["files"] == 2 and data.stdlib_manifest(["a.py", "pkg/b.py"], str(tmp_path))["sha256"] != m1["sha256"]


def test_real_stdlib_listing_is_deterministic_and_split_disjoint():
    paths = data.list_stdlib()
    assert paths == data.list_stdlib() == sorted(paths) and len(paths) > 300
    assert not any(p.startswith("test/") or "/test/" in p or "site-packages" in p for p in paths)
    held = {p for p in paths if data.is_heldout(p, 0.05)}
    train = {p for p in paths if not data.is_heldout(p, 0.05)}
    assert not held & train and held | train == set(paths)
    assert 0.01 < len(held) / len(paths) < 0.12


def test_token_windows_depend_on_the_step_only():
    stream = np.arange(5000)
    w = data.TokenWindows(stream, 33, 4, seed=3)
    steps = [w.batch_at(s) for s in range(w.steps_per_epoch + 2)]  # crosses an epoch
    again = data.TokenWindows(stream, 33, 4, seed=3)
    assert all(np.array_equal(a, again.batch_at(s)) for s, a in enumerate(steps))
    epoch0 = np.concatenate([b[:, 0] for b in steps[: w.steps_per_epoch]])
    assert len(np.unique(epoch0)) == len(epoch0)  # no window twice within an epoch


def test_tokenizer_round_trips_code():
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.sep)\n"] * 5
    tok = build_tokenizer(texts, 300)
    code = "def g(y):\n\treturn [y, 'é', \"\\n\"]  # π\n"
    assert tok.decode(tok.encode(code).ids) == code
    assert tok.token_to_id(EOS) is not None and tok.token_to_id(MASK) is not None


def test_state_round_trip_in_shards(tmp_path):
    tree = {"a": jnp.arange(1500, dtype=jnp.float32), "b": [jnp.ones((40, 40), jnp.bfloat16), jnp.int32(7)]}
    save_state(str(tmp_path / "s"), {"t": tree}, {"step": 5}, max_shard_bytes=8000)
    assert len([f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors")]) >= 2
    zeros = jax.tree.map(jnp.zeros_like, tree)
    loaded, info = load_state(str(tmp_path / "s"), {"t": zeros})
    assert info["step"] == 5
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)),
                 loaded["t"], tree)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """Stage 1 on 40 stdlib files, vocabulary 300."""
    path = str(tmp_path_factory.mktemp("run"))
    prepare_data(path, vocab_size=300, max_files=40, log=lambda *_: None)
    return path


def _repeat_steps(step, n):
    return [float(step()) for _ in range(n)]


def test_target_step_lowers_the_loss(run_folder):
    model = init_target(target_config(TINY, 300))
    opt = make_optimizer(model, TRAINABLE, **TARGET_OPT)  # as in the resume test: one compilation serves both
    ids = jnp.asarray(np.load(os.path.join(run_folder, "train_tokens.npy"))[: 4 * 33].reshape(4, 33).astype(np.int32))
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias[...]
    step = CompiledFn(target_train_step, updates=(model, opt), compute_dtype=jnp.float32, bias_rate=1e-3)
    losses = _repeat_steps(lambda: step(ids), 6)
    assert losses[-1] < losses[0] - 0.3
    step.sync()  # the carried state back into the modules
    assert not np.array_equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias[...])  # balancing moved it
    assert int(opt.step[...]) == 6


def test_drafter_step_lowers_the_loss():
    tcfg = target_config(TINY, 300)
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(1), impl="reference")
    drafter = DFlashDrafter(drafter_config(TINY, tcfg, mask_token_id=1), rngs=nnx.Rngs(2))
    opt = make_optimizer(drafter, nnx.Param, lr=3e-3, total_steps=100, warmup=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, 300, (2, 40)), jnp.int32)
    anchors = jnp.asarray(sample_anchors(rng, np.array([8, 20]), 40, 3, 16))
    assert int(anchors.min()) >= 7 and int(anchors.max()) <= 40 - 16
    step = CompiledFn(drafter_train_step, updates=(drafter, opt), reads=(target,))
    losses = _repeat_steps(lambda: step(tokens, anchors), 6)
    assert losses[-1] < losses[0] - 0.3


def test_drafter_batch_depends_on_the_step_only():
    rng = np.random.default_rng(0)
    d = dict(tokens=rng.integers(0, 300, (10, 40)).astype(np.int32), prompt_len=np.array([8, 20] * 5, np.int32))
    kw = dict(seed=3, batch=4, anchors=5, block_size=16)
    tokens, anchors = drafter_batch(d, 7, **kw)
    assert tokens.shape == (4, 40) and anchors.shape == (4, 5)
    np.testing.assert_array_equal(drafter_batch(d, 7, **kw)[1], anchors)
    assert not np.array_equal(drafter_batch(d, 8, **kw)[1], anchors)
    plen = np.asarray([d["prompt_len"][np.flatnonzero((d["tokens"] == np.asarray(t)).all(1))[0]] for t in tokens])
    assert (np.asarray(anchors) >= plen[:, None] - 1).all() and (np.asarray(anchors) <= 40 - 16).all()


def test_train_steps_hooks_and_stops():
    losses = iter([5.0, 4.0, 3.0, 2.0, 1.0, float("nan")])
    calls, lines, records = [], [], []
    batch_of = lambda s: (s,)  # noqa: E731
    step = lambda s: (calls.append(("step", s)), next(losses))[1]  # noqa: E731
    evaluate = lambda: (calls.append(("eval", info["step"])), 0.0)[1]  # noqa: E731
    info = {"step": 0}
    out = train_steps("m", step, batch_of, info, steps=6, limit=5, log=lines.append, log_every=2,
                      record=records.append, evaluate=evaluate, eval_every=2)
    assert out == [5.0, 4.0, 3.0, 2.0, 1.0] and info["step"] == 5
    assert calls == [("step", 0), ("step", 1), ("eval", 2), ("step", 2), ("step", 3), ("eval", 4), ("step", 4)]
    assert [r["step"] for r in records] == [1, 2, 4, 5] and [r["train_loss"] for r in records] == [5.0, 4.0, 2.5, 1.0]
    assert lines[0].startswith("[m] step 1/6 loss 5.0000 (mean of 1)") and "(step 1 compiles)" in lines[0]
    with pytest.raises(SystemExit, match="loss is nan at step 6"):
        train_steps("m", step, batch_of, info, steps=6, log=lines.append)
    stopped = {"step": 2}
    assert train_steps("m", step, batch_of, stopped, steps=6, clock=Clock(1.0, reserve_s=60.0), log=lines.append) == []
    assert stopped["step"] == 2 and "stopping before the 1-minute limit at step 2" in lines[-1]


def test_target_resume_equals_uninterrupted_training(run_folder, tmp_path):
    import shutil

    kw = dict(size="tiny", steps=TARGET_OPT["total_steps"], lr=TARGET_OPT["lr"], warmup=TARGET_OPT["warmup"], batch=4,
              seq_len=32, eval_every=100, eval_windows=4, log=lambda *_: None)
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        for f in ("data.json", "train_tokens.npy", "heldout_tokens.npy"):
            shutil.copy(os.path.join(run_folder, f), tmp_path / name / f)
    train_target_stage(str(tmp_path / "a"), **kw)
    train_target_stage(str(tmp_path / "b"), max_steps_this_call=2, **kw)
    info = train_target_stage(str(tmp_path / "b"), **kw)
    assert info["step"] == kw["steps"]
    ref = init_target(target_config(TINY, 300))
    opt = make_optimizer(ref, TRAINABLE, **TARGET_OPT)
    states = [load_state(str(tmp_path / n / "target_state"), {"model": nnx.state(ref), "opt": nnx.state(opt)})[0]
              for n in ("a", "b")]
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7), *states)


def test_anchored_blocks_equal_one_block_at_a_time():
    """Training's many-anchors pass gives each block exactly the logits decoding's cache-free pass gives it."""
    tcfg = target_config(TINY, 300)
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(3), impl="reference")
    drafter = DFlashDrafter(drafter_config(TINY, tcfg, mask_token_id=1), rngs=nnx.Rngs(4))
    tokens = jnp.asarray(np.random.default_rng(1).integers(2, 300, (2, 30)), jnp.int32)
    hidden = nnx.jit(lambda t, x: jnp.concatenate(
        t.forward_uncached(x, hidden_layer_ids=drafter.config.target_layer_ids)[1], -1))(target, tokens)
    anchors = jnp.array([[9, 22], [22, 9]])  # two anchor positions: two shapes for the one-block calls
    many = nnx.jit(lambda d, t, h, x, a: d.anchored_blocks(t, h, x, a))(drafter, target, hidden, tokens, anchors)
    one_block = nnx.jit(lambda d, t, h, last: d(t, h, last))
    for a in (9, 22):
        one = one_block(drafter, target, hidden[:, :a], tokens[:, a])  # both rows, anchor a
        for b in range(2):
            j = int(np.flatnonzero(np.asarray(anchors[b]) == a)[0])
            np.testing.assert_allclose(np.asarray(many[b, j]), np.asarray(one[b]), atol=2e-5)
