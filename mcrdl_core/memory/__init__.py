"""Memory: the DLPack-backed Buffer, host and CUDA temporaries, CUDA streams and
events (CuPy imported only where a GPU buffer is handled). Imports ``base`` and
``engine``."""
