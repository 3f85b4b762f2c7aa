"""The config tree (tree.py), reading it from YAML and overrides (load.py), and comparing two
(diff.py)."""
