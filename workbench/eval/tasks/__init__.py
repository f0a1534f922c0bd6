"""lm-eval task YAMLs and their JSONL data shipped with the workbench (package data)."""
