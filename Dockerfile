# moe_lab on a CPU, in a Linux container: the workbook, JupyterLab and the tests wherever Docker
# runs (a Mac or Windows laptop included: Triton's Linux wheels install here, and its kernels
# run under Triton's interpreter). The steps are the Makefile's (README, Where to run it).
#
#   docker build -t moe-lab .
#   docker run --rm -it -p 8888:8888 moe-lab           # JupyterLab on notebooks/, at localhost:8888
#   docker run --rm moe-lab make workbook              # every notebook, headless, into build/
#   docker run --rm moe-lab make test
FROM python:3.11-slim

# make runs the set-up; g++ (with OpenMP) builds the CPU plug-in; git for the project's own checks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /moe_lab
COPY . .
# .venv with the CPU build of torch, the tested set (requirements/ci.txt), the notebook tooling
# and JupyterLab; the CPU plug-in compiled once, into the image.
RUN make install

EXPOSE 8888
CMD [".venv/bin/jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", \
     "--ServerApp.root_dir=notebooks"]
