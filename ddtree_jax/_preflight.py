"""Checks the command line runs before anything heavy loads (no JAX, no models, no tokenizer).

Everything here reads only option values, paths, JSON files and safetensors headers, so a mistake
costs a one-line message in well under a second instead of a traceback after the models load.

* ``positive_int``, ``budget`` (or ``auto``), ``nonnegative_int``, ``nonnegative_float``, ``port``, ``temperature``,
  ``top_p``, ``min_p``, ``seed``, ``memory_fraction``: argparse ``type=`` functions. The sampling ranges restate
  ``ddtree_jax.sampling.SamplingParams``, which stays authoritative (it checks again when the
  request is built; ``tests/test_cli.py`` checks that both agree).
* ``check_model_dir(path, role)``: a checkpoint folder for ``role`` ``"target"`` or ``"drafter"``
  (``config.json`` present and readable, the architecture of that role, weights present, every
  safetensors header readable and consistent with its file's size: ``ddtree_jax._safetensors``;
  ``weights=False``: the config alone).
* ``check_pair(target_cfg, drafter_cfg)``: the drafter was made for this target.
* ``resolve_tokenizer(path)``: a ``tokenizer.json`` file, or a folder holding one.
* ``option_error(e)``: a ``ddtree_jax.config.ConfigError`` (the settings the commands build from
  their options, checked by the same dataclasses as ``generate`` and the ``Engine``) as the option
  that set the value.
* ``eos_token_ids(target, vocab)``: the ``eos_token_id`` of ``generation_config.json`` in or beside
  the target folder, checked to be token ids of the vocabulary.
* ``check_json_object(path, option)``: an optional JSON file (e.g. ``tokenizer_config.json``) is an
  object.
* ``bind_port(host, port)``: the server's socket, bound (not listening) before anything loads.

Each failure raises ``PreflightError`` whose message names the option and the path or value.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import math
import os
import socket

from ddtree_jax._safetensors import SafetensorsError, read_header
from ddtree_jax.config import METHODS, ConfigError

__all__ = [
    "METHODS",
    "PreflightError",
    "bind_port",
    "check_json_object",
    "check_model_dir",
    "check_pair",
    "load_tokenizer",
    "eos_token_ids",
    "memory_fraction",
    "min_p",
    "nonnegative_float",
    "nonnegative_int",
    "option_error",
    "port",
    "positive_int",
    "budget",
    "resolve_tokenizer",
    "seed",
    "temperature",
    "top_k",
    "top_p",
]

TARGET_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
TARGET_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel",)
_EXPECTED = {"target": "a target (DeepseekV3ForCausalLM, model_type deepseek_v3 or kimi_k2)",
             "drafter": "a DFlash drafter (DFlashDraftModel)"}


class PreflightError(ValueError):
    """A bad option value, path or model folder; the message names the option."""


# config fields set by an option not named ``--<field with dashes>``
_OPTIONS = {"stop_token_ids": "--stop-token-id"}


def option_error(e: ConfigError) -> PreflightError:
    """``e`` with the option that set its field: ``--budget: must be an integer >= 1, got 0``."""
    return PreflightError(f"{_OPTIONS.get(e.field, '--' + e.field.replace('_', '-'))}: {e.message}")


# ---- argparse type= functions (argparse reports "argument --name: <message>") ---------------


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def positive_int_or_auto(text: str) -> int | str:
    """An integer >= 1, or ``auto`` (chosen by the runner: a DDTree budget per round, an engine
    dispatch's rounds)."""
    if text.strip().lower() == "auto":
        return "auto"
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text} (or auto)")
    return value


budget = positive_int_or_auto


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535] (0: any free port), got {text}")
    return value


def temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 = greedy), got {text}")
    return value


def top_k(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 = off), got {text}")
    return value


def top_p(text: str) -> float:
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = off), got {text}")
    return value


def min_p(text: str) -> float:
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 = off), got {text}")
    return value


def memory_fraction(text: str) -> float:
    """The share of a device's memory a capacity plan may fill, in (0, 1]."""
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_size(text: str) -> float | int:
    """A memory size: bytes with an optional unit (``12GiB``, ``500MB``, ``1e9``), or a number in
    (0, 1): that share of the device memory left free after loading (returned as a float)."""
    t = text.strip().lower().replace(" ", "")
    unit = t.lstrip("0123456789.e+-")
    number = t[: len(t) - len(unit)] if unit else t
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 12GiB, 500MB) or a share in (0, 1), got {text!r}")
    value = _float(number)
    if not unit and 0.0 < value < 1.0:
        return value
    if value * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, or a share in (0, 1), got {text!r}")
    return int(value * _UNITS[unit])


def seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text}")
    return value


# ---- model folders ----------------------------------------------------------------------------


def _describe(cfg: dict) -> str:
    archs = cfg.get("architectures")
    kind = _kind(cfg)
    found = {"target": "a DeepSeek-V3/Kimi target", "drafter": "a DFlash drafter"}.get(kind, "a model")
    return f"{found} (architectures {archs}, model_type {cfg.get('model_type')!r})"


def _kind(cfg: dict) -> str | None:
    """``"target"``, ``"drafter"`` or ``None`` (neither) for a parsed ``config.json``."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs:
        if any(a in TARGET_ARCHITECTURES for a in archs):
            return "target"
        if any(a in DRAFTER_ARCHITECTURES for a in archs):
            return "drafter"
        return None
    if cfg.get("model_type") in TARGET_MODEL_TYPES:
        return "target"
    if isinstance(cfg.get("dflash_config"), dict):
        return "drafter"
    return None


def _subfolders_with_config(path: str) -> list[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(os.path.join(path, n, "config.json"))]


def check_model_dir(path: str, role: str, option: str | None = None, *, weights: bool = True) -> dict:
    """Checks that ``path`` is a checkpoint folder of ``role`` (``"target"`` or ``"drafter"``);
    returns its parsed ``config.json``. Raises ``PreflightError`` naming ``option`` and ``path``.
    ``weights=False``: the folder's ``config.json`` alone is checked (the weights may be absent)."""
    if role not in _EXPECTED:
        raise ValueError(f"role must be 'target' or 'drafter', got {role!r}")
    where = f"{option or '--' + role} {path}"
    if not os.path.exists(path):
        raise PreflightError(f"{where}: no such folder")
    if os.path.isfile(path):
        hint = f"; did you mean {os.path.dirname(path) or '.'}?" if os.path.basename(path) == "config.json" else ""
        raise PreflightError(f"{where}: is a file; expected the checkpoint folder that holds config.json{hint}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        subs = _subfolders_with_config(path)
        if subs:
            kinds = {}
            for s in subs:
                try:
                    with open(os.path.join(path, s, "config.json")) as f:
                        kinds[s] = _kind(json.load(f))
                except (OSError, ValueError):
                    kinds[s] = None
            match = [s for s in subs if kinds[s] == role] or subs
            raise PreflightError(f"{where}: no config.json in this folder; did you mean "
                                 + " or ".join(os.path.join(path, s) for s in match) + "?")
        raise PreflightError(f"{where}: no config.json in this folder (expected an HF checkpoint folder: "
                             "config.json + *.safetensors)")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise PreflightError(f"{where}: cannot read config.json ({e})") from None
    except json.JSONDecodeError as e:
        raise PreflightError(f"{where}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PreflightError(f"{where}: config.json holds {type(cfg).__name__}, expected a JSON object")
    kind = _kind(cfg)
    if kind != role:
        raise PreflightError(f"{where}: found {_describe(cfg)}, expected {_EXPECTED[role]}")
    if role == "target" and cfg.get("model_type", "deepseek_v3") not in TARGET_MODEL_TYPES:
        raise PreflightError(f"{where}: model_type {cfg.get('model_type')!r} is not supported, expected "
                             f"{' or '.join(TARGET_MODEL_TYPES)}")
    if weights:
        _check_weights(path, where)
    return cfg


def _check_weights(path: str, where: str) -> None:
    """The weights ``model.safetensors.index.json`` names (or the folder's ``*.safetensors``) are
    present, each with a readable header."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PreflightError(f"{where}: cannot read model.safetensors.index.json ({e!r})") from None
        absent = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if absent:
            more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
            raise PreflightError(f"{where}: weights file {absent[0]}{more} named by model.safetensors.index.json "
                                 "is missing")
    else:
        shards = sorted(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not shards:
            raise PreflightError(f"{where}: no weights (no *.safetensors file and no model.safetensors.index.json)")
    for name in shards:
        _check_safetensors_header(os.path.join(path, name), where)


def _check_safetensors_header(file: str, where: str) -> None:
    """The file's safetensors header is readable and fits the file (catches empty, truncated and
    corrupt files; ``ddtree_jax._safetensors.read_header``)."""
    try:
        read_header(file)
    except SafetensorsError as e:
        raise PreflightError(f"{where}: {os.path.basename(file)}: {e.problem}") from None


def _drafter_field(cfg: dict, name: str):
    extra = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    return extra.get(name, cfg.get(name))


def check_pair(target_cfg: dict, drafter_cfg: dict, target_path: str, drafter_path: str) -> None:
    """Checks that the drafter was made for this target (what ``load_drafter`` checks, up front)."""
    layers, hidden = target_cfg.get("num_hidden_layers"), target_cfg.get("hidden_size")
    n = _drafter_field(drafter_cfg, "num_target_layers")
    if n is not None and layers is not None and n != layers:
        raise PreflightError(f"--drafter {drafter_path}: made for a target of {n} layers, but --target "
                             f"{target_path} has {layers}")
    h = drafter_cfg.get("hidden_size")
    if h is not None and hidden is not None and h != hidden:
        raise PreflightError(f"--drafter {drafter_path}: hidden_size {h} differs from --target {target_path}'s "
                             f"{hidden}")
    mask, vocab = _drafter_field(drafter_cfg, "mask_token_id"), target_cfg.get("vocab_size")
    if isinstance(mask, int) and isinstance(vocab, int) and not 0 <= mask < vocab:
        raise PreflightError(f"--drafter {drafter_path}: mask_token_id {mask} is outside --target {target_path}'s "
                             f"vocabulary [0, {vocab})")


def resolve_tokenizer(path: str) -> str:
    """The ``tokenizer.json`` to load: ``path`` itself, or ``path/tokenizer.json`` for a folder."""
    if os.path.isdir(path):
        inside = os.path.join(path, "tokenizer.json")
        if os.path.isfile(inside):
            return inside
        raise PreflightError(f"--tokenizer {path}: is a folder without tokenizer.json; expected a tokenizer.json "
                             "file (or a folder that holds one)")
    if not os.path.exists(path):
        raise PreflightError(f"--tokenizer {path}: no such file")
    return path


def eos_token_ids(target: str, vocab: int | None, option: str = "--target") -> list[int] | None:
    """The ``eos_token_id`` (one id or a list) of ``generation_config.json`` in the folder ``target``,
    else beside it; ``None`` when neither file names one. Raises ``PreflightError`` for a file
    that is not a JSON object or an id outside ``[0, vocab)``."""
    for folder in (target, os.path.dirname(os.path.abspath(target))):
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            continue
        cfg = check_json_object(path, f"{option} {target}")
        eos = cfg.get("eos_token_id")
        if eos is None:
            return None
        eos = eos if isinstance(eos, list) else [eos]
        bad = [e for e in eos if type(e) is not int or (isinstance(vocab, int) and not 0 <= e < vocab)]
        if bad:
            raise PreflightError(f"{option} {target}: eos_token_id {bad[0]!r} in {path} is not a token id of its "
                                 f"vocabulary [0, {vocab}) (--ignore-eos skips it)")
        return sorted(set(eos))
    return None


def check_json_object(path: str, where: str) -> dict:
    """The JSON object in the file at ``path``; ``PreflightError`` (prefixed ``where``) otherwise."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise PreflightError(f"{where}: cannot read {path} ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PreflightError(f"{where}: {path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise PreflightError(f"{where}: {path} holds a JSON {type(value).__name__}, expected an object")
    return value


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not yet listening (connections are refused until the
    server starts on it), so a taken port is found before anything loads. ``SO_REUSEADDR`` lets a
    restart take the port of a server that just exited, never one that is listening. Raises
    ``PreflightError`` naming ``--host``/``--port``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise PreflightError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        taken = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror or e})"
        raise PreflightError(f"--port {port}: {host}:{port} {taken}") from None
    return sock


def load_tokenizer(path: str, debug: bool):
    """The ``tokenizers.Tokenizer`` in ``path``; a file it cannot read raises ``PreflightError``
    naming ``--tokenizer`` (``debug``: the library's own error)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        if debug:
            raise
        raise PreflightError(f"--tokenizer {path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
