"""The figures of ``visualize_results.py``, split by what they read.

- :mod:`visualize.loading`: reading result files (results.json, quality.json,
  adaptation.json; stdlib only, shared with scripts/readme_tables.py);
- :mod:`visualize.data`: a results.json as DataFrames (:func:`prepare`), the shared plot
  helpers and :func:`save_figure`;
- :mod:`visualize.results_figures`: the figures of a results.json (:data:`FIGURES`);
- :mod:`visualize.file_figures`: the figure of a quality.json (``bench.quality``) and the
  rendering of both other files;
- :mod:`visualize.adapt_figures`: the figures of an adaptation.json (``bench.adapt``);
- :mod:`visualize.serve_figures`: goodput vs offered rate from serve-load files
  (``bench.serve_load``).

Like the script, it reads result files only: it imports no codec, streaming, engine or
model code (only ``cachegen_common`` and ``evaluation.summary``), and never selects a matplotlib
backend (``visualize_results.main`` does).
"""
