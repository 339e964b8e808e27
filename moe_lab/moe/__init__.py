"""The MoE layer and its parts: `layer` (router → dispatcher → experts), `router` (the
reference chain and ``ROUTER_IMPLS``), `router_output` (what every router returns),
`dispatch` (naive, capacity, dropless; ``DISPATCHERS``, ``PERMUTATIONS``), `experts` (SwiGLU
experts, ``EXPERT_BACKENDS``), `balance` (aux-loss-free bias), `stash` (paged activations)."""
