"""Foundations every layer uses: errors, configuration (every MCRDL_* variable),
dtypes, the op and reduce-op enums, message tags. Imports nothing else of the core."""
