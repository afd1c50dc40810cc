"""The command line on a freshly made default model: tokenizer, checkpoints, generation, stats."""

import json
import os

import pytest

from ddtree_jax import cli, load_drafter, load_target
from ddtree_jax.default_model import make_default


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    # Short training (the demo trains longer): enough to check that both losses fall.
    return make_default(str(tmp_path_factory.mktemp("default")), vocab_size=300, target_steps=30, drafter_steps=30,
                        drafter_contexts=(8,))


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
        assert training[name]["steps"] == 30 and training[name]["last_loss"] < 0.7 * training[name]["first_loss"], training


def test_generate_command_streams_text_and_reports_stats(default_dir, capsys):
    cli.main([
        "generate", "--target", f"{default_dir}/target", "--drafter", f"{default_dir}/drafter",
        "--tokenizer", f"{default_dir}/tokenizer.json", "--prompt", "A draft tree", "--method", "ddtree",
        "--budget", "8", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
    ])
    out, err = capsys.readouterr()
    assert out.startswith("A draft tree") and len(out) > len("A draft tree\n")
    assert "request 0: " in err and "mean tau=" in err and "generated" not in err  # streamed, not a progress line


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "ddtree"], "needs --drafter"),
        (["--method", "ar", "--top-p", "1.5"], "SamplingParams.top_p"),
    ],
)
def test_generate_command_errors(default_dir, argv, message, capsys):
    base = ["generate", "--target", f"{default_dir}/target", "--tokenizer", f"{default_dir}/tokenizer.json", "--prompt", "x"]
    with pytest.raises(SystemExit) as e:
        cli.main(base + argv)
    assert message in str(e.value) or message in capsys.readouterr().err
