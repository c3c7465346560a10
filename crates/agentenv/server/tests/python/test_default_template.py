"""Issue 17: the default `base` template has what an agent expects (Debian bookworm packages), through the
stock `e2b` SDK in a real guest. Commands run as `user` unless they say otherwise."""

import re
import secrets

from e2b import CommandExitException

SLOW = 300  # seconds: first runs of node, npm and gcc are slow under TCG


def run(sbx, cmd, **kw):
    kw.setdefault("timeout", SLOW)
    try:
        r = sbx.commands.run(cmd, **kw)
    except CommandExitException as e:
        raise AssertionError(f"{cmd!r} exited {e.exit_code}: stdout {e.stdout!r} stderr {e.stderr!r}") from e
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def test_python_pip_venv(sandbox):
    a, b = secrets.randbelow(10**6), secrets.randbelow(10**6)
    assert run(sandbox, f"python3 -c 'print({a} * {b})'").strip() == str(a * b)
    assert run(sandbox, f"python -c 'print({a} + {b})'").strip() == str(a + b)
    assert re.match(r"pip \d+\.\d+.* \(python 3\.\d+\)", run(sandbox, "pip --version"))
    venv = f"/home/user/venv-{secrets.token_hex(4)}"
    run(sandbox, f"python3 -m venv {venv}")
    assert run(sandbox, f"{venv}/bin/python -c 'import sys; print(sys.prefix)'").strip() == venv
    assert re.match(rf"pip \d+\.\d+.* from {venv}/", run(sandbox, f"{venv}/bin/pip --version"))
    # HTTPS clients find the CA bundle.
    out = run(sandbox, "python3 -c 'import ssl; print(ssl.get_default_verify_paths().openssl_cafile)'")
    assert run(sandbox, f"test -s {out.strip()} && echo ok").strip() == "ok"


def test_node_npm(sandbox):
    n = secrets.randbelow(10**9)
    assert run(sandbox, f"node -e 'console.log(JSON.stringify({{n: {n} * 2}}))'").strip() == f'{{"n":{n * 2}}}'
    assert re.fullmatch(r"\d+\.\d+\.\d+\n", run(sandbox, "npm --version"))
    assert re.fullmatch(r"v\d+\.\d+\.\d+\n", run(sandbox, "node --version"))


def test_git_commit_as_user(sandbox):
    msg = f"first-{secrets.token_hex(4)}"
    out = run(
        sandbox,
        "set -e; mkdir -p ~/repo && cd ~/repo && git init -q && "
        "git config user.email agent@example.com && git config user.name Agent && "
        f"echo {msg} > f.txt && git add f.txt && git commit -q -m {msg} && "
        "git log --format='%s|%an|%ae' && stat -c %U .git",
    )
    assert out.split("\n")[:2] == [f"{msg}|Agent|agent@example.com", "user"]


def test_network_tools_present(sandbox):
    # The guest has no network: check the tools run, not downloads.
    assert run(sandbox, "curl --version").startswith("curl ")
    assert run(sandbox, "wget --version").startswith("GNU Wget ")
    assert "/etc/ssl/certs/ca-certificates.crt" in run(sandbox, "ls /etc/ssl/certs/ca-certificates.crt")
    out = run(sandbox, "ip addr")
    assert re.search(r"^1: lo: <", out, re.M), out


def test_jq_unzip_procps(sandbox):
    xs = [secrets.randbelow(1000) for _ in range(5)]
    assert run(sandbox, f"echo '{{\"a\": {xs}}}' | jq '.a | add'").strip() == str(sum(xs))
    name = secrets.token_hex(4)
    run(
        sandbox,
        f"cd /tmp && echo {name} > {name}.txt && python3 -m zipfile -c {name}.zip {name}.txt && "
        f"rm {name}.txt && unzip -q {name}.zip",
    )
    assert run(sandbox, f"cat /tmp/{name}.txt").strip() == name
    h = sandbox.commands.run("sleep 123", background=True)
    try:
        ps = run(sandbox, "ps -e -o pid=,args=")
        assert re.search(rf"^\s*{h.pid} sleep 123$", ps, re.M), ps
        assert re.search(r"^\s*1 ", ps, re.M), ps
    finally:
        sandbox.commands.kill(h.pid)
    assert re.search(r"^Mem:\s+\d+", run(sandbox, "free -m"), re.M)


def test_gcc_compiles_c(sandbox):
    k = secrets.randbelow(10**6)
    src = '#include <stdio.h>\n#include <stdlib.h>\nint main(int c, char **v) { printf("%ld\\n", 3 * atol(v[1])); }\n'
    sandbox.files.write("/home/user/triple.c", src)
    run(sandbox, "gcc -O2 -Wall -o /home/user/triple /home/user/triple.c")
    assert run(sandbox, f"/home/user/triple {k}").strip() == str(3 * k)
    assert run(sandbox, "make --version").startswith("GNU Make ")


def test_sudo_as_user(sandbox):
    assert run(sandbox, "whoami").strip() == "user"
    run(sandbox, "sudo -n true")
    assert run(sandbox, "sudo -n id -u").strip() == "0"
    f = f"/root/{secrets.token_hex(4)}"
    run(sandbox, f"sudo -n sh -c 'echo x > {f}'")
    assert run(sandbox, f"cat {f}", user="root").strip() == "x"
    # Without sudo, user stays unprivileged.
    try:
        sandbox.commands.run("touch /root/nope", timeout=SLOW)
        raise AssertionError("user could write to /root")
    except CommandExitException as e:
        assert "Permission denied" in e.stderr
