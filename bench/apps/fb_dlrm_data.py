"""Run facebookresearch/dlrm's ``dlrm_s_pytorch.py`` with its random mini-batches made by
whole arrays instead of one sample at a time: the same numbers, drawn in the same order.

    python -m mcrdl_torch.run bench/apps/fb_dlrm_data.py DLRM_CHECKOUT/dlrm_s_pytorch.py ARGS

Why: with ``--data-generation=random`` the program draws each batch inside its training
loop, in Python loops over tables and samples (1.0 s for 2048 samples x 26 tables in
one process here). Its ms/it leaves that out, but where ranks outnumber cores (the
emulated cluster runs 4 ranks on 2) one rank's drawing takes the CPU from another's
step, so the step times it prints swung 285-428 ms/it within one run while each
iteration took 2.3 s of wall time.

What changes: only ``dlrm_data_pytorch.generate_dist_input_batch``, and only for the
case the apps runs use (uniform indices, a fixed number of 1 per lookup, a batch of at
least one sample). There it draws ``rand(n, m_den)`` for the dense features and then,
per table, ``random(n)``: NumPy's legacy generator yields the same doubles for one
``random(n)`` as for ``n`` calls of ``random(1)``, so the batches, and every later
draw, equal the original's bit for bit (``np.unique`` of one index is that index;
offsets are 0..n-1; tests/test_fb_dlrm_data.py). Any other case runs the program's
own function. Training, communication and timing are the
program's, unchanged.
"""
from __future__ import annotations

import os
import runpy
import sys

import numpy as np
import torch


def patch(dp) -> None:
    """Replace ``dp.generate_dist_input_batch`` by its whole-array form (see above)."""
    original = dp.generate_dist_input_batch
    ra = np.random

    def generate(m_den, ln_emb, n, num_indices_per_lookup, num_indices_per_lookup_fixed,
                 rand_data_dist, *rest, **kw):
        if not (num_indices_per_lookup_fixed and num_indices_per_lookup == 1
                and rand_data_dist == "uniform" and n > 0):
            return original(m_den, ln_emb, n, num_indices_per_lookup,
                            num_indices_per_lookup_fixed, rand_data_dist, *rest, **kw)
        dense = torch.tensor(ra.rand(n, m_den).astype(np.float32))
        offsets, indices = [], []
        for size in ln_emb:
            offsets.append(torch.arange(n, dtype=torch.int64))
            indices.append(torch.from_numpy(np.round(ra.random(n) * (size - 1)).astype(np.int64)))
        return dense, offsets, indices

    dp.generate_dist_input_batch = generate


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    script = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.dirname(script))
    import dlrm_data_pytorch

    patch(dlrm_data_pytorch)
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
