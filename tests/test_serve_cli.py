"""``serve``'s start-up checks, as subprocesses on tiny checkpoints written here: every bad option,
folder, config, weights file, tokenizer file, chat template and a taken port give one line on
stderr naming the option and the file, exit status 2, before JAX is imported (nothing loads)."""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from tests._serving_fixtures import write_tiny_checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Good tiny checkpoints and broken copies of them."""
    from ddtree_jax.checkpoints import save_checkpoint
    from tests._model_fixtures import tiny_kimi

    root = tmp_path_factory.mktemp("serve_cli")
    good = write_tiny_checkpoints(str(root / "good"))
    out = dict(good, missing=str(root / "missing"))

    def copy(name):
        shutil.copytree(good["target"], root / name)
        return root / name

    (copy("badcfg") / "config.json").write_text("{not json")
    out["badcfg"] = str(root / "badcfg")
    shard = copy("truncated") / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    out["truncated"] = str(root / "truncated")
    shard = copy("corrupt") / "model.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    shard.write_bytes(data[:8] + b"!" * n + data[8 + n :])
    out["corrupt"] = str(root / "corrupt")
    save_checkpoint(tiny_kimi(0), str(root / "sharded"), max_shard_bytes=40_000)
    weight_map = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    out["lost_shard"] = sorted(set(weight_map.values()))[1]
    (root / "sharded" / out["lost_shard"]).unlink()
    out["sharded"] = str(root / "sharded")
    (copy("badgen") / "generation_config.json").write_text("[")
    out["badgen"] = str(root / "badgen")
    (root / "tok").mkdir()
    shutil.copy(good["tokenizer"], root / "tok" / "tokenizer.json")
    (root / "tok" / "tokenizer_config.json").write_text("{'chat_template': 1}")
    out["badtokcfg"] = str(root / "tok")
    (root / "notatokenizer.json").write_text('{"hello": 1}')
    out["notatokenizer"] = str(root / "notatokenizer.json")
    (root / "template.jinja").write_text("{% for m in messages %}{{ m.content }")
    out["badtemplate"] = str(root / "template.jinja")
    return out


def _run(args: list[str], module: str = "ddtree_jax", timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu", DDTREE_JAX_COMPILATION_CACHE="off")
    return subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def _one_line_error(proc: subprocess.CompletedProcess, prog: str, expected: list[str], jax_free: bool = True) -> str:
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    message = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")
               and not line.startswith("[ddtree_jax.serve]")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(message) == 1 and message[0].startswith(f"{prog}: error: "), message
    for s in expected:
        assert s in message[0], (s, message[0])
    assert "ddtree_jax._preflight" in imported  # -X importtime did report the imports
    if jax_free:
        heavy = [m for m in imported if m.split(".")[0] in ("jax", "flax", "tokenizers")]
        assert not heavy, f"imported before the checks: {heavy[:5]}"
    return message[0]


GOOD = ["--target", "{target}", "--drafter", "{drafter}", "--tokenizer", "{tokenizer}", "--port", "0"]

BAD_INPUTS = {
    "missing target folder": (["--target", "{missing}"], ["--target {missing}", "no such folder"]),
    "config.json not JSON": (["--target", "{badcfg}"], ["--target {badcfg}", "config.json is not valid JSON"]),
    "truncated weights": (["--target", "{truncated}"], ["--target {truncated}", "model.safetensors", "truncated"]),
    "corrupt header": (["--target", "{corrupt}"], ["--target {corrupt}", "model.safetensors", "not valid JSON"]),
    "missing shard": (["--target", "{sharded}"], ["--target {sharded}", "{lost_shard}", "is missing"]),
    "generation_config.json not JSON": (["--target", "{badgen}"], ["--target {badgen}", "generation_config.json"]),
    "missing drafter folder": (["--drafter", "{missing}"], ["--drafter {missing}", "no such folder"]),
    "target given as drafter": (["--drafter", "{target}"], ["--drafter {target}", "expected a DFlash drafter"]),
    "no drafter": (["--drafter", ""], ["--method ddtree needs --drafter"]),
    "missing tokenizer": (["--tokenizer", "{missing}"], ["--tokenizer {missing}", "no such file"]),
    "tokenizer_config.json not JSON": (["--tokenizer", "{badtokcfg}"],
                                       ["--tokenizer {badtokcfg}", "tokenizer_config.json is not valid JSON"]),
    "chat template syntax": (["--chat-template", "{badtemplate}"], ["--chat-template {badtemplate}", "jinja2"]),
    "missing chat template": (["--chat-template", "{missing}"], ["--chat-template {missing}", "cannot read"]),
    "context beyond the target's": (["--max-model-len", "999"], ["--max-model-len 999", "[2, 256]"]),
    "stop token outside the vocabulary": (["--stop-token-id", "300"], ["--stop-token-id 300", "[0, 128)"]),
    "more alternatives than the vocabulary": (["--max-logprobs", "200"], ["--max-logprobs 200", "128 tokens"]),
    "bad mesh": (["--mesh", "bogus=2"], ["--mesh", "bogus=2"]),
    "slots that do not split over the mesh": (["--mesh", "data=2,expert=4", "--slots", "12"],
                                              ["--slots 12", "8 devices", "data=2, expert=4", "--dp-attention off"]),
    "empty API key": (["--api-key", ""], ["--api-key", "empty"]),
    "budget 0": (["--budget", "0"], ["--budget", ">= 1"]),
    "deterministic with a mesh": (["--deterministic", "on", "--mesh", "expert=2"],
                                  ["--deterministic on", "one device"]),
    "deterministic on the references": (["--deterministic", "on", "--impl", "reference"],
                                        ["--deterministic on", "Triton kernels"]),
    "port out of range": (["--port", "70000"], ["--port", "[0, 65535]"]),
    "negative drain timeout": (["--drain-timeout", "-1"], ["--drain-timeout", ">= 0"]),
    "body limit 0": (["--max-request-bytes", "0"], ["--max-request-bytes", ">= 1"]),
    "page size not a power of two": (["--page-size", "24"], ["--page-size", "power of two"]),
    "pool size without pages": (["--kv-cache-memory", "1GiB"], ["--kv-cache-memory", "needs --page-size"]),
    "pool size in no unit": (["--page-size", "16", "--kv-cache-memory", "3parsecs"],
                             ["--kv-cache-memory", "12GiB"]),
    "no front end": (["--api-servers", "0"], ["--api-servers 0", ">= 1"]),
}


def _argv(args, folders):
    argv = [s.format(**folders) for s in GOOD]
    for flag, value in zip(args[::2], [s.format(**folders) for s in args[1::2]], strict=True):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    if "" in argv and "--api-key" not in argv:  # an empty value removes the option
        i = argv.index("")
        del argv[i - 1 : i + 1]
    return argv


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_serve_bad_input_is_one_line_before_anything_loads(case, folders):
    args, expected = BAD_INPUTS[case]
    _one_line_error(_run(["serve", *_argv(args, folders)]), "python -m ddtree_jax serve",
                    [s.format(**folders) for s in expected])


def test_the_serving_module_runs_the_same_checks(folders):
    _one_line_error(_run(_argv(["--target", "{truncated}"], folders), module="ddtree_jax.serving.cli"),
                    "python -m ddtree_jax.serving.cli", [f"--target {folders['truncated']}", "truncated"])


def test_a_taken_port_is_one_line_before_anything_loads(folders):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _run(["serve", *_argv(["--port", str(port)], folders)], timeout=60)
    _one_line_error(proc, "python -m ddtree_jax serve", [f"--port {port}", f"127.0.0.1:{port} is in use"])


def test_a_file_that_is_not_a_tokenizer_is_one_line(folders):
    """Found when the tokenizer loads (after the port is bound, before the models)."""
    proc = _run(["serve", *_argv(["--tokenizer", "{notatokenizer}"], folders)])
    _one_line_error(proc, "python -m ddtree_jax serve", [f"--tokenizer {folders['notatokenizer']}",
                                                         "not a tokenizers JSON file"], jax_free=False)


@pytest.mark.parametrize("split", [[], ["--engine-process"]], ids=["one process", "engine process"])
def test_a_loading_error_is_one_line(folders, split):
    """Found once the models have loaded (``--deterministic on`` on a CPU with ``--impl auto``: no
    Triton kernels), in this process or in the engine process."""
    proc = _run(["serve", *_argv(["--deterministic", "on"], folders), "--no-warmup", *split])
    _one_line_error(proc, "python -m ddtree_jax serve", ["--deterministic on", "needs the Triton kernels"],
                    jax_free=False)


def test_restated_defaults_agree_with_the_server():
    from ddtree_jax.serving import cli, server

    assert cli.API_KEY_ENV == server.API_KEY_ENV
    assert cli.DEFAULT_MAX_REQUEST_BYTES == server.DEFAULT_MAX_REQUEST_BYTES
    assert cli.DEFAULT_DRAIN_TIMEOUT == server.DEFAULT_DRAIN_TIMEOUT
