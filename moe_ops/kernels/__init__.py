"""The Triton kernels of moe_ops, one module per kernel family.

`INTERPRET` is the one reading of TRITON_INTERPRET, taken when moe_ops is imported: Triton
decides at decoration time whether a kernel runs in its CPU interpreter, so every launcher and
the backend choice must agree with that same snapshot. This module imports no triton itself.
"""
import os

# True when the kernels run in Triton's CPU interpreter (CI without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
