"""Issue 17: templates built with the stock SDK's `Template` builder (`Template.build`) in a real guest:
COPY, ENV, RUN (as the default user and as root), WORKDIR and a start command with a ready check; the
sandbox made from the result holds all of it and its start command answers right after create."""

import secrets

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_port


def sh(sbx, cmd):
    r = sbx.commands.run(cmd, timeout=120)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def test_a_built_template_holds_its_files_env_and_running_start_command(server, tmp_path):
    token = secrets.token_hex(6)
    (tmp_path / "hello.txt").write_text(f"hello {token}\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text(f"print('main {token}')\n")
    name = f"tb-{token}"
    t = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("hello.txt", "/home/user/")
        .copy("app", "/opt/app/", mode=0o755)
        .set_envs({"GREETING": f"hi-{token}"})
        .run_cmd("echo $GREETING > /home/user/greeting && whoami > /home/user/builder")
        .run_cmd(f"mkdir -p /srv/www && echo served-{token} > /srv/www/index.html", user="root")
        .set_workdir("/srv/www")
        .set_start_cmd("python3 -m http.server 8123", wait_for_port(8123))
    )
    logs = []
    info = Template.build(t, name, on_build_logs=logs.append)
    messages = [str(getattr(e, "message", e)) for e in logs]
    assert any("RUN echo $GREETING" in m for m in messages), messages
    assert info.template_id

    sbx = Sandbox.create(name, timeout=120)
    try:
        assert sbx.files.read("/home/user/hello.txt") == f"hello {token}\n"
        assert sh(sbx, "stat -c %U /home/user/hello.txt").strip() == "user"
        assert sh(sbx, "python3 /opt/app/main.py").strip() == f"main {token}"
        assert sh(sbx, "stat -c %a /opt/app/main.py").strip() == "755"
        assert sh(sbx, "cat /home/user/greeting").strip() == f"hi-{token}"
        assert sh(sbx, "cat /home/user/builder").strip() == "user"
        # The start command runs in the snapshot: it answers at once, from the WORKDIR it started in.
        assert sh(sbx, "curl -s --max-time 5 http://127.0.0.1:8123/index.html").strip() == f"served-{token}"
    finally:
        sbx.kill()
    # By template id too, and the SDK sees the name.
    sbx = Sandbox.create(info.template_id, timeout=60)
    try:
        assert sbx.files.read("/home/user/hello.txt") == f"hello {token}\n"
    finally:
        sbx.kill()
    if hasattr(Template, "exists"):
        assert Template.exists(name)
        assert not Template.exists(f"missing-{token}")


def test_a_failing_step_fails_the_build_with_its_output(server):
    token = secrets.token_hex(6)
    t = Template().from_template("base").run_cmd("true").run_cmd(f"echo boom-{token} >&2; exit 7")
    logs = []
    with pytest.raises(BuildException, match="exit status 7"):
        Template.build(t, f"tb-fail-{token}", on_build_logs=logs.append)
    assert any(f"boom-{token}" in str(getattr(e, "message", e)) for e in logs)
    with pytest.raises(Exception):
        Sandbox.create(f"tb-fail-{token}", timeout=30)
