"""Measuring: all timing (`timing`), the results ledger (`ledger`), this machine's ceilings
(`ceilings`), a profiled step's breakdown (`breakdown`), the host's cost per operator
(`host_overhead`) and kernel counts (`kernel_count`). Submodules load when imported."""
