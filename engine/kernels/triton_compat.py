"""Triton's interpreter (TRITON_INTERPRET=1: the kernels on CPU tensors, how the CPU suite
checks them) with NumPy 2.4 and later: Triton 3.6 turns a loop bound into an int with
int(ndarray), which NumPy now refuses for its one-element arrays ("only 0-dimensional
arrays can be converted"). Compiled kernels never take this path; under the interpreter the
bound is read as the element it is. Applied once, when a kernel is first built there."""
from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """Triton's interpreter is on: its kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def patch_interpreter() -> None:
    if not interpreting():
        return
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patch_index(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_index
