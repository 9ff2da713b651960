"""JAX frontend (planned: see the JAX issue)."""
