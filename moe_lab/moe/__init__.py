"""The MoE layer and its parts: `layer` (router → dispatcher → experts), `router` (the
reference chain and ``ROUTER_IMPLS``), `router_output` (what every router returns),
`dispatch` (naive, capacity, dropless; ``DISPATCHERS``), `experts` (SwiGLU experts,
``EXPERT_BACKENDS``, each with its token permutation), `balance` (aux-loss-free bias),
`stash` (paged activations)."""
