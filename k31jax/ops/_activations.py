"""GLU activations: SiTU-GLU (K3) and SwiGLU (Kimi Linear). Spec architecture.md §8."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def situ_glu(gate: Float[Array, "... F"], up: Float[Array, "... F"], beta_gate: float,
             beta_up: float | None) -> Float[Array, "... F"]:
    """`[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]`, an fp32 island cast back to gate.dtype.

    With `beta_up=None` the up branch is the identity.
    """
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    act = beta_gate * jnp.tanh(g / beta_gate) * jax.nn.sigmoid(g)
    lin = u if beta_up is None else beta_up * jnp.tanh(u / beta_up)
    return (act * lin).astype(gate.dtype)


def swiglu(gate: Float[Array, "... F"], up: Float[Array, "... F"]) -> Float[Array, "... F"]:
    """`silu(g) · u` in fp32, cast back to gate.dtype."""
    g = gate.astype(jnp.float32)
    return (jax.nn.silu(g) * up.astype(jnp.float32)).astype(gate.dtype)


def glu(gate, up, hidden_act: str, beta_gate: float = 4.0, beta_up: float | None = 25.0):
    """Dispatch on the config's `hidden_act` ("situ" or "silu")."""
    if hidden_act == "situ":
        return situ_glu(gate, up, beta_gate, beta_up)
    if hidden_act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act={hidden_act!r}: expected 'situ' or 'silu'")
