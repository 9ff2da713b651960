"""MCR-DL backends: one module per communication library (mpi, gloo, nccl)."""
