//! Templates the server builds itself on first use: `code-interpreter-v1`, the template that
//! `e2b_code_interpreter` creates by default (its sources: `crates/agentenv/templates/code-interpreter`),
//! and `httpbin`, an HTTP echo server on port 8080 like the one E2B's SDK tests start as a sidecar
//! (`crates/agentenv/templates/httpbin`).
//! A create that names it before the caller's tenant has it starts its build (one at a time per
//! tenant; its log goes to the server log) and waits for it up to [`FIRST_USE_WAIT`]; past that it
//! answers 503 saying the build goes on, and a create after the build gets the template at once.
//! The build is tagged with a digest of its plan: a server whose plan changed rebuilds the template
//! in the background on its next create (the old one serves meanwhile); a `code-interpreter-v1` the
//! tenant built itself (no such tag) is left alone.

use super::*;

/// The code interpreter's template name.
pub const CODE_INTERPRETER: &str = "code-interpreter-v1";
/// The echo server's template name.
pub const HTTPBIN: &str = "httpbin";
const HTTPBIN_PY: &str = include_str!("../../../templates/httpbin/server.py");
/// How long a create waits for a build it started or found running (E2B's SDKs give a create 60 s).
pub const FIRST_USE_WAIT: Duration = Duration::from_secs(50);
/// Our execution server (Jupyter kernels behind E2B's HTTP API on port 49999).
const SERVER_PY: &str = include_str!("../../../templates/code-interpreter/server.py");
const VENV: &str = "/opt/code-interpreter";
const PORT: u16 = 49999;
/// From PyPI at build time, in the guest. `e2b-charts` is E2B's chart extraction (the `chart` result).
const PACKAGES: &str = "jupyter_client==8.6.3 ipykernel==6.29.5 bash_kernel==0.10.0 \
     matplotlib==3.10.3 pandas==2.2.3 e2b-charts==1.0.0";
/// Deno (its own Jupyter kernel runs JavaScript and TypeScript), from npm's registry as its npm
/// package ships it, checked against the registry's SHA-512.
const DENO_URL: &str =
    "https://registry.npmjs.org/@deno/linux-x64-glibc/-/linux-x64-glibc-2.9.6.tgz";
const DENO_SHA512: &str = "de67784ca2c2bb3b0b0e67cea02e4a37b34065ac525643209bae2f83a7e80f4d090400c2a584b6ff942a5dfce09cfe59433de22cff6f05026d120735d7a380a1";
const DENO_KERNEL: &str = r#"{"argv": ["/opt/deno/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "Deno", "language": "typescript", "env": {"DENO_NO_UPDATE_CHECK": "1", "NO_COLOR": "1"}}"#;
/// Java: JShell in a JVM per context, driven by our `K3JShell` (E2B's template runs IJava, which only
/// GitHub publishes); the JDK from Debian.
const K3JSHELL_JAVA: &str = include_str!("../../../templates/code-interpreter/K3JShell.java");
/// R and IRkernel from Debian (E2B's template takes them from CRAN).
const R_KERNEL: &str = r#"{"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], "display_name": "R", "language": "R"}"#;
/// Kernels with numpy, pandas and matplotlib loaded need more than the base's 256 MiB.
const SIZE: BuildSize = BuildSize {
    vcpus: Some(1),
    memory_mib: Some(1024),
};

/// The build of `code-interpreter-v1`: `base`, a venv with Jupyter's Python and bash kernels, Deno
/// (JavaScript, TypeScript), R with IRkernel, a JDK with `K3JShell` (Java), and
/// the server started as root (as E2B's runs) with a warm Python kernel before the snapshot.
fn code_interpreter_plan() -> BuildPlan {
    use base64::Engine as _;
    let server = base64::engine::general_purpose::STANDARD.encode(SERVER_PY);
    let deno_kernel = base64::engine::general_purpose::STANDARD.encode(DENO_KERNEL);
    let r_kernel = base64::engine::general_purpose::STANDARD.encode(R_KERNEL);
    let jshell = base64::engine::general_purpose::STANDARD.encode(K3JSHELL_JAVA);
    let root = Some("root".to_string());
    BuildPlan {
        steps: vec![
            // --no-compile: byte-compiling every module under TCG takes minutes; imports compile
            // what they use.
            Step::Run {
                cmd: format!(
                    "python3 -m venv {VENV} && {VENV}/bin/pip install --no-compile --no-cache-dir \
                     --progress-bar off {PACKAGES} && {VENV}/bin/python -m bash_kernel.install --sys-prefix"
                ),
                user: root.clone(),
            },
            Step::Run {
                cmd: format!(
                    "mkdir -p /opt/deno {VENV}/share/jupyter/kernels/deno && cd /opt/deno && \
                     curl -fsSL --retry 3 -o deno.tgz {DENO_URL} && echo '{DENO_SHA512}  deno.tgz' | sha512sum -c - && \
                     tar xzf deno.tgz --strip-components=1 package/deno && rm deno.tgz && \
                     echo {deno_kernel} | base64 -d > {VENV}/share/jupyter/kernels/deno/kernel.json"
                ),
                user: root.clone(),
            },
            Step::Run {
                cmd: format!(
                    "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                     --no-install-recommends r-base-core r-cran-irkernel openjdk-17-jdk-headless && \
                     rm -rf /var/lib/apt/lists/* && \
                     mkdir -p {VENV}/share/jupyter/kernels/ir && \
                     echo {r_kernel} | base64 -d > {VENV}/share/jupyter/kernels/ir/kernel.json"
                ),
                user: root.clone(),
            },
            Step::Run {
                cmd: format!(
                    "mkdir -p {VENV}/java && cd {VENV}/java && echo {jshell} | base64 -d > K3JShell.java && \
                     javac -J-XX:TieredStopAtLevel=1 -J-XX:+UseSerialGC K3JShell.java"
                ),
                user: root.clone(),
            },
            Step::Run {
                cmd: format!("echo {server} | base64 -d > {VENV}/server.py"),
                user: root,
            },
            Step::User("root".into()),
            Step::Workdir("/home/user".into()),
        ],
        // Started again if it dies, as E2B's systemd units do.
        start_cmd: Some(format!(
            "sh -c 'while true; do {VENV}/bin/python {VENV}/server.py; sleep 1; done'"
        )),
        ready_cmd: Some(format!("ss -tuln | grep :{PORT}")),
        ..BuildPlan::default()
    }
}

/// The build of `httpbin`: `base` with the echo server started as `user`.
fn httpbin_plan() -> BuildPlan {
    use base64::Engine as _;
    let server = base64::engine::general_purpose::STANDARD.encode(HTTPBIN_PY);
    BuildPlan {
        steps: vec![Step::Run {
            cmd: format!(
                "mkdir -p /opt/httpbin && echo {server} | base64 -d > /opt/httpbin/server.py"
            ),
            user: Some("root".to_string()),
        }],
        start_cmd: Some(
            "sh -c 'while true; do python3 /opt/httpbin/server.py 8080; sleep 1; done'".into(),
        ),
        ready_cmd: Some("ss -tuln | grep :8080".into()),
        ..BuildPlan::default()
    }
}

/// A template built on first use.
struct Builtin {
    name: &'static str,
    plan: fn() -> BuildPlan,
    size: BuildSize,
    /// Its build's rough length under TCG, for the 503 that says to come back.
    minutes: u32,
}

const BUILTINS: [Builtin; 2] = [
    Builtin {
        name: CODE_INTERPRETER,
        plan: code_interpreter_plan,
        size: SIZE,
        minutes: 6,
    },
    Builtin {
        name: HTTPBIN,
        plan: httpbin_plan,
        size: BuildSize {
            vcpus: None,
            memory_mib: None,
        },
        minutes: 1,
    },
];

/// `builtin-` and the plan's digest: the tag that says which plan a build ran.
fn plan_tag(plan: &BuildPlan) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{plan:?}"));
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("builtin-{hex}")
}

fn builtin(name: &str) -> Option<&'static Builtin> {
    let n = agentenv_vm::normalize_name(name)?;
    BUILTINS
        .iter()
        .find(|b| n == format!("{}:{}", b.name, agentenv_vm::DEFAULT_TAG))
}

impl Sandboxes {
    /// Makes sure built-in template `name` exists for `caller` before a create from it: nothing for
    /// other names or one already built; else starts its build (or joins the one running) and waits
    /// up to [`FIRST_USE_WAIT`].
    pub async fn ensure_builtin(self: &Arc<Self>, caller: &Caller, name: &str) -> Result<()> {
        let Some(b) = builtin(name) else {
            return Ok(());
        };
        let plan = (b.plan)();
        let tag = plan_tag(&plan);
        if let Some(s) = self.find_snapshot(caller, name) {
            let ours = s.names.iter().find(|n| {
                n.strip_prefix(b.name)
                    .is_some_and(|t| t.starts_with(":builtin-"))
            });
            match ours {
                Some(n) if *n != format!("{}:{tag}", b.name) => {
                    tracing::info!(old = %n, "{} is from another plan: rebuilding it in the background", b.name);
                    self.builtin_build(caller, b, plan, tag)?;
                }
                _ => {}
            }
            return Ok(());
        }
        let (template_id, build_id, started) = self.builtin_build(caller, b, plan, tag)?;
        let name = b.name;
        loop {
            let v = self.build_status(caller, &template_id, &build_id, usize::MAX)?;
            match v.status {
                BuildStatus::Ready => return Ok(()),
                BuildStatus::Error => {
                    let why = v.failure.map(|f| f.message).unwrap_or_default();
                    return Err(LifecycleError::Building(format!(
                        "building {name} on first use failed ({why}); the next create tries again"
                    )));
                }
                BuildStatus::Waiting | BuildStatus::Building => {}
            }
            if started.elapsed() > FIRST_USE_WAIT {
                return Err(LifecycleError::Building(format!(
                    "{name} is being built on first use ({} s so far; about {} minutes under \
                     TCG, progress in the server log): create it again when the build is done",
                    started.elapsed().as_secs(),
                    b.minutes
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The caller's running build of the built-in template, or a new one with its log followed into
    /// the server log. The time is when this call started waiting.
    fn builtin_build(
        self: &Arc<Self>,
        caller: &Caller,
        b: &'static Builtin,
        plan: BuildPlan,
        tag: String,
    ) -> Result<(String, String, Instant)> {
        let now = Instant::now();
        let mut running = self
            .builds
            .builtin
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = format!("{}/{}", caller.owner(), b.name);
        if let Some((t, id)) = running.get(&key) {
            let status = self
                .build_status(caller, t, id, usize::MAX)
                .map(|v| v.status);
            if matches!(status, Ok(BuildStatus::Building | BuildStatus::Waiting)) {
                return Ok((t.clone(), id.clone(), now));
            }
        }
        let tags = [agentenv_vm::DEFAULT_TAG.to_string(), tag];
        let built = self.request_build(caller, b.name, &tags, b.size)?;
        let (t, id) = (built.template_id, built.build_id);
        self.start_build(caller, &t, &id, plan)?;
        tracing::info!(template = %t, build = %id, "building {}", b.name);
        running.insert(key, (t.clone(), id.clone()));
        let name = b.name;
        let (me, who, t2, b2) = (self.clone(), caller.clone(), t.clone(), id.clone());
        tokio::spawn(async move {
            let mut offset = 0;
            while let Ok(v) = me.build_status(&who, &t2, &b2, offset) {
                for l in &v.logs {
                    let step = l.step.as_deref().unwrap_or("");
                    tracing::info!(template = name, step, "{}", l.message);
                }
                offset += v.logs.len();
                if !matches!(v.status, BuildStatus::Building | BuildStatus::Waiting) {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        Ok((t, id, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_default_tag_of_the_name_is_built_in() {
        let name = |n: &str| builtin(n).map(|b| b.name);
        assert_eq!(name(CODE_INTERPRETER), Some(CODE_INTERPRETER));
        assert_eq!(name("code-interpreter-v1:default"), Some(CODE_INTERPRETER));
        assert_eq!(name("httpbin"), Some(HTTPBIN));
        assert_eq!(name("code-interpreter-v1:other"), None);
        assert_eq!(name("code-interpreter"), None);
        assert_eq!(name("httpbin:v2"), None);
    }

    #[test]
    fn the_plan_carries_the_server_and_k3jshell_byte_for_byte() {
        use base64::Engine as _;
        let plan = code_interpreter_plan();
        let carried = |step: usize| {
            let Step::Run { cmd, .. } = &plan.steps[step] else {
                panic!("step {step} runs a command");
            };
            let b64 = cmd
                .split("echo ")
                .nth(1)
                .and_then(|c| c.split(' ').next())
                .expect("echo <base64>");
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .expect("base64")
        };
        assert_eq!(carried(3), K3JSHELL_JAVA.as_bytes());
        assert_eq!(carried(4), SERVER_PY.as_bytes());
        assert!(
            plan.start_cmd
                .as_deref()
                .is_some_and(|c| c.contains("/server.py;"))
        );
        let tag = plan_tag(&plan);
        assert!(agentenv_vm::valid_id(&tag) && tag.starts_with("builtin-"));
        let mut other = plan.clone();
        other.steps.pop();
        assert_ne!(plan_tag(&other), tag, "the tag follows the plan");
        let Step::Run { cmd, .. } = &httpbin_plan().steps[0] else {
            panic!("httpbin's step writes its server");
        };
        let b64 = cmd.split("echo ").nth(1).and_then(|c| c.split(' ').next());
        let decoded = base64::engine::general_purpose::STANDARD.decode(b64.unwrap());
        assert_eq!(decoded.unwrap(), HTTPBIN_PY.as_bytes());
    }
}
