"""Abort-during-load check of CacheGenConnector in a real vLLM engine, run by
tests/vllm_connector/test_vllm_connector_abort.py in a subprocess (vLLM's LLM() must be created under
``__main__``). Writes a JSON report the tests assert on.

One engine with the connector in the chosen load mode (extra config "async_load") and the
test-only chunk hook tests/helpers/kv_test_hooks.py:hold_until_cancelled (holds the "abort_me"
request's load after chunk 0 until vLLM cancels it). Scenarios, same needle prompt:
  text       plain prefill
  loaded     raw HF KV loaded from a local folder (must equal text)
  corrupt    chunk 1 fails its CRC: its blocks are reported, vLLM recomputes (= text)
  abort_me   the load is held after chunk 0, the request is aborted (LLMEngine.abort_request)
  after      a load after the abort (the engine still serves, blocks reused, = text)
  ttft       --ttft-reps loaded requests, TTFT (vLLM's first_token_latency) each
Run: .venv/bin/python tests/helpers/vllm_abort_check.py --out r.json [--async-load] [--model-dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import codec
from cachegen_common.cli import exit_status
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.model import load_model
from kv_extraction_hf.prompts import build_prompt
from streaming.identity import codec_identity, model_identity
from third_party.vllm.engine import make_llm, shutdown_llm
from third_party.vllm.sources import save_local_context


def check(model_dir: str | None, out_path: str, async_load: bool, context_tokens: int = 600,
          max_tokens: int = 8, chunk_tokens: int = 256, ttft_reps: int = 0,
          hook_wait_s: float = 120.0) -> dict[str, Any]:
    bundle = load_model(model_dir, log=lambda m: print(m, file=sys.stderr))
    mdir = Path(bundle.info.path)
    p = build_prompt("needle", bundle.tokenizer, context_tokens, seed=1, index=0)
    ctx, prompt = list(p.context_ids), list(p.context_ids) + list(p.question_ids)
    k, v = prefill_kv(bundle, ctx)
    ident = codec_identity(model_identity(bundle.info), "raw", [None])
    del bundle
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=chunk_tokens)
    sizes = [min(chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), chunk_tokens)]
    work = Path(tempfile.mkdtemp(prefix="cg_vllm_abort_"))
    save_local_context(work / "kv", "ctx", ctx, chunks, sizes, info={"codec": "raw"}, identity=ident)
    bad = list(chunks)
    b1 = bytearray(bad[1])
    b1[len(b1) // 2] ^= 0xFF
    bad[1] = bytes(b1)
    save_local_context(work / "kv", "ctx_bad", ctx, bad, sizes, info={"codec": "raw"}, identity=ident)
    hook_dir = work / "hook"
    hook_dir.mkdir()
    os.environ["CG_TEST_HOOK_DIR"] = str(hook_dir)   # inherited by vLLM's worker process
    os.environ["CG_TEST_HOOK_WAIT_S"] = str(hook_wait_s)
    stats = work / "stats.jsonl"
    report: dict[str, Any] = {"async_load": async_load, "prompt_tokens": len(prompt),
                              "context_tokens": len(ctx), "chunk_tokens": chunk_tokens,
                              "outputs": {}, "ttft_s": []}
    llm = make_llm(mdir, {"source": "local", "source_dir": str(work / "kv"),
                          "stats_path": str(stats), "async_load": async_load,
                          "test_chunk_hook": "tests.helpers.kv_test_hooks:hold_until_cancelled"},
                   max_model_len=2048)
    try:
        def kp(key, tag):
            return {"source": "local", "context_key": key, "mode": "raw", "stats_tag": tag}

        for name, params in (("text", None), ("loaded", kp("ctx", "loaded")),
                             ("corrupt", kp("ctx_bad", "corrupt"))):
            report["outputs"][name] = _generate(llm, prompt, max_tokens, params)[0]
        report["abort"] = _abort_mid_load(llm, prompt, max_tokens, kp("ctx", "abort_me"),
                                          hook_dir, timeout_s=hook_wait_s + 300)
        report["outputs"]["after"] = _generate(llm, prompt, max_tokens, kp("ctx", "after"))[0]
        for i in range(ttft_reps):
            report["ttft_s"].append(_generate(llm, prompt, max_tokens, kp("ctx", f"ttft{i}"))[1])
    finally:
        shutdown_llm(llm)
    report["stats"] = [json.loads(x) for x in stats.read_text().splitlines()] \
        if stats.exists() else []
    report["hook_released"] = (hook_dir / "released").read_text() \
        if (hook_dir / "released").exists() else None
    Path(out_path).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return report


def _sp(max_tokens: int, params: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          extra_args={"kv_transfer_params": params} if params else None)


def _generate(llm, prompt: list[int], max_tokens: int, params: dict | None):
    out = llm.generate([{"prompt_token_ids": prompt}], _sp(max_tokens, params), use_tqdm=False)[0]
    m = getattr(out, "metrics", None)
    return list(out.outputs[0].token_ids), float(getattr(m, "first_token_latency", float("nan")))


def _abort_mid_load(llm, prompt, max_tokens, params, hook_dir: Path, timeout_s: float) -> dict:
    """Add the request, step the engine until the hook says the load is past chunk 0, abort
    it, step until nothing is unfinished. Returns what the engine gave back."""
    eng = llm.llm_engine
    eng.add_request("abort_me", {"prompt_token_ids": prompt}, _sp(max_tokens, params))
    t0 = time.monotonic()
    outs, reached = [], False
    while eng.has_unfinished_requests() and time.monotonic() - t0 < timeout_s:
        outs += eng.step()
        if (hook_dir / "reached").exists():
            reached = True
            break
    t_abort = time.monotonic()
    if reached:
        eng.abort_request(["abort_me"])
    while eng.has_unfinished_requests() and time.monotonic() - t0 < timeout_s:
        outs += eng.step()
    # a few idle steps so the worker's report of the stopped load reaches the scheduler
    return {"reached_mid_load": reached, "abort_to_idle_s": time.monotonic() - t_abort,
            "tokens_out": sum(len(o.outputs[0].token_ids) for o in outs if o.outputs),
            "finished": [bool(o.finished) for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/helpers/vllm_abort_check.py",
                                 description="Abort-during-load check (used by the tests).")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--async-load", action="store_true")
    ap.add_argument("--context-tokens", type=int, default=600)
    ap.add_argument("--ttft-reps", type=int, default=0)
    ap.add_argument("--hook-wait-s", type=float, default=120.0)
    a = ap.parse_args(argv)
    return exit_status(lambda: check(a.model_dir, a.out, a.async_load, a.context_tokens, ttft_reps=a.ttft_reps,
                                     hook_wait_s=a.hook_wait_s),
                       (ExtractionError, ValueError, OSError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
