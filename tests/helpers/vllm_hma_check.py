"""Check of CacheGenHMAConnector (vLLM's hybrid KV cache manager on) in a real vLLM engine on
a sliding-window model, run by tests/vllm_connector/test_vllm_gemma3.py in a subprocess (vLLM's
LLM() must be created under ``__main__``). Writes a JSON report the test asserts on.

Scenarios (one engine, a needle prompt longer than the window, HF-transformers KV of the
context as raw chunks in a local folder, greedy max_tokens):
  text       plain prefill
  local_raw  the chunks loaded: the sliding groups' null blocks skipped
  corrupt    chunk 2 of 4 corrupted: the load fails after 2 chunks, the connector reports
             the request as failed_recving, vLLM recomputes its whole prompt
  windowed   the chunks in the window-storage layout (codec.window, a sliding layer keeps
             its last W + 128 tokens, the store path's default): the same output as text

Run: .venv/bin/python tests/helpers/vllm_hma_check.py --model-dir DIR --out report.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import codec
from codec import window as cwindow
from cachegen_common.cli import exit_status
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.model import load_model
from kv_extraction_hf.prompts import build_prompt
from streaming.identity import codec_identity, model_identity
from third_party.vllm.engine import make_llm, run_one, shutdown_llm
from third_party.vllm.sources import save_local_context


def check(model_dir: str, out_path: str, context_tokens: int, max_tokens: int,
          chunk_tokens: int = 256) -> dict:
    """Run the scenarios (module docstring); writes and returns the report: {"outputs":
    {scenario: token ids}, "stats": the connector's records, "answer", "prompt_tokens",
    "window", "kv_cache": the connector's kv_cache record}."""
    bundle = load_model(model_dir, log=lambda m: print(m, file=sys.stderr))
    p = build_prompt("needle", bundle.tokenizer, context_tokens, seed=1, index=0)
    ctx = list(p.context_ids)
    prompt = ctx + list(p.question_ids)
    k, v = prefill_kv(bundle, ctx)
    ident = codec_identity(model_identity(bundle.info), "raw", [None])
    window = bundle.info.sliding_window
    ws = [window if bundle.info.kind(i) == "sliding" else None for i in range(bundle.info.num_layers)]
    mdir = Path(bundle.info.path)
    del bundle
    report: dict = {"answer": p.answer, "prompt_tokens": len(prompt), "window": window,
                    "outputs": {}}
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=chunk_tokens)
    sizes = [min(chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), chunk_tokens)]
    work = Path(tempfile.mkdtemp(prefix="cg_vllm_hma_check_"))
    save_local_context(work / "kv", "ctx", ctx, chunks, sizes, info={"codec": "raw"}, identity=ident)
    bad = list(chunks)
    b = bytearray(bad[2])
    b[len(b) // 2] ^= 0xFF  # a flipped payload byte: the chunk's CRC check fails on decode
    bad[2] = bytes(b)
    save_local_context(work / "kv", "ctx_bad", ctx, bad, sizes, info={"codec": "raw"}, identity=ident)
    wchunks = cwindow.encode_windowed_chunks(k, v, ws, codec="raw", chunk_tokens=chunk_tokens,
                                             extra_tokens=128)
    save_local_context(work / "kv", "ctx_win", ctx, wchunks, sizes, info={"codec": "raw"},
                       identity=ident.replace(kv_layout=cwindow.layout.layout_tag(ws, 128)))
    report["windowed_bytes"] = sum(map(len, wchunks))
    report["full_bytes"] = sum(map(len, chunks))
    stats = work / "stats.jsonl"
    llm = make_llm(mdir, {"source": "local", "source_dir": str(work / "kv"),
                          "stats_path": str(stats), "warmup": False},
                   max_model_len=len(prompt) + max_tokens + 64, hybrid_kv=True)
    try:
        cases = {"text": None,
                 "local_raw": {"source": "local", "context_key": "ctx", "mode": "raw",
                               "stats_tag": "local_raw"},
                 "corrupt": {"source": "local", "context_key": "ctx_bad", "mode": "raw",
                             "stats_tag": "corrupt"},
                 "windowed": {"source": "local", "context_key": "ctx_win", "mode": "raw",
                              "stats_tag": "windowed"}}
        for name, kp in cases.items():
            report["outputs"][name] = run_one(llm, prompt, max_tokens, kp)[0]
        report["hybrid_kv_cache_manager"] = \
            not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    finally:
        shutdown_llm(llm)
    report["stats"] = [json.loads(x) for x in stats.read_text().splitlines()] \
        if stats.exists() else []
    report["kv_cache"] = next((r for r in report["stats"] if r.get("kind") == "kv_cache"), {})
    Path(out_path).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/helpers/vllm_hma_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="HF model folder with sliding-window layers")
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    return exit_status(lambda: check(args.model_dir, args.out, args.context_tokens, args.max_tokens),
                       (ExtractionError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
