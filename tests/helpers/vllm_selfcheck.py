"""Self-check of CacheGenConnector in a real vLLM engine, run by tests/vllm_connector/test_vllm_connector.py
in a subprocess (vLLM's LLM() must be created under ``__main__``, and the subprocess's exit
guarantees no engine process outlives the test). Writes a JSON report the tests assert on.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5-7: a context's KV, extracted once,
is loaded by the serving engine instead of re-running prefill; the load must give the
same tokens as the prefill.

Run: .venv/bin/python tests/helpers/vllm_selfcheck.py --out report.json [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import codec
from cachegen_common.cli import exit_status
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.model import load_model
from kv_extraction_hf.prompts import build_prompt
from streaming.store import start_store_server
from third_party.vllm.engine import make_llm, shutdown_llm
from streaming.identity import codec_identity, model_identity
from third_party.vllm.sources import save_local_context


@torch.no_grad()
def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of prompt_ids by HF transformers (full prefill), token ids."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def selfcheck(model_dir: str | None, out_path: str, context_tokens: int = 600,
              max_tokens: int = 16, chunk_tokens: int = 256, prompt_kind: str = "needle",
              keep_workdir: bool = False, block_size: int = 128) -> dict[str, Any]:
    """One engine, several scenarios; writes a JSON report to out_path (used by
    tests/vllm_connector/test_vllm_connector.py). Must be called under `if __name__ == "__main__":`.
    The model, the prompt (kv_extraction_hf.prompts.build_prompt, seed 1) and HF
    transformers' KV of the context (kv_extraction_hf.extract.prefill_kv) come from the
    extraction package, as in the harness. block_size: vLLM's KV cache block size, tokens
    (the CPU backend's default 128; its kernels take multiples of 32, vec16 also 16).

    Scenarios (same prompt = context + question, greedy max_tokens):
      text        plain prefill (no kv_transfer_params)
      text_save   plain prefill that also saves vLLM's own KV of the context (local folder)
      load_vllm_kv  loads that saved KV back (every context token: the load ends inside
                  a block)
      load_vllm_kv_blocks  the same, capped at the last whole block
      local_raw   HF-transformers KV, raw codec chunks in a local folder, loaded
      store_raw   the same chunks through the KV store server on loopback
      corrupt     local chunks with chunk 1 corrupted: load stops there, vLLM recomputes
      miss        a context key that is not stored: plain prefill
      hf          HF transformers greedy from the same prompt (full prefill)
    """
    bundle = load_model(model_dir, log=lambda m: print(m, file=sys.stderr))
    mdir = Path(bundle.info.path)
    task = "needle" if prompt_kind == "needle" else "longchat_lines"
    p = build_prompt(task, bundle.tokenizer, context_tokens, seed=1, index=0)
    ctx, q, answer = list(p.context_ids), list(p.question_ids), p.answer
    prompt = ctx + q
    k, v = prefill_kv(bundle, ctx)
    hf_out = _hf_greedy(bundle.model, prompt, max_tokens)
    ident = codec_identity(model_identity(bundle.info), "raw", [None])  # what made the chunks
    del bundle
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=chunk_tokens)
    sizes = [min(chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), chunk_tokens)]
    work = Path(tempfile.mkdtemp(prefix="cg_vllm_selfcheck_"))
    save_local_context(work / "kv", "ctx", ctx, chunks, sizes, info={"codec": "raw"}, identity=ident)
    # the same chunks recorded as another model's (other weights): the connector must miss
    save_local_context(work / "kv", "ctx_foreign", ctx, chunks, sizes, info={"codec": "raw"},
                       identity=ident.replace(weights_hash="f" * 64))
    bad = list(chunks)
    b1 = bytearray(bad[1])
    b1[len(b1) // 2] ^= 0xFF  # flip a byte inside chunk 1's payload: CRC error on decode
    bad[1] = bytes(b1)
    save_local_context(work / "kv", "ctx_bad", ctx, bad, sizes, info={"codec": "raw"}, identity=ident)
    stats = work / "stats.jsonl"
    report: dict[str, Any] = {"prompt_kind": prompt_kind, "answer": answer,
                              "prompt_tokens": len(prompt), "context_tokens": len(ctx),
                              "chunk_tokens": chunk_tokens, "block_size": block_size,
                              "hf": hf_out, "outputs": {},
                              "ttft_s": {}, "workdir": str(work)}
    with start_store_server(work / "store") as srv:
        with srv.client() as cl:
            ranges = [(i, i + t) for i, t in zip(range(0, len(ctx), chunk_tokens), sizes)]
            skey = cl.put_entry(ident.replace(model_id="selfcheck-model"), ctx, {None: chunks}, ranges)
        store = f"{srv.host}:{srv.port}"
        # prefix caching ON here (reset before every case) so that vLLM's own partial
        # prefill from its local prefix cache can be compared with the connector's load
        llm = make_llm(mdir, {"source": "local", "source_dir": str(work / "kv"),
                              "stats_path": str(stats), "stores": {"selfcheck": store},
                              "allow_client_save": True}, max_model_len=4096,
                       enable_prefix_caching=True, block_size=block_size)
        try:
            cases = {
                "text": None,
                "text_save": {"save": {"source": "local", "context_key": "vllm_ctx",
                                       "codec": "raw", "num_tokens": len(ctx),
                                       "chunk_tokens": chunk_tokens}, "stats_tag": "save"},
                "load_vllm_kv": {"source": "local", "context_key": "vllm_ctx", "mode": "raw",
                                 "stats_tag": "load_vllm_kv"},
                # the same load stopped at the last whole block: what vLLM's own prefix
                # cache holds (it keeps whole blocks only), so the two compare bit for bit
                "load_vllm_kv_blocks": {"source": "local", "context_key": "vllm_ctx",
                                        "mode": "raw",
                                        "load_tokens": len(ctx) // block_size * block_size,
                                        "stats_tag": "load_vllm_kv_blocks"},
                "local_raw": {"source": "local", "context_key": "ctx", "mode": "raw",
                              "stats_tag": "local_raw"},
                "store_raw": {"source": "store", "store": store, "context_key": skey,
                              "mode": "raw", "stats_tag": "store_raw"},  # raw: no level
                "corrupt": {"source": "local", "context_key": "ctx_bad", "mode": "raw",
                            "stats_tag": "corrupt"},
                "miss": {"source": "local", "context_key": "nothing_here", "mode": "raw",
                         "stats_tag": "miss"},
                "foreign": {"source": "local", "context_key": "ctx_foreign", "mode": "raw",
                            "stats_tag": "foreign"},
            }
            report["logprobs"], report["num_cached_tokens"] = {}, {}
            for name, kp in cases.items():
                llm.reset_prefix_cache()  # every case starts without local hits
                toks, lps, ncached, ttft = _generate_lp(llm, prompt, max_tokens, kp)
                report["outputs"][name], report["logprobs"][name] = toks, lps
                report["num_cached_tokens"][name], report["ttft_s"][name] = ncached, ttft
            # kind of vLLM #57596: prompt_logprobs makes vLLM skip the external
            # hit (skip_reading_prefix_cache); the connector must still leave one record
            llm.reset_prefix_cache()
            toks, _, ncached, _ = _generate_lp(
                llm, prompt, max_tokens, {"source": "local", "context_key": "ctx",
                                          "mode": "raw", "stats_tag": "prompt_logprobs"},
                prompt_logprobs=1)
            report["outputs"]["prompt_logprobs"] = toks
            report["num_cached_tokens"]["prompt_logprobs"] = ncached
            # vLLM's own partial prefill: the same prompt again hits the local prefix cache
            # left by the previous (plain) request
            llm.reset_prefix_cache()
            _generate_lp(llm, prompt, max_tokens, None)
            toks, lps, ncached, ttft = _generate_lp(llm, prompt, max_tokens, None)
            report["outputs"]["prefix_hit"], report["logprobs"]["prefix_hit"] = toks, lps
            report["num_cached_tokens"]["prefix_hit"], report["ttft_s"]["prefix_hit"] = \
                ncached, ttft
        finally:
            shutdown_llm(llm)
    report["stats"] = [json.loads(x) for x in stats.read_text().splitlines()] \
        if stats.exists() else []
    # vLLM's own KV (read back by the connector's save) vs HF transformers' KV
    vdir = work / "kv" / "vllm_ctx"
    if (vdir / "manifest.json").exists():
        man = json.loads((vdir / "manifest.json").read_text())
        dec = [codec.decode_kv((vdir / f"g-{man['gen']}" / f"chunk_{i}.bin").read_bytes())
               for i in range(len(man["chunk_tokens"]))]
        vk = torch.cat([d[0] for d in dec], 1).float()
        vv = torch.cat([d[1] for d in dec], 1).float()
        report["saved_token_ids_match"] = man["token_ids"] == ctx
        report["kv_diff"] = {
            "k_max_abs": (vk - k.float()).abs().max().item(),
            "v_max_abs": (vv - v.float()).abs().max().item(),
            "k_max": k.float().abs().max().item(), "v_max": v.float().abs().max().item(),
            "k_rel_rms": ((vk - k.float()).norm() / k.float().norm()).item(),
            "v_rel_rms": ((vv - v.float()).norm() / v.float().norm()).item(),
            "k_frac_equal": (vk == k.float()).float().mean().item(),
            "v_frac_equal": (vv == v.float()).float().mean().item(),
            # per layer: differences grow with depth (hidden states drift through layers)
            "k_rel_rms_per_layer": [((vk[i] - k[i].float()).norm() / k[i].float().norm()).item()
                                    for i in range(k.shape[0])],
        }
    Path(out_path).write_text(json.dumps(report, indent=1))
    if not keep_workdir:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _generate_lp(llm, prompt: list[int], max_tokens: int, kp: dict | None,
                 prompt_logprobs: int | None = None):
    """Greedy run -> (token ids, logprob of each chosen token, num_cached_tokens, ttft_s)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kp} if kp else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, extra_args=extra,
                        prompt_logprobs=prompt_logprobs)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
    m = getattr(out, "metrics", None)
    return list(c.token_ids), lps, out.num_cached_tokens, \
        float(getattr(m, "first_token_latency", float("nan")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/helpers/vllm_selfcheck.py",
                                 description="Connector self-check (used by the tests).")
    ap.add_argument("--model-dir", default=None, help="HF model folder (default: the "
                    "embedded default model, kv_extraction_hf.model.default_model_dir())")
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--context-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt", choices=["needle", "lines"], default="needle")
    ap.add_argument("--block-size", type=int, default=128,
                    help="vLLM KV cache block size, tokens (default 128)")
    a = ap.parse_args(argv)
    return exit_status(lambda: selfcheck(a.model_dir, a.out, a.context_tokens, a.max_tokens, prompt_kind=a.prompt,
                                         block_size=a.block_size),
                       (ExtractionError, ValueError, OSError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
