"""The shared vocabulary of every entry point, standard library only (no torch, no project
package): one home for what many commands would otherwise spell differently.

- :mod:`cachegen_common.units`: Mbit/s <-> bytes/s (the one conversion).
- :mod:`cachegen_common.flags`: the command-line flags every command shares (``--model``,
  ``--data-path``, ``--out``, ``--seed``, ``--bandwidth-mbps``, ``--link-method``,
  ``--quick``, ``--verbose``, ``--repeats``, ``--context-tokens``, ``--config``), one
  spelling and one meaning each, with the old spellings as hidden aliases.
- :mod:`cachegen_common.config_file`: a command's ``--config FILE`` defaults (read, then parsed
  under the command line).
- :mod:`cachegen_common.header`: the result header (environment, git commit, UTC time).
- :mod:`cachegen_common.files`: the atomic write of every result file and store object, and the
  sha256 of a list of files (a model's weights hash).
- :mod:`cachegen_common.machine`: what sets the numerics of a run (CPU flags, oneDNN ISA).
- :mod:`cachegen_common.kv_config`: the model config's fields that shape K/V (RoPE, windows,
  attention scaling, geometry), canonical: the config part of a stored entry's identity,
  read the same way by the HF path and the vLLM connector.

Every package may import it except ``codec`` (which imports no project package);
``tests/project/test_architecture.py`` checks that it imports no project package itself.
"""
