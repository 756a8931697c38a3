"""Measure the lossless task score of a model: prefill each context, inject its KV, generate.

Used to choose task variants and sizes on which the model's lossless score is clearly
above chance (docs/tasks.md records the results), since a quality column is only
informative when the uncompressed KV already gets answers right.

    python -m bench.taskcheck --task needle --context-tokens 1024 --num-contexts 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cachegen_common import flags
from kv_extraction_hf.errors import run_cli


def run(task: str, context_tokens: int, num_contexts: int, seed: int = 0, model=None, data_path=None,
        verbose: bool = False, bundle=None, **prompt_kwargs) -> dict:
    """Score ``num_contexts`` prompts of ``task`` from the lossless injected KV. Returns a dict
    with the mean score (accuracy / F1, or perplexity for ppl tasks) and per-prompt records."""
    import torch

    from evaluation import get_metric
    from kv_extraction_hf import prompts as P
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits, generate_from_kv
    from kv_extraction_hf.model import load_model

    bundle = bundle or load_model(model, log=lambda m: print(m, file=sys.stderr))
    builders = {"needle": P.needle_prompt, "longchat_lines": P.longchat_lines_prompt,
                "topic_retrieval": P.topic_retrieval_prompt}
    records = []
    t0 = time.perf_counter()
    for i in range(num_contexts):
        if prompt_kwargs:
            prompt = builders[task](bundle.tokenizer, context_tokens, seed, i, **prompt_kwargs)
        else:
            prompt = P.build_prompt(task, bundle.tokenizer, context_tokens, seed, i, data_path)
        k, v = prefill_kv(bundle, prompt.context_ids)
        if prompt.metric == "perplexity":
            logits = continuation_logits(bundle, k, v, prompt.context_ids, prompt.continuation_ids)
            score = float(get_metric("perplexity").fn(logits, torch.tensor(prompt.continuation_ids)))
            text = ""
        else:
            out = generate_from_kv(bundle, k, v, prompt.context_ids, prompt.question_ids, prompt.max_new_tokens)
            text = bundle.tokenizer.decode(out, skip_special_tokens=True)
            if prompt.metric == "qa_f1":
                score = float(get_metric("qa_f1").fn(text, prompt.answers))
            else:
                score = float(bool(get_metric("retrieval_accuracy").fn(text, prompt.answer)))
        rec = {"name": prompt.name, "tokens": len(prompt.context_ids), "answer": prompt.answer,
               "score": score, "generated": text, **prompt.meta}
        records.append(rec)
        if verbose:
            print(json.dumps(rec), file=sys.stderr)
    mean = sum(r["score"] for r in records) / len(records)
    return {"task": task, "context_tokens": context_tokens, "num_contexts": num_contexts, "seed": seed,
            "model": bundle.info.model_id, "mean_score": mean, "metric": prompt.metric,
            "seconds": round(time.perf_counter() - t0, 1), "variant": prompt_kwargs, "records": records}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.taskcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="needle")
    flags.add_context_tokens(parser, nargs="+", default=[1024],
                             help="context sizes, tokens (default %(default)s)")
    parser.add_argument("--num-contexts", type=int, default=6)
    flags.add_seed(parser)
    flags.add_model(parser)
    flags.add_data_path(parser, help="your data for tasks longchat / longbench / jsonl (JSONL file)")
    parser.add_argument("--index-style", default=None, help="longchat_lines: int or words")
    parser.add_argument("--turn-tokens", type=int, default=None, help="topic_retrieval: tokens per reply")
    flags.add_verbose(parser, help="print every record")
    args = parser.parse_args(argv)
    kwargs = {}
    if args.index_style:
        kwargs["index_style"] = args.index_style
    if args.turn_tokens:
        kwargs["turn_tokens"] = args.turn_tokens

    def run_all() -> None:
        from kv_extraction_hf.model import load_model

        bundle = load_model(args.model, log=lambda m: print(m, file=sys.stderr))
        for size in args.context_tokens:
            res = run(args.task, size, args.num_contexts, args.seed, data_path=args.data_path,
                      verbose=args.verbose, bundle=bundle, **kwargs)
            summary = {k: v for k, v in res.items() if k != "records"}
            extra = ""
            if res["records"] and "num_lines" in res["records"][0]:
                extra = f" lines={[r['num_lines'] for r in res['records']]}"
            if res["records"] and "num_topics" in res["records"][0]:
                extra = f" topics={[r['num_topics'] for r in res['records']]}"
            print(json.dumps(summary) + extra, flush=True)

    return run_cli(run_all)


if __name__ == "__main__":
    sys.exit(main())
