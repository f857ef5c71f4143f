"""A faster ``tl.reduce`` with a user combine in Triton's interpreter (TRITON_INTERPRET=1), same values.

Triton's interpreter runs a reduction whose combine is not one of its own (the GDN recurrence's
``_fma_pair``, gdn_verify/kernel.py) one *element* at a time: for a (BK, BV) tile it calls the combine
BK · BV times on scalars, which made the CPU GDN kernel tests about three times slower with ``fma`` on
(under the interpreter it is now off unless asked: gdn_log.default_fma; tests/test_runtime_gdn_fma.py
asks). Every combine Triton accepts is elementwise, so the same left-to-right chain along the axis can
run one *slice* at a time instead: BK calls on (BV,) arrays. Each output
element sees exactly the arithmetic, in exactly the order, the per-element loop gives it
(``tests/test_interpreter_reduce.py`` compares the two bit for bit).

:func:`vectorize_interpreter_reductions` swaps the loop in (the test suite's conftest calls it). It
changes nothing on a GPU, nor in a Triton whose interpreter is laid out differently (then it does
nothing, and the reductions stay correct, only slow).
"""

from __future__ import annotations

import numpy as np

_PATCHED = "_dflash2_vectorized"


def _sliced_generic_reduce(original):
    """A ReduceOps.generic_reduce that combines whole slices along the axis (falls back to ``original``
    for a reduction over all axes or to a scalar, where there is nothing to vectorise)."""

    def generic_reduce(self, input):
        import triton.language as tl

        shape = input[0].handle.data.shape
        if self.axis is None or len(shape) < 2:
            return original(self, input)
        axis = self.axis
        data = [arg.handle.data for arg in input]
        out_shape = shape[:axis] + shape[axis + 1 :]
        acc = [np.take(d, 0, axis=axis) for d in data]
        for i in range(1, shape[axis]):
            acc_t = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input))
            in_t = tuple(self.to_tensor(np.take(d, i, axis=axis), arg.dtype) for d, arg in zip(data, input))
            ret = self.combine_fn.fn(*acc_t, *in_t)
            ret = ret if isinstance(ret, tuple) else (ret,)
            # a combine may return a scalar (e.g. a constant tag): broadcast it over the slice, as the
            # per-element loop stores it into every element
            acc = [
                np.broadcast_to(np.asarray(r.handle.data if isinstance(r, tl.core.tensor) else r), out_shape)
                .astype(d.dtype)
                .copy()
                for r, d in zip(ret, data)
            ]
        out = []
        for a, arg in zip(acc, input):
            out.append(self.to_tensor(np.expand_dims(a, axis) if self.keep_dims else a, arg.dtype))
        return out

    setattr(generic_reduce, _PATCHED, True)
    generic_reduce.__wrapped__ = original  # the per-element loop, for the test that compares the two
    return generic_reduce


def vectorize_interpreter_reductions() -> bool:
    """Make the interpreter's user-combine reductions slice-wise (idempotent); True when it is in place."""
    try:
        from triton.runtime.interpreter import ReduceOps
    except ImportError:  # a Triton without this interpreter layout: leave it as it is
        return False
    current = getattr(ReduceOps, "generic_reduce", None)
    if current is None:
        return False
    if not getattr(current, _PATCHED, False):
        ReduceOps.generic_reduce = _sliced_generic_reduce(current)
    return True
