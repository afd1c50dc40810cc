"""The command line: checks before anything loads (as a subprocess, no model loaded), the made
default model (``default_dir``: tests/conftest.py, shared with the TPU kernel tests), generation and
statistics, the compilation cache."""

import argparse
import json
import os
import struct
import subprocess
import sys

import pytest

from ddtree_jax import _preflight as pf
from ddtree_jax import cli, compilation_cache, load_drafter, load_target
from ddtree_jax.training.recipe import default_configs, make_default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m ddtree_jax"


def test_default_artifacts_are_real_checkpoints(default_dir):
    for name in ("target/config.json", "target/model.safetensors", "drafter/config.json", "tokenizer.json", "COMPLETE"):
        assert os.path.exists(os.path.join(default_dir, name)), name
    cfg = json.load(open(os.path.join(default_dir, "target", "config.json")))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    target = load_target(os.path.join(default_dir, "target"))
    drafter = load_drafter(os.path.join(default_dir, "drafter"), target)
    assert drafter.config.block_size == 16 and target.config.vocab_size <= 300
    assert make_default(default_dir) == default_dir  # made once, reused
    training = json.load(open(os.path.join(default_dir, "generation_config.json")))["training"]
    for name in ("target", "drafter"):
        t = training[name]
        assert t["steps"] == 30 and t["final_loss"] < 0.7 * t["first_loss"], training


def test_generate_command_streams_text_and_reports_stats(default_dir, capsys):
    cli.main([
        "generate", "--target", f"{default_dir}/target", "--drafter", f"{default_dir}/drafter",
        "--tokenizer", default_dir, "--prompt", "A draft tree", "--method", "ddtree",  # a folder holding tokenizer.json
        "--budget", "8", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
        "--compilation-cache", "off",  # this process's JAX settings stay as the other tests expect
    ])
    out, err = capsys.readouterr()
    assert out.startswith("A draft tree") and len(out) > len("A draft tree\n") and out.endswith("\n")
    assert "request 0: " in err and "mean tau=" in err and "tokens (" not in err  # streamed, no progress lines
    assert "tree of 8 drafted nodes over a block of 15" in err and "compilation cache: off" in err


# ---- bad input: one line on stderr, exit status 2, nothing on stdout, JAX never imported ----------


def _write_model(folder, cfg: dict, weights=True) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if weights:  # an empty safetensors file (a header, no tensors): the checks read only the header
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", 2) + b"{}")
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Bare model folders: config.json files and empty weights files, no real checkpoint."""
    root = tmp_path_factory.mktemp("folders")
    tcfg, dcfg = default_configs(300, 1)
    pair = root / "pair"
    _write_model(pair / "target", tcfg.to_hf_dict())
    _write_model(pair / "drafter", dcfg.to_hf_dict())
    (pair / "tokenizer.json").write_text("{}")
    other = dict(dcfg.to_hf_dict(), num_target_layers=7)
    sharded = _write_model(root / "sharded", tcfg.to_hf_dict(), weights=False)
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}, f)
    badeos = _write_model(root / "badeos" / "target", tcfg.to_hf_dict())
    (root / "badeos" / "generation_config.json").write_text(json.dumps({"eos_token_id": 999}))
    truncated = _write_model(root / "truncated", tcfg.to_hf_dict(), weights=False)
    open(os.path.join(truncated, "model.safetensors"), "wb").close()
    (root / "empty").mkdir()
    (root / "notok").mkdir()
    (root / "afile").write_text("x")
    return dict(
        root=str(root), pair=str(pair), target=str(pair / "target"), drafter=str(pair / "drafter"),
        tok=str(pair / "tokenizer.json"), empty=str(root / "empty"), notok=str(root / "notok"),
        noweights=_write_model(root / "noweights", tcfg.to_hf_dict(), weights=False), sharded=sharded,
        other=_write_model(root / "other", other), truncated=truncated, badeos=badeos, afile=str(root / "afile"),
        missing=str(root / "missing"),
        llama=_write_model(root / "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
    )


def _run_cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "ddtree_jax", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)


GOOD = ["--target", "{target}", "--drafter", "{drafter}", "--tokenizer", "{tok}", "--prompt", "hi"]

# (argv with {folder} placeholders, strings the message must contain)
BAD_INPUTS = {
    "target without config.json": (["--target", "{empty}"], ["--target {empty}", "no config.json"]),
    "target is the parent folder": (["--target", "{pair}"], ["--target {pair}", "did you mean {target}?"]),
    "drafter given as target": (["--target", "{drafter}"],
                                ["--target {drafter}", "found a DFlash drafter", "expected a target"]),
    "target given as drafter": (["--drafter", "{target}"],
                                ["--drafter {target}", "found a DeepSeek-V3/Kimi target", "expected a DFlash drafter"]),
    "another architecture": (["--target", "{llama}"], ["--target {llama}", "LlamaForCausalLM", "expected a target"]),
    "missing drafter folder": (["--drafter", "{missing}"], ["--drafter {missing}", "no such folder"]),
    "target is a file": (["--target", "{afile}"], ["--target {afile}", "is a file"]),
    "missing weights": (["--target", "{noweights}"], ["--target {noweights}", "no weights"]),
    "missing weights shard": (["--target", "{sharded}"], ["--target {sharded}", "model-00001-of-00002.safetensors"]),
    "empty weights file": (["--target", "{truncated}"], ["--target {truncated}", "model.safetensors", "0 bytes"]),
    "drafter of another target": (["--drafter", "{other}"], ["--drafter {other}", "7 layers"]),
    "no drafter": (["--drafter", ""], ["--method: 'ddtree' needs a drafter"]),
    "budget 0": (["--budget", "0"], ["--budget", ">= 1"]),
    "max-new-tokens 0": (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    "sync-every 0": (["--sync-every", "0"], ["--sync-every", ">= 1"]),
    "budget not a number": (["--budget", "many"], ["--budget", "integer"]),
    "negative temperature": (["--temperature", "-1"], ["--temperature", ">= 0"]),
    "temperature nan": (["--temperature", "nan"], ["--temperature", "finite"]),
    "top-p above 1": (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    "top-p 0": (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    "negative top-k": (["--top-k", "-1"], ["--top-k", ">= 0"]),
    "min-p above 1": (["--min-p", "2"], ["--min-p", "[0, 1]"]),
    "seed too large": (["--seed", str(2**32)], ["--seed", "[0, 2**32)"]),
    "stop token outside the vocabulary": (["--stop-token-id", "300"],
                                          ["--stop-token-id: 300 is outside the vocabulary [0, 300)"]),
    "eos outside the vocabulary": (["--target", "{badeos}"], ["--target {badeos}", "eos_token_id 999", "[0, 300)"]),
    "tokenizer folder without tokenizer.json": (["--tokenizer", "{notok}"], ["--tokenizer {notok}", "is a folder"]),
    "missing tokenizer": (["--tokenizer", "{missing}"], ["--tokenizer {missing}", "no such file"]),
    "unknown method": (["--method", "beam"], ["--method", "invalid choice"]),
}


def _fill(items, folders):
    return [s.format(**folders) for s in items]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_generate_bad_input_is_one_line_before_anything_loads(case, folders):
    args, expected = BAD_INPUTS[case]
    argv = _fill(GOOD, folders)
    for flag, value in zip(args[::2], _fill(args[1::2], folders), strict=True):  # replace or add the option
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    if "" in argv:  # an empty value removes the option
        i = argv.index("")
        del argv[i - 1 : i + 1]
    _check_one_line_error(_run_cli(["generate", *argv]), f"{PROG} generate", _fill(expected, folders))


@pytest.mark.parametrize("argv,expected", [
    (["--budget", "0"], ["--budget", ">= 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--dir", "{afile}"], ["--dir {afile}", "is a file"]),
    (["--compilation-cache"], ["--compilation-cache", "expected one argument"]),
    (["--dir", "{empty}"], ["--dir {empty}", "holds no pair", "--retrain"]),
], ids=["budget 0", "max-new-tokens 0", "dir is a file", "cache flag without a value", "dir without a pair"])
def test_demo_bad_input_is_one_line_before_anything_loads(argv, expected, folders):
    _check_one_line_error(_run_cli(["demo", *_fill(argv, folders)]), f"{PROG} demo", _fill(expected, folders))


@pytest.mark.parametrize("argv,expected", [
    (["--slots", "0"], ["--slots: must be an integer >= 1, got 0"]),
    (["--budget", "0"], ["--budget: must be an integer >= 1, got 0"]),
    (["--max-model-len", "1"], ["--max-model-len:", ">= 2, got 1"]),
    (["--stop-token-id", "-1"], ["--stop-token-id", "-1"]),
    (["--drafter", ""], ["--method", "ddtree", "needs", "drafter"]),
    (["--switch-interval", "0"], ["--switch-interval", "must be a number > 0, got 0"]),
], ids=["slots 0", "budget 0", "max-model-len 1", "negative stop token", "no drafter", "switch interval 0"])
def test_serve_bad_settings_are_one_line_before_anything_loads(argv, expected, folders):
    """The serve command builds its EngineConfig from the options first (the checks of the
    Engine's own config)."""
    options = {"--target": folders["target"], "--drafter": folders["drafter"], "--tokenizer": folders["tok"],
               **dict(zip(argv[::2], argv[1::2], strict=True))}
    args = [a for flag, value in options.items() if value for a in (flag, value)]
    _check_one_line_error(_run_cli(["serve", *args]), f"{PROG} serve", expected)


def _check_one_line_error(proc: subprocess.CompletedProcess, prog: str, expected: list[str]) -> None:
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    message = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(message) == 1 and message[0].startswith(f"{prog}: error: "), message
    for s in expected:
        assert s in message[0], (s, message[0])
    assert "ddtree_jax.cli" in imported  # -X importtime did report the imports
    assert not [m for m in imported if m.split(".")[0] in ("jax", "flax", "tokenizers")], "imported before the checks"


def test_checkpoint_error_after_loading_is_one_line(default_dir, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "target"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(default_dir, "target", "config.json")).read())
    tensors = load_file(os.path.join(default_dir, "target", "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    argv = ["generate", "--target", str(broken), "--tokenizer", default_dir, "--prompt", "A draft tree", "--method",
            "ar", "--compilation-cache", "off"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.splitlines()[-1].startswith(f"{PROG} generate: error: --target {broken}: 1 tensor(s) missing")
    with pytest.raises(Exception, match="missing") as e:  # --debug: the traceback, from the loader
        cli.main(argv + ["--debug"])
    assert type(e.value).__name__ == "CheckpointError"


def test_preflight_ranges_agree_with_sampling_params():
    from ddtree_jax.sampling import SamplingParams

    values = ["-1", "-0.5", "0", "1e-9", "0.5", "1", "1.5", "2", "40"]
    checks = {"temperature": (pf.temperature, float), "top_p": (pf.top_p, float), "min_p": (pf.min_p, float),
              "top_k": (pf.top_k, int), "seed": (pf.seed, int)}
    for field, (check, kind) in checks.items():
        for text in values + ["4294967295", "4294967296"]:
            try:
                value = kind(text)
            except ValueError:
                continue
            try:
                SamplingParams(**{field: value})
                ok = True
            except ValueError:
                ok = False
            try:
                check(text)
                agrees = ok
            except argparse.ArgumentTypeError:
                agrees = not ok
            assert agrees, (field, text, ok)


def test_model_dir_checks_accept_real_folders(folders):
    assert pf.check_model_dir(folders["target"], "target")["model_type"] == "kimi_k2"
    assert pf.check_model_dir(folders["drafter"], "drafter")["architectures"] == ["DFlashDraftModel"]
    assert pf.resolve_tokenizer(folders["pair"]) == folders["tok"]
    pf.check_pair(pf.check_model_dir(folders["target"], "target"), pf.check_model_dir(folders["drafter"], "drafter"),
                  folders["target"], folders["drafter"])


def test_demo_summary_says_what_ran_and_why_cpu_is_not_faster(capsys):
    runs = [cli._Run("ddtree", cli._settings("ddtree", 32, 15), [[1]], 192, 76, 2.54, 26.8, 25.1, "compiled now"),
            cli._Run("dflash", cli._settings("dflash", 32, 15), [[1]], 192, 94, 2.04, 17.4, 16.2, "compiled now"),
            cli._Run("ar", cli._settings("ar", 32, 0), [[1]], 192, 192, 1.0, 12.4, 11.9, "from the cache")]
    cli._summary(runs, [[1], [2], [3]], 64, True)
    err = capsys.readouterr().err
    assert "tree of 32 drafted nodes over a block of 15" in err and "chain of the 15 drafted tokens" in err
    assert "one token per target pass" in err and "budget=0" not in err
    assert "76 target passes instead of 192: 60% of the target passes saved" in err
    assert "identical across ddtree / dflash / ar: True" in err
    assert "need an accelerator" in err and "bench/RESULTS.md" in err  # this machine is a CPU


# ---- the persistent compilation cache ------------------------------------------------------------


def test_compilation_cache_folder_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.resolve() == str(tmp_path / "ddtree_jax" / "jax_cache")
    monkeypatch.setenv(compilation_cache.ENV_VAR, str(tmp_path / "env"))
    assert compilation_cache.resolve() == str(tmp_path / "env")
    assert compilation_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")  # the flag wins
    assert compilation_cache.resolve("off") is None
    monkeypatch.setenv(compilation_cache.ENV_VAR, "off")
    assert compilation_cache.resolve() is None


_CACHE_PROBE = """
import sys, jax, jax.numpy as jnp
from ddtree_jax import compilation_cache
compilation_cache.enable(sys.argv[1])
with compilation_cache.CompileWatch() as w:
    jax.jit(lambda x: jnp.sin(x) * 2 + 1)(jnp.arange(7.0)).block_until_ready()
print(w.compiles, w.cache_hits)
"""


def test_compilation_cache_serves_a_second_process(tmp_path):
    """JAX's persistent cache works on this backend: a second process loads what the first compiled."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    (c1, h1), (c2, h2) = (map(int, r.stdout.split()) for r in runs)
    assert c1 >= 1 and h1 == 0 and c2 == c1 and h2 == c2, (c1, h1, c2, h2)


def test_serve_switch_interval_sets_the_processes_interval():
    """``serve --switch-interval MS`` sets the thread switch interval (in each of the server's
    processes: the first front end, the engine process and further front ends call this); without
    it the interpreter's own stays."""
    import argparse
    import sys

    from ddtree_jax.serving.cli import set_switch_interval

    before = sys.getswitchinterval()
    try:
        set_switch_interval(argparse.Namespace(switch_interval=None))
        assert sys.getswitchinterval() == before
        set_switch_interval(argparse.Namespace(switch_interval=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
