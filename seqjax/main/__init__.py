"""The commands, one module each (prepare, data, train, eval, generate, export, import_hf), what
they share (cli.py: flags, logging, errors as one line and exit code 2) and the
--run/--checkpoint/--hf loader (trained.py). ``python -m seqjax.<command>`` runs them through the
small ``__main__``/top-level modules that name them."""
