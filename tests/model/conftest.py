import os

# transformers imports torchao when it is installed; its CUDA extensions only log noise on CPU.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
