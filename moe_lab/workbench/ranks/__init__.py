"""Ranks on one machine or many: `launch` starts them (from Python, a notebook or torchrun)
and fails loudly when one dies or hangs; `netem` puts them behind an emulated network link."""
