"""The compile report: every Triton kernel compiled for Hopper and Blackwell without a GPU.
`specs` says what each kernel module's launches compile, `report` drives it, `worker` compiles
in a child process, `reading` reads the binaries."""
