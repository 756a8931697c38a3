"""The figures of ``visualize_results.py``, split by what they read (issue 27).

- :mod:`visualize.data`: reading a results.json into DataFrames (:func:`prepare`), the
  shared plot helpers and :func:`save_figure`;
- :mod:`visualize.results_figures`: the figures of a results.json (:data:`FIGURES`);
- :mod:`visualize.file_figures`: the figures of a quality.json (``bench.quality``) and an
  adaptation.json (``bench.adapt``).

Like the script, it reads result files only: it imports no codec, streaming, engine or
model code (only ``common`` and ``evaluation.summary``), and never selects a matplotlib
backend (``visualize_results.main`` does).
"""
