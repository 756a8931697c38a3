"""Helpers for the connector's demo and tests: offline prompts (needle, lines), HF-transformers
KV of a context and greedy reference, the TTFT demo (plain prefill vs. KV loads) and the
self-check that tests/test_vllm_connector.py runs in a subprocess.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 (TTFT of text prefill vs. KV load).
Run: `python -m third_party.vllm.engine --help` (the demo) or
     `python -m third_party.vllm.demo_support --out report.json` (the self-check).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

FALLBACK_MODEL_DIR = Path("/tmp/smollm2-hf")


def resolve_model_dir(model_dir: str | os.PathLike | None = None) -> Path:
    """The model folder: the argument, else kv_extraction_hf's default (fetched + converted
    bf16 SmolLM2-135M-Instruct), else /tmp/smollm2-hf. Raises ValueError if none exists."""
    if model_dir:
        p = Path(model_dir)
    else:
        p = None
        try:
            from kv_extraction_hf.model import default_model_dir

            p = Path(default_model_dir())
        except Exception:  # package not ready or offline: fall back to a local conversion
            p = FALLBACK_MODEL_DIR
    if not (p / "config.json").is_file():
        raise ValueError(f"no HF model folder at {p} (need config.json)")
    return p


def lines_prompt(tokenizer, context_tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Offline LongChat-style 'lines' context of about context_tokens tokens + a question.

    Returns (context_ids, question_ids); the prompt is their concatenation. Deterministic.
    """
    rng = random.Random(seed)
    lines, ids = [], []
    i = 0
    while len(ids) < context_tokens:
        i += 1
        lines.append(f"line {i}: REGISTER_CONTENT is <{rng.randint(1, 50000)}>\n")
        if i % 20 == 0 or len(ids) + 40 >= context_tokens:
            ids = tokenizer("".join(lines), add_special_tokens=False)["input_ids"]
    ids = ids[:context_tokens]
    q = f"\nQuestion: what is the REGISTER_CONTENT in line {rng.randint(1, max(1, i - 1))}? Answer:"
    qids = tokenizer(q, add_special_tokens=False)["input_ids"]
    return list(ids), list(qids)


def load_hf_model(model_dir: Path):
    """The HF transformers model of model_dir in bf16, eval mode (CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()


_FILLER = [
    "The river bends twice before it reaches the old mill at the edge of the valley.",
    "Most of the town's bread is still baked in ovens that burn oak and beech wood.",
    "A good map shows not only the roads but also the hills that make them slow.",
    "In winter the library opens late, and the reading room fills with students.",
    "The committee met on Tuesday to discuss the repair of the north bridge.",
    "Bees visit the clover fields in the morning, when the flowers are still wet.",
    "Her grandfather kept a diary of the weather for more than forty years.",
    "The train from the coast arrives at noon and leaves again an hour later.",
    "Several families grow apples, pears and plums on the southern slopes.",
    "The museum's oldest clock still keeps time within a minute a week.",
    "Fishing boats return before sunset, followed by a cloud of gulls.",
    "The new school was built with large windows to save on lighting.",
    "On market days the square is crowded with stalls selling cheese and honey.",
    "The lighthouse keeper painted the stairs white so they could be seen at night.",
    "A narrow path climbs through the forest to a view over three lakes.",
    "The choir practises every Thursday in the hall behind the church.",
]


def needle_prompt(tokenizer, context_tokens: int, seed: int = 0, depth: float = 0.5
                  ) -> tuple[list[int], list[int], str]:
    """Offline needle-in-a-haystack prompt: filler sentences with "The secret passcode is
    NNNNN." at `depth`, then a question. Returns (context_ids, question_ids, answer).
    The default model answers it (cachegen.md section 9), so greedy continuations are
    confident rather than near-tied."""
    rng = random.Random(seed)
    code = str(rng.randint(10000, 99999))
    needle = f" The secret passcode is {code}."
    sents: list[str] = []
    while True:
        sents.append(" " + _FILLER[rng.randrange(len(_FILLER))])
        if len(tokenizer("".join(sents), add_special_tokens=False)["input_ids"]) > \
                context_tokens + 40:
            break
    sents.insert(int(len(sents) * depth), needle)
    ids = tokenizer("".join(sents), add_special_tokens=False)["input_ids"][:context_tokens]
    q = "\nQuestion: What is the secret passcode? Answer: The secret passcode is"
    return list(ids), list(tokenizer(q, add_special_tokens=False)["input_ids"]), code


@torch.no_grad()
def hf_context_kv(model, context_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of context_ids from HF transformers (model dtype, CPU): k, v [L, T, H, D].

    The same computation as kv_extraction_hf.extract.prefill_kv (one forward pass with
    use_cache=True, cache layers [1, H, T, D] transposed to [T, H, D]); kept here so the
    connector's tests do not depend on the extraction package's model resolution.
    """
    out = model(torch.tensor([context_ids]), use_cache=True)
    cache = out.past_key_values
    ks = [layer.keys[0].transpose(0, 1) for layer in cache.layers]  # [T, H, D] each
    vs = [layer.values[0].transpose(0, 1) for layer in cache.layers]
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()  # [L, T, H, D]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of prompt_ids by HF transformers (full prefill), token ids."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def run_demo(args) -> int:
    """TTFT of plain prefill vs. KV loads through the connector on one engine (see engine.py
    --help). Modes are interleaved round by round; round 0 is a warm-up, not counted."""
    import contextlib

    import codec
    from transformers import AutoTokenizer

    from streaming.store import start_store_server
    from third_party.vllm.engine import make_llm, run_one
    from third_party.vllm.sources import save_local_context

    model_dir = resolve_model_dir(args.model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ctx, q, answer = needle_prompt(tok, args.tokens, seed=0)
    prompt = ctx + q
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    k, v = hf_context_kv(load_hf_model(model_dir), ctx)
    bf16_bytes = 2 * k.numel() * k.element_size()
    print(f"context {len(ctx)} tokens + question {len(q)}; bf16 KV {bf16_bytes / 1e6:.1f} MB")
    codecs = [(c, args.level if c == "cachegen" else None) for c in args.codecs]
    enc = {}
    for name, level in codecs:
        chunks = codec.encode_chunks(k, v, codec=name, level=level, chunk_tokens=args.chunk_tokens)
        enc[name] = chunks
        print(f"  {name:9s} {sum(map(len, chunks)) / 1e6:7.2f} MB in {len(chunks)} chunks "
              f"({bf16_bytes / sum(map(len, chunks)):.2f}x vs bf16)")
    sizes = [min(args.chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), args.chunk_tokens)]
    ranges = [(i, i + t) for i, t in zip(range(0, len(ctx), args.chunk_tokens), sizes)]
    save_local_context(work / "kv", "raw", ctx, enc.get("raw") or codec.encode_chunks(
        k, v, codec="raw", chunk_tokens=args.chunk_tokens), sizes)
    stats = work / "stats.jsonl"
    link_cm = contextlib.nullcontext(None)
    if args.rate_mbps:
        from streaming.link import ShapedLink

        link_cm = ShapedLink(args.rate_mbps)
    with link_cm as link, start_store_server(work / "store", link=link) as srv:
        keys = {}
        with srv.client(timeout=300) as cl:
            for name, _ in codecs:
                keys[name] = cl.put_context("demo-model", "demo-weights", name, ctx,
                                            {0: enc[name]}, ranges)
        store = f"{srv.host}:{srv.port}"
        link_desc = f"{link.method} {args.rate_mbps} Mbit/s" if link else "loopback, unshaped"
        print(f"store at {store} ({link_desc})")
        llm = make_llm(model_dir, {"source_dir": str(work / "kv"), "stats_path": str(stats)},
                       max_model_len=max(4096, len(prompt) + 64))
        try:
            modes: dict[str, Any] = {"text": None,
                                     "raw-local": {"source": "local", "context_key": "raw",
                                                   "mode": "raw", "stats_tag": "raw-local"}}
            for name, _ in codecs:
                modes[f"{name}-store"] = {"source": "store", "store": store, "level": 0,
                                          "context_key": keys[name], "mode": name,
                                          "stats_tag": f"{name}-store"}
            # vLLM's OWN KV of the context, saved by the connector from a plain prefill:
            # separates connector faults from HF-vs-vLLM kernel differences
            run_one(llm, prompt, 1, {"save": {"source": "local", "context_key": "vllm_raw",
                                              "codec": "raw", "num_tokens": len(ctx),
                                              "chunk_tokens": args.chunk_tokens},
                                     "stats_tag": "save"})
            modes["vllm-raw-local"] = {"source": "local", "context_key": "vllm_raw",
                                       "mode": "raw", "stats_tag": "vllm-raw-local"}
            ttft: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.repeats + 1):
                for m, kp in modes.items():
                    _, t, _ = run_one(llm, prompt, 1, kp)
                    if r:
                        ttft[m].append(t)
            outs = {m: run_one(llm, prompt, args.max_tokens, kp)[0] for m, kp in modes.items()}
        finally:
            shutdown_llm(llm)
    recs = [json.loads(x) for x in stats.read_text().splitlines()]
    print(f"\n{'mode':14s} {'TTFT med ms':>11s} {'min':>7s} {'max':>7s}  load_s parts (median "
          f"of counted runs, ms): lookup transfer decode inject load | same greedy as text")
    for m in modes:
        xs = ttft[m]
        line = (f"{m:14s} {statistics.median(xs) * 1e3:11.1f} {min(xs) * 1e3:7.1f} "
                f"{max(xs) * 1e3:7.1f}")
        # records of mode m: warm-up round, the counted rounds, then the greedy run
        rs = [x for x in recs if x.get("stats_tag") == m and x.get("kind") == "load"]
        rs = rs[1:args.repeats + 1]
        if rs:
            parts = [statistics.median(x[f] or 0.0 for x in rs) * 1e3
                     for f in ("lookup_s", "transfer_s", "decode_s", "inject_s", "load_s")]
            line += "  " + " ".join(f"{p:7.1f}" for p in parts)
            line += f"  (loaded {rs[-1]['loaded_tokens']} tok)"
        print(line + f"  | {outs[m] == outs['text']}")
    print(f"answer {answer!r}; text output {tok.decode(outs['text'])!r}")
    (work / "ttft.json").write_text(json.dumps({"ttft_s": ttft, "outputs": outs,
                                                "prompt_tokens": len(prompt)}, indent=1))
    return 0


def selfcheck(model_dir: str | None, out_path: str, context_tokens: int = 600,
              max_tokens: int = 16, chunk_tokens: int = 256, prompt_kind: str = "needle",
              keep_workdir: bool = False) -> dict[str, Any]:
    """One engine, several scenarios; writes a JSON report to out_path (used by
    tests/test_vllm_connector.py). Must be called under `if __name__ == "__main__":`.

    Scenarios (same prompt = context + question, greedy max_tokens):
      text        plain prefill (no kv_transfer_params)
      text_save   plain prefill that also saves vLLM's own KV of the context (local folder)
      load_vllm_kv  loads that saved KV back
      local_raw   HF-transformers KV, raw codec chunks in a local folder, loaded
      store_raw   the same chunks through the KV store server on loopback
      corrupt     local chunks with chunk 1 corrupted: load stops there, vLLM recomputes
      miss        a context key that is not stored: plain prefill
      hf          HF transformers greedy from the same prompt (full prefill)
    """
    import tempfile

    import codec
    from transformers import AutoTokenizer

    from third_party.vllm.engine import make_llm, run_one
    from third_party.vllm.sources import save_local_context

    mdir = resolve_model_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(str(mdir))
    if prompt_kind == "needle":
        ctx, q, answer = needle_prompt(tok, context_tokens, seed=1)
    else:
        (ctx, q), answer = lines_prompt(tok, context_tokens, seed=1), None
    prompt = ctx + q
    model = load_hf_model(mdir)
    k, v = hf_context_kv(model, ctx)
    hf_out = hf_greedy(model, prompt, max_tokens)
    del model
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=chunk_tokens)
    sizes = [min(chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), chunk_tokens)]
    work = Path(tempfile.mkdtemp(prefix="cg_vllm_selfcheck_"))
    save_local_context(work / "kv", "ctx", ctx, chunks, sizes, info={"codec": "raw"})
    bad = list(chunks)
    b1 = bytearray(bad[1])
    b1[len(b1) // 2] ^= 0xFF  # flip a byte inside chunk 1's payload: CRC error on decode
    bad[1] = bytes(b1)
    save_local_context(work / "kv", "ctx_bad", ctx, bad, sizes, info={"codec": "raw"})
    stats = work / "stats.jsonl"
    report: dict[str, Any] = {"prompt_kind": prompt_kind, "answer": answer,
                              "prompt_tokens": len(prompt), "context_tokens": len(ctx),
                              "chunk_tokens": chunk_tokens, "hf": hf_out, "outputs": {},
                              "ttft_s": {}, "workdir": str(work)}
    from streaming.store import start_store_server

    with start_store_server(work / "store") as srv:
        with srv.client() as cl:
            ranges = [(i, i + t) for i, t in zip(range(0, len(ctx), chunk_tokens), sizes)]
            skey = cl.put_context("selfcheck-model", "0" * 16, "raw", ctx, {0: chunks}, ranges)
        store = f"{srv.host}:{srv.port}"
        # prefix caching ON here (reset before every case) so that vLLM's own partial
        # prefill from its local prefix cache can be compared with the connector's load
        llm = make_llm(mdir, {"source": "local", "source_dir": str(work / "kv"),
                              "stats_path": str(stats)}, max_model_len=4096,
                       enable_prefix_caching=True)
        try:
            cases = {
                "text": None,
                "text_save": {"save": {"source": "local", "context_key": "vllm_ctx",
                                       "codec": "raw", "num_tokens": len(ctx),
                                       "chunk_tokens": chunk_tokens}, "stats_tag": "save"},
                "load_vllm_kv": {"source": "local", "context_key": "vllm_ctx", "mode": "raw",
                                 "stats_tag": "load_vllm_kv"},
                "local_raw": {"source": "local", "context_key": "ctx", "mode": "raw",
                              "stats_tag": "local_raw"},
                "store_raw": {"source": "store", "store": store, "context_key": skey,
                              "mode": "raw", "level": 0, "stats_tag": "store_raw"},
                "corrupt": {"source": "local", "context_key": "ctx_bad", "mode": "raw",
                            "stats_tag": "corrupt"},
                "miss": {"source": "local", "context_key": "nothing_here", "mode": "raw",
                         "stats_tag": "miss"},
            }
            report["logprobs"], report["num_cached_tokens"] = {}, {}
            for name, kp in cases.items():
                llm.reset_prefix_cache()  # every case starts without local hits
                toks, lps, ncached, ttft = _generate_lp(llm, prompt, max_tokens, kp)
                report["outputs"][name], report["logprobs"][name] = toks, lps
                report["num_cached_tokens"][name], report["ttft_s"][name] = ncached, ttft
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
        dec = [codec.decode_kv((vdir / f"chunk_{i}.bin").read_bytes())
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


def _generate_lp(llm, prompt: list[int], max_tokens: int, kp: dict | None):
    """Greedy run -> (token ids, logprob of each chosen token, num_cached_tokens, ttft_s)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kp} if kp else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, extra_args=extra)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
    m = getattr(out, "metrics", None)
    return list(c.token_ids), lps, out.num_cached_tokens, \
        float(getattr(m, "first_token_latency", float("nan")))


def shutdown_llm(llm) -> None:
    """Stop the engine-core and worker processes of an LLM now (not at interpreter exit)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # older/newer layouts: fall back to garbage collection
        pass


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="Connector self-check (used by the tests).")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--context-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt", choices=["needle", "lines"], default="needle")
    a = ap.parse_args(argv)
    try:
        selfcheck(a.model_dir, a.out, a.context_tokens, a.max_tokens, prompt_kind=a.prompt)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
