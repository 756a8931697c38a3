"""CLI of the extraction stage: build prompts, prefill, dump each context's KV cache.

    python -m kv_extraction_hf --task needle --context-tokens 1024 --num-contexts 4 --out DIR
    python -m kv_extraction_hf --generate DIR/needle-1024t-s0-i0.safetensors
    python -m kv_extraction_hf --task longchat --data-path longchat.jsonl --context-tokens 8000 --out DIR

The first writes one safetensors dump per context (K and V ``[num_layers, num_tokens,
num_kv_heads, head_dim]`` in the model's dtype, plus metadata; see kv_extraction_hf.dump)
and an ``index.json`` listing them. The second injects dumps back into the model (checked
against it) and continues generation greedily from the stored question. Errors print one
line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cachegen_common import flags
from kv_extraction_hf.dataflags import add_data_flags, data_map_from_args
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.prompts.base import DATA_PATH_TASKS, TASKS, USER_DATA_TASKS
from kv_extraction_hf.prompts.user_data import check_data_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kv_extraction_hf",
        description="Prefill contexts and dump their KV caches (safetensors), or generate from a dump.",
        epilog="Tasks: " + ", ".join(TASKS) + ". The default model is SmolLM2-135M-Instruct (embedded).")
    flags.add_model(parser)
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the model's own)")
    parser.add_argument("--task", default="needle", help="prompt generator / dataset (default: needle)")
    flags.add_context_tokens(parser, default=1024)
    parser.add_argument("--num-contexts", type=int, default=1, help="number of contexts to dump (default: 1)")
    flags.add_seed(parser, help="prompt seed (default: 0)")
    add_data_flags(parser)
    flags.add_out(parser, help="output folder for the dumps (required unless --generate)")
    parser.add_argument("--generate", nargs="+", metavar="DUMP", default=None,
                        help="inject these dumps into the model and print the greedy continuation")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="with --generate: tokens to generate (default: the task's)")
    return parser


def extract(args) -> list[Path]:
    """Dump ``args.num_contexts`` contexts of ``args.task``; returns the written paths."""
    from tqdm import tqdm

    from kv_extraction_hf.dump import save_kv
    from kv_extraction_hf.extract import check_length, prefill_kv
    from kv_extraction_hf.model import load_model
    from kv_extraction_hf.prompts import build_prompt

    if args.task not in TASKS:
        raise ExtractionError(f"unknown task '{args.task}' (available: {', '.join(TASKS)})")
    if args.num_contexts < 1:
        raise ExtractionError("--num-contexts must be at least 1")
    if args.context_tokens < 1:
        raise ExtractionError("--context-tokens must be at least 1")
    data_map = data_map_from_args(args)
    check_data_flags(args.task, args.data_path, data_map)
    truncate = args.truncate is not False
    if args.task in DATA_PATH_TASKS:  # check the data before loading the model
        from kv_extraction_hf import datasets_loaders

        if args.task == "wikitext2":
            datasets_loaders.load_wikitext2(args.data_path)
        elif args.task in USER_DATA_TASKS:
            datasets_loaders.load_user_data(args.task, args.data_path, data_map)
        else:
            datasets_loaders.load_longbench(args.task, args.data_path)
    bundle = load_model(args.model, args.dtype, log=lambda msg: print(msg, file=sys.stderr))
    check_length(bundle, args.context_tokens)
    out = Path(args.out)
    written, index = [], []
    for i in tqdm(range(args.num_contexts), desc=f"prefill {args.task}", unit="ctx", file=sys.stderr):
        prompt = build_prompt(args.task, bundle.tokenizer, args.context_tokens, args.seed, i, args.data_path,
                              data_map=data_map, truncate=truncate, max_prompt_tokens=bundle.info.max_context)
        check_length(bundle, len(prompt.input_ids) + prompt.max_new_tokens + len(prompt.continuation_ids))
        t0 = time.perf_counter()
        k, v = prefill_kv(bundle, prompt.context_ids)
        prefill_s = time.perf_counter() - t0
        meta = {**bundle.info.as_metadata(), "prompt_name": prompt.name, "task": prompt.task,
                "seed": str(args.seed), "index": str(i), "token_ids": prompt.context_ids,
                "question_ids": prompt.question_ids, "continuation_ids": prompt.continuation_ids,
                "answers": prompt.answers, "metric": prompt.metric,
                "max_new_tokens": str(prompt.max_new_tokens), "prefill_s": f"{prefill_s:.4f}",
                "truncated_from_tokens": prompt.meta.get("truncated_from_tokens")}
        path = save_kv(out / f"{prompt.name}.safetensors", k, v, meta)
        written.append(path)
        index.append({"file": path.name, "prompt_name": prompt.name, "num_tokens": k.shape[1],
                      "truncated_from_tokens": prompt.meta.get("truncated_from_tokens"),
                      "bytes": path.stat().st_size, "prefill_s": round(prefill_s, 4)})
    tmp = out / f".index.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"model": bundle.info.model_id, "weights_hash": bundle.info.weights_hash,
                               "task": args.task, "context_tokens": args.context_tokens, "seed": args.seed,
                               "dumps": index}, indent=1))
    os.replace(tmp, out / "index.json")
    return written


def generate(args) -> None:
    """Inject each dump named by ``args.generate`` and print its greedy continuation."""
    from kv_extraction_hf.dump import load_kv, metadata_ids, metadata_strings
    from kv_extraction_hf.inject import generate_from_kv
    from kv_extraction_hf.model import load_model

    dumps = [load_kv(p) for p in args.generate]  # validate every file before loading the model
    bundle = load_model(args.model, args.dtype, log=lambda msg: print(msg, file=sys.stderr))
    for path, (k, v, meta) in zip(args.generate, dumps, strict=True):
        if meta.get("model_weights_hash") not in (None, bundle.info.weights_hash):
            raise ExtractionError(f"{path} was dumped from other weights ({meta.get('model_id')}) than "
                                  f"{bundle.info.model_id}")
        question = metadata_ids(meta, "question_ids", path) or []
        if not question:
            raise ExtractionError(f"{path} has no question tokens to continue from")
        max_new = args.max_new_tokens or int(meta.get("max_new_tokens", "40")) or 40
        context = metadata_ids(meta, "token_ids", path, max_len=k.shape[1])
        if context is None:
            raise ExtractionError(f"{path} has no token_ids: the context the KV belongs to is unknown")
        out = generate_from_kv(bundle, k, v, context, question, max_new)
        print(json.dumps({"dump": str(path), "answers": metadata_strings(meta, "answers", path),
                          "generated": bundle.tokenizer.decode(out, skip_special_tokens=True)}))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.generate:
            generate(args)
        else:
            if not args.out:
                raise ExtractionError("--out DIR is required to write dumps")
            for path in extract(args):
                print(path)
    except ExtractionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
