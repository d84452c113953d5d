"""Generated kubelet API stubs (regenerate with `python proto/generate.py`)."""
