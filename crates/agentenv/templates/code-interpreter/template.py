"""The `code-interpreter-v1` template, built with the stock SDK's `Template` builder against an agentenv
server: `base` plus a venv with Jupyter (`jupyter_client`, `ipykernel`) and matplotlib, and our execution
server (`server.py`) on port 49999, started (with a warm kernel) before the snapshot.

    E2B_API_URL=http://127.0.0.1:3000 E2B_API_KEY=... python3 template.py
"""

import os
import sys

from e2b import Template, wait_for_port

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "code-interpreter-v1"
PORT = 49999
VENV = "/opt/code-interpreter"
PACKAGES = ["jupyter_client==8.6.3", "ipykernel==6.29.5", "matplotlib==3.9.2"]


def template():
    return (
        Template(file_context_path=HERE)
        .from_template("base")
        # --no-compile: byte-compiling every module under TCG takes many minutes; the kernel's imports
        # compile what they use (the folder is the user's, so those .pyc files stay, in the snapshot too).
        .run_cmd(
            f"python3 -m venv {VENV} && {VENV}/bin/pip install --no-compile --no-cache-dir --progress-bar off "
            + " ".join(PACKAGES)
            + f" && chown -R user:user {VENV}",
            user="root",
        )
        .copy("server.py", f"{VENV}/server.py")
        .set_start_cmd(f"{VENV}/bin/python {VENV}/server.py", wait_for_port(PORT))
    )


# Kernels with numpy and matplotlib loaded need more than the base template's 256 MiB.
CPU_COUNT = 1
MEMORY_MB = 1024


def build(name=NAME, on_build_logs=None):
    return Template.build(template(), name, cpu_count=CPU_COUNT, memory_mb=MEMORY_MB, on_build_logs=on_build_logs)


if __name__ == "__main__":
    info = build(on_build_logs=lambda e: print(getattr(e, "message", e), file=sys.stderr))
    print(info.template_id)
