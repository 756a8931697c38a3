"""The shared vocabulary of every entry point, standard library only (no torch, no project
package): one home for what many commands would otherwise spell differently.

- :mod:`common.units`: Mbit/s <-> bytes/s (the one conversion).
- :mod:`common.flags`: the command-line flags every command shares (``--model``,
  ``--data-path``, ``--out``, ``--seed``, ``--bandwidth-mbps``, ``--link-method``,
  ``--quick``, ``--verbose``, ``--repeats``, ``--context-tokens``, ``--config``), one
  spelling and one meaning each, with the old spellings as hidden aliases.
- :mod:`common.header`: the result header (environment, git commit, UTC time) and the
  atomic JSON write of every result file.
- :mod:`common.machine`: what sets the numerics of a run (CPU flags, oneDNN ISA).

Every package may import it except ``codec`` (which imports no project package);
``tests/project/test_architecture.py`` checks that it imports no project package itself.
"""
