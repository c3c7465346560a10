"""Figures of the code-interpreter template against a running agentenv server (E2B_API_URL, E2B_API_KEY):
the first create's wait while the server builds `code-interpreter-v1` (`build_s`; near zero when it exists), create
from it and `run_code("1+1")` round trips, medians over --n, each through the stock SDKs; then in one sandbox the first
Java cell (its JVM starts) and the Java round trips after it. Prints one JSON object.

    python3 bench.py --n 10
"""

import argparse
import json
import statistics
import time

from e2b_code_interpreter import Sandbox

NAME = "code-interpreter-v1"


def first_create():
    """Creates until the server's build on first use is done (it answers 503 meanwhile)."""
    while True:
        try:
            return Sandbox.create(timeout=60)
        except Exception as e:
            if "being built" not in str(e):
                raise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10)
    a = p.parse_args()
    out = {"template": NAME, "n": a.n}
    t = time.perf_counter()
    first_create().kill()
    out["build_s"] = round(time.perf_counter() - t, 1)
    creates, runs = [], []
    for _ in range(a.n):
        t = time.perf_counter()
        sbx = Sandbox.create(timeout=120)
        creates.append((time.perf_counter() - t) * 1000)
        try:
            for _ in range(5):
                t = time.perf_counter()
                assert sbx.run_code("1+1").text == "2"
                runs.append((time.perf_counter() - t) * 1000)
        finally:
            sbx.kill()
    out["create_ms_p50"] = round(statistics.median(creates), 1)
    out["run_code_ms_p50"] = round(statistics.median(runs), 1)
    out["run_code_first_ms_p50"] = round(statistics.median(runs[::5]), 1)
    sbx = Sandbox.create(timeout=300)
    try:
        t = time.perf_counter()
        assert sbx.run_code("1 + 1", language="java").text == "2"
        out["java_first_cell_ms"] = round((time.perf_counter() - t) * 1000, 1)
        java = []
        for i in range(5):
            t = time.perf_counter()
            assert sbx.run_code(f"{i} + 1", language="java").text == str(i + 1)
            java.append((time.perf_counter() - t) * 1000)
        out["java_run_code_ms_p50"] = round(statistics.median(java), 1)
    finally:
        sbx.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
