"""Suite-wide setup.

Kernel tests run the Triton kernels on the CPU through Triton's interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test module
imports `loraplex.kernels`.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
