"""The compile report: every Triton kernel compiled for Hopper and Blackwell without a GPU.
`report` drives it, `worker` compiles in a child process, `reading` reads the binaries."""
