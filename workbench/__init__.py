"""MoE QAT workbench."""
