"""Every parser of untrusted JSON metadata refuses hostile documents with its documented
error: KV dumps (ExtractionError), codec container headers and kvtc calibration artifacts
(CodecError), store manifests (a miss with the reason / StoreError), store-protocol frames
(ProtocolError), the vLLM connector's local manifests and prefix-index records (a miss),
calibration index files (ExtractionError), window layout tags (ValueError) and the LMCache
server's adapter options (ValueError).

Each parser gets the same families of input: nesting far past any bound (200k levels of
lists, of objects, of both), nesting just past the parser's own bound, documents over the
size bound, and well-formed JSON of the wrong types. A raw RecursionError, TypeError,
KeyError or AttributeError from any of them fails the test.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from cachegen_common.bounded_json import JsonBoundsError, int_list, nesting_depth, parse
from tests.helpers.kv import make_kv

DEEP = 200_000


def _deep_lists(n: int) -> str:
    return "[" * n + "]" * n


def _deep_objects(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


def _deep_mixed(n: int) -> str:
    return '[{"a":' * (n // 2) + "1" + "}]" * (n // 2)


DEEP_DOCS = {"lists": _deep_lists(DEEP), "objects": _deep_objects(DEEP), "mixed": _deep_mixed(DEEP),
             "unclosed": "[" * DEEP, "in_a_valid_object": '{"ok": 1, "x": ' + _deep_lists(DEEP) + "}"}


# --------------------------------------------------------------------------- the bounded parser

def test_nesting_depth_counts_brackets_outside_strings():
    assert nesting_depth("1") == 0 and nesting_depth("[]") == 1 and nesting_depth('{"a": [[1]]}') == 3
    assert nesting_depth('["[[[[", "{{{"]') == 1                 # brackets inside strings are text
    assert nesting_depth(r'["\"[[[", 1]') == 1                   # an escaped quote does not end a string
    assert nesting_depth(_deep_lists(DEEP), stop_above=32) == 33   # stops early


@pytest.mark.parametrize("name", sorted(DEEP_DOCS))
def test_parse_refuses_deep_documents(name):
    with pytest.raises(JsonBoundsError, match="nested more than 32 levels"):
        parse(DEEP_DOCS[name], what="doc", max_bytes=1 << 24)
    with pytest.raises(JsonBoundsError, match="nested more than 32 levels"):
        parse(DEEP_DOCS[name].encode(), what="doc", max_bytes=1 << 24)


def test_parse_bounds_are_exact():
    assert parse(_deep_lists(5), what="d", max_bytes=10, max_depth=5) == [[[[[]]]]]
    with pytest.raises(JsonBoundsError, match="nested more than 4"):
        parse(_deep_lists(5), what="d", max_bytes=10, max_depth=4)
    assert parse(b"[1,1,1,11]", what="d", max_bytes=10) == [1, 1, 1, 11]
    with pytest.raises(JsonBoundsError, match="11 bytes, over the 10-byte limit"):
        parse(b"[1,1,1,111]", what="d", max_bytes=10)
    # a str is measured in UTF-8 bytes: 4 characters of 3 bytes each are 14 bytes with quotes
    with pytest.raises(JsonBoundsError, match="over the 13-byte limit"):
        parse('"€€€€"', what="d", max_bytes=13)
    assert parse('"€€€€"', what="d", max_bytes=14) == "€€€€"


@pytest.mark.parametrize("doc,why", [
    (b"\xff[1]", "not UTF-8"), ("[1,", "not valid JSON"), ("NaN", "not valid JSON"),
    ("[Infinity]", "not valid JSON"), ("", "not valid JSON"), ('{"a":1} x', "not valid JSON"),
])
def test_parse_refuses_malformed(doc, why):
    with pytest.raises(JsonBoundsError, match=why):
        parse(doc, what="d", max_bytes=100)


def test_parse_checks_the_top_level_type_and_raises_the_callers_error():
    class MyError(ValueError):
        pass

    with pytest.raises(MyError, match="d: expected a JSON object, got array"):
        parse("[1]", what="d", max_bytes=100, expect=dict, error=MyError)
    with pytest.raises(MyError, match="expected JSON bytes or str, got int"):
        parse(5, what="d", max_bytes=100, error=MyError)
    assert parse(b'{"a": [1]}', what="d", max_bytes=100, expect=dict, error=MyError) == {"a": [1]}


@pytest.mark.parametrize("value,why", [
    ({"a": 1}, "got object"), ("1,2", "got string"), ([[1]], "entry 0 is a JSON array"),
    ([1, "2"], "entry 1 is a JSON string"), ([1, 2.0], "entry 1 is a JSON number"),
    ([True], "entry 0 is a JSON boolean"), ([None], "entry 0 is a JSON null"),
    ([-1], r"outside \[0,"), ([2**31], r"outside \[0,"), (list(range(11)), "11 entries, over the limit of 10"),
])
def test_int_list_refuses_wrong_types(value, why):
    with pytest.raises(JsonBoundsError, match=why):
        int_list(value, what="ids", max_len=10)
    assert int_list([0, 5, 2**31 - 1], what="ids", max_len=3) == [0, 5, 2**31 - 1]


# --------------------------------------------------------------------------- KV dumps

@pytest.fixture
def dump(tmp_path):
    from kv_extraction_hf.dump import save_kv

    k, v = make_kv(2, 6, 1, 4)
    path = save_kv(tmp_path / "good.safetensors", k, v, {"token_ids": [1, 2, 3, 4, 5, 6], "question_ids": [7, 8],
                                                          "answers": ["x"]})
    return path, k, v


def _rewrite(path, field, text):
    """A copy of the dump at path with metadata ``field`` replaced by ``text`` (the other
    fields, hashes included, kept: the hostile field is what a reader meets first)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata())
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    meta[field] = text
    out = path.with_name(f"hostile-{field}.safetensors")
    save_file(tensors, str(out), metadata=meta)
    return out


HOSTILE_IDS = {
    **{f"deep_{k}": v for k, v in DEEP_DOCS.items()},
    "deep_just_past": _deep_lists(2) .replace("[]", "[1]"),  # [[1]]: a nested list is not token ids
    "huge": "[" + ",".join(["1"] * 200_000) + "]",             # far more ids than the KV's 6 tokens
    "huge_spaces": "[1" + " " * 2_000_000 + "]",            # over every list field's size bound
    "object": '{"0": 1}', "string": '"1,2,3"', "null": "null", "number": "6",
    "strings": '["1","2","3","4","5","6"]', "floats": "[1.0,2,3,4,5,6]", "bools": "[true,2,3,4,5,6]",
    "negative": "[-1,2,3,4,5,6]", "too_big": "[4294967296,2,3,4,5,6]", "nan": "[NaN,2,3,4,5,6]",
    "not_json": "[1,2,3", "empty": "",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_IDS))
@pytest.mark.parametrize("verify", [True, False])
def test_load_kv_refuses_hostile_token_ids(dump, name, verify):
    from kv_extraction_hf.dump import load_kv
    from kv_extraction_hf.errors import ExtractionError

    path = _rewrite(dump[0], "token_ids", HOSTILE_IDS[name])
    with pytest.raises(ExtractionError, match="corrupt KV dump .*token_ids") as info:
        load_kv(path, verify=verify)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("name", sorted(HOSTILE_IDS))
def test_dump_side_fields_refuse_hostile_values(dump, name):
    from kv_extraction_hf.dump import load_kv, metadata_ids, metadata_strings
    from kv_extraction_hf.errors import ExtractionError

    path = _rewrite(dump[0], "question_ids", HOSTILE_IDS[name])
    _, _, meta = load_kv(path)          # question_ids is not checked by load_kv ...
    if name not in ("huge",):           # ... a long but flat id list is a valid question
        with pytest.raises(ExtractionError, match="question_ids"):
            metadata_ids(meta, "question_ids", path)
    meta["answers"] = HOSTILE_IDS[name]
    if name != "strings":               # a list of strings is what answers hold
        with pytest.raises(ExtractionError, match="answers"):
            metadata_strings(meta, "answers", path)


def test_dump_fields_accept_their_own_values(dump):
    from kv_extraction_hf.dump import load_kv, metadata_ids, metadata_strings

    _, _, meta = load_kv(dump[0])
    assert metadata_ids(meta, "token_ids", dump[0], max_len=6) == [1, 2, 3, 4, 5, 6]
    assert metadata_ids(meta, "question_ids") == [7, 8] and metadata_ids(meta, "missing") is None
    assert metadata_strings(meta, "answers") == ["x"] and metadata_strings(meta, "missing") == []


def test_save_kv_refuses_token_ids_that_are_not_a_flat_int_list(tmp_path):
    from kv_extraction_hf.dump import save_kv
    from kv_extraction_hf.errors import ExtractionError

    k = torch.zeros(1, 2, 1, 4)
    for bad in ([[1], [2]], ["a", "b"], _deep_lists(DEEP)):
        with pytest.raises(ExtractionError, match="token_ids"):
            save_kv(tmp_path / "x.safetensors", k, k, {"token_ids": bad})
    assert not list(tmp_path.iterdir())      # nothing half-written


# --------------------------------------------------------------------------- codec container headers

def _container_with_header(hdr: bytes) -> bytes:
    from codec.bitstream import FORMAT_VERSION, MAGIC

    return MAGIC + struct.pack("<HHI", FORMAT_VERSION, 0, len(hdr)) + hdr + b"\0" * 16


@pytest.mark.parametrize("doc", [
    *DEEP_DOCS.values(), _deep_lists(33), '{"codec": ' + _deep_objects(40) + "}",
    "[1]", '"x"', "null", '{"codec": NaN}', '{"a": 1, "a": 2}',
])
def test_container_header_refuses_hostile_json(doc):
    import codec
    from codec.bitstream import peek_header

    data = _container_with_header(doc.encode()[: (1 << 20)])
    for read in (peek_header, codec.decode_kv):
        with pytest.raises(codec.CodecError):
            read(data)


def test_container_header_over_its_size_bound_is_refused_before_reading():
    import codec
    from codec.bitstream import MAX_HEADER_BYTES, MAGIC, FORMAT_VERSION

    data = MAGIC + struct.pack("<HHI", FORMAT_VERSION, 0, MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(codec.CodecError, match="exceeds"):
        codec.decode_kv(data)


# --------------------------------------------------------------------------- window layout tags

@pytest.mark.parametrize("body", [*DEEP_DOCS.values(), '{"windows": ' + _deep_lists(5000) + ', "extra_tokens": 0}',
                                  '{"windows": 1, "extra_tokens": 0}', '{"windows": [], "extra_tokens": "0"}',
                                  "[]", '{"windows": [' + "16," * 40_000 + '16], "extra_tokens": 0}'])
def test_window_layout_tag_refuses_hostile_json(body):
    from codec.window.layout import WINDOW_VERSION, parse_layout_tag

    with pytest.raises(ValueError, match="window layout tag"):
        parse_layout_tag(f"window/{WINDOW_VERSION}:{body}")


# --------------------------------------------------------------------------- kvtc calibration artifacts

@pytest.mark.parametrize("info", [*DEEP_DOCS.values(), '{"format": "kvtc-calibration", "meta": '
                                  + _deep_objects(500) + "}", "[1]", '"x"', "7",
                                  '{"format": "kvtc-calibration", "version": 1, "num_layers": [1]}',
                                  "[" + "1," * 600_000 + "1]"])
def test_kvtc_calibration_refuses_hostile_metadata(tmp_path, info):
    import numpy as np
    from safetensors.numpy import save_file

    from codec.errors import CodecError
    from codec.kvtc import load_calibration

    p = tmp_path / "cal.safetensors"
    save_file({"mean": np.zeros(4, np.float32)}, str(p), metadata={"kvtc": info, "hash": "0" * 64})
    with pytest.raises(CodecError):
        load_calibration(p)


@pytest.mark.parametrize("doc", [*DEEP_DOCS.values(), "[]", '{"hash": 5}', '{"hash": "../../etc/passwd"}',
                                 '{"groups": [{"hash": "ab"}]}', '{"groups": 7}', "x" * 2_000_000])
def test_calibration_index_refuses_hostile_files(tmp_path, doc):
    from kv_extraction_hf.calibrate import calibration_index
    from kv_extraction_hf.errors import ExtractionError

    p = tmp_path / "default-x.json"
    p.write_text(doc)
    with pytest.raises(ExtractionError, match="calibration index"):
        calibration_index(p)
    p.write_text(json.dumps({"hash": "a" * 64, "groups": [{"layers": [0], "hash": "b" * 64}]}))
    assert calibration_index(p)["hash"] == "a" * 64


# --------------------------------------------------------------------------- store manifests

HOSTILE_MANIFESTS = {
    **{f"deep_{k}": v for k, v in DEEP_DOCS.items()},
    "deep_levels": '{"format": "cgh-manifest-v2", "levels": ' + _deep_lists(40) + "}",
    "array": "[1, 2]", "string": '"manifest"', "null": "null",
    "wrong_types": json.dumps({"format": "cgh-manifest-v2", "levels": "12", "chunk_count": [3],
                               "token_ranges": {"a": 1}, "gen": 5}),
    "not_utf8": "\udcff",
}


@pytest.fixture
def store_server(tmp_path):
    from streaming.store.folder import LocalFolderBackend
    from streaming.store.server import KVStoreServer

    srv = KVStoreServer(LocalFolderBackend(tmp_path / "store"))
    srv.start_thread()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("name", sorted(HOSTILE_MANIFESTS))
def test_store_reads_a_hostile_manifest_as_a_miss(store_server, name):
    from bench import standin_codec as standin
    from streaming.store import StoreClient

    chunks = {1: [standin.make_chunk(1000 + i, seed=i) for i in range(2)]}
    with StoreClient(*store_server.address, timeout=5) as c:
        key = c.put_context("m", "w", "standin", list(range(20)), chunks, [(0, 10), (10, 20)])
        raw = HOSTILE_MANIFESTS[name].encode("utf-8", "surrogateescape")
        store_server.store.backend.put(f"ctx/{key}/manifest", raw)
        assert c.get_manifest(key) is None
        why = c.last_miss_reason
        assert "manifest" in why and "\n" not in why, why
        # a writer publishing over the hostile bytes replaces them (they record no usable prev)
        assert c.put_context("m", "w", "standin", list(range(20)), chunks, [(0, 10), (10, 20)]) == key
        m = c.get_manifest(key)
        assert m is not None and m.prev is None, c.last_miss_reason


@pytest.mark.parametrize("field,value", [
    ("identity", {"level_configs": 5}), ("identity", {"num_layers": "x"}), ("identity", [1, 2]),
    ("identity", "abc"), ("identity", {"calibration_hash": 5}), ("identity", {"model_id": {"a": [1]}}),
    ("levels", [[1]]), ("levels", "1"), ("text", ["0123456789", "0123456789"]), ("sizes", [1, 2]), ("crc32", {"1": "x"}), ("text", [["a"]]),
    ("token_ranges", [[0]]), ("gen", 5), ("prev", [1]), ("calibrations", [5]), ("meta", [1]),
    ("chunk_count", "two"), ("key", 5),
])
def test_store_reads_a_manifest_with_wrong_types_as_a_miss(tmp_path, field, value):
    from bench import standin_codec as standin
    from streaming.store.folder import LocalFolderBackend
    from streaming.store.format import build_manifest
    from streaming.store.kv import KVStore

    st = KVStore(LocalFolderBackend(tmp_path))
    chunks = {1: [standin.make_chunk(1000 + i, seed=i) for i in range(2)]}
    key, man = build_manifest("m", "w", "standin", list(range(20)), chunks, [(0, 10), (10, 20)])
    for i, c in enumerate(chunks[1]):
        st.put_chunk(key, 1, i, c, man["gen"])
    st.put_manifest(man)
    assert st.get_manifest(key)[0] is not None
    raw = st.backend.get(f"ctx/{key}/manifest")
    st.backend.put(f"ctx/{key}/manifest", json.dumps({**json.loads(raw), field: value}).encode())
    m, why = st.get_manifest(key)
    assert m is None and "stored manifest unusable" in why and "\n" not in why, why


def test_manifest_over_the_size_bound_is_refused(tmp_path):
    from streaming.errors import StoreError
    from streaming.store.format import MAX_MANIFEST_BYTES, manifest_json

    with pytest.raises(StoreError, match="over the .*-byte limit"):
        manifest_json(b"{" + b" " * MAX_MANIFEST_BYTES + b"}")
    assert manifest_json(b'{"a": [1]}') == {"a": [1]}


# --------------------------------------------------------------------------- store protocol frames

@pytest.mark.parametrize("doc", [*DEEP_DOCS.values(), _deep_objects(33), "[1]", "1", '"x"', "NaN"])
def test_frame_metadata_refuses_hostile_json(doc):
    from streaming.errors import ProtocolError
    from streaming.store.protocol import FrameType, decode_frame, encode_header, parse_meta

    mb = doc.encode()
    with pytest.raises(ProtocolError, match="frame metadata"):
        parse_meta(mb, max_meta=len(mb))
    with pytest.raises(ProtocolError, match="frame metadata"):
        decode_frame(encode_header(FrameType.PUT_MANIFEST, len(mb), 0) + mb, max_meta=len(mb))


def test_frame_metadata_over_the_bound_is_refused():
    from streaming.errors import ProtocolError
    from streaming.store.protocol import parse_meta

    with pytest.raises(ProtocolError, match="over the 10-byte limit"):
        parse_meta(b'{"a": "123456789"}', max_meta=10)


# --------------------------------------------------------------------------- vLLM connector: local folder, prefix index

@pytest.mark.parametrize("name", sorted(HOSTILE_MANIFESTS) + ["wrong_local_types", "short_token_ids"])
def test_local_source_reads_a_hostile_manifest_as_a_miss(tmp_path, name):
    from third_party.vllm.sources.local import MANIFEST, LocalDirSource, save_local_context

    ids = list(range(8))
    save_local_context(tmp_path, "A", ids, [b"x" * 4], [8])
    man = json.loads((tmp_path / "A" / MANIFEST).read_text())
    if name == "wrong_local_types":
        doc = json.dumps({**man, "chunk_tokens": 8, "sizes": "4"})
    elif name == "short_token_ids":
        doc = json.dumps({**man, "token_ids": [[1]] * 8})
    else:
        doc = HOSTILE_MANIFESTS[name]
    (tmp_path / "A" / MANIFEST).write_bytes(doc.encode("utf-8", "surrogateescape"))
    src = LocalDirSource(tmp_path)
    try:
        lk = src.lookup({"context_key": "A"}, ids)
    except Exception as e:   # noqa: BLE001 - the documented refusal is SourceError, one line
        from third_party.vllm.sources.base import SourceError

        assert isinstance(e, SourceError) and "\n" not in str(e), repr(e)
    else:
        assert lk.num_tokens == 0 and lk.info.get("miss")


@pytest.mark.parametrize("doc", [*DEEP_DOCS.values(), "[1]", '{"format": "cgh-prefix-index-v2", "entries": 7}',
                                 '{"format": "cgh-prefix-index-v2", "entries": {"a": 1}}',
                                 '{"format": "cgh-prefix-index-v2", "entries": [' + '{"key": "k", "tokens": 1},'
                                 * 5000 + "1]}"])
def test_prefix_index_reads_a_hostile_record_as_no_record(doc):
    from third_party.vllm.prefix_chain import _read_record

    class Client:
        def get_chunk(self, key, level, index):
            return doc.encode()

    assert _read_record(Client(), "k") == []


# --------------------------------------------------------------------------- LMCache adapter options and frames

@pytest.mark.parametrize("doc", [*DEEP_DOCS.values(), "[1]"])
def test_lmcache_adapter_options_refuse_hostile_json(doc):
    from third_party.lmcache.server import check_adapters

    with pytest.raises(ValueError, match="--l2-adapter"):
        check_adapters(["--l2-adapter", doc])


def test_lmcache_frame_refuses_an_oversized_ident():
    from third_party.lmcache.frame import MAX_IDENT, parse_frame, pack_frame

    frame = pack_frame(_deep_lists(MAX_IDENT).encode(), [b"x"])
    with pytest.raises(ValueError, match="out of range"):
        parse_frame(memoryview(frame))


# --------------------------------------------------------------------------- trace files, the cache's records

@pytest.mark.parametrize("line", [*DEEP_DOCS.values(), '{"bw": ' + _deep_lists(3) + "}", "[1]", '"bw"',
                                  '{"bw": "fast"}', '{"bw": {"a": 1}}', '{"bw": [' + "1," * 9_000_000 + "1]}"])
def test_trace_file_refuses_hostile_lines(tmp_path, line):
    from streaming.adapt.traces import load_artifact_traces

    p = tmp_path / "t.jsonl"
    p.write_text('{"bw": [0.1, 0.2]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a \{'bw'"):
        load_artifact_traces(p)


@pytest.mark.parametrize("doc", [*DEEP_DOCS.values(), "[1]", '"x"', "{" + " " * (17 << 20) + "}"])
def test_the_caches_records_are_read_as_absent_when_hostile(tmp_path, monkeypatch, doc):
    from harness import lifecycle
    from kv_extraction_hf import model

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / model.SOURCE_FILE).write_text(doc)
    assert model._source_record(folder) == {}
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "dead.json").write_text(doc)
    monkeypatch.setattr(lifecycle, "runs_dir", lambda cache=None: runs)
    assert lifecycle.cleanup_stale_runs() == [] and not (runs / "dead.json").exists()
