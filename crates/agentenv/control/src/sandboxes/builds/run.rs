//! Running a build: a sandbox of the right size from its base, the steps through envd, then the
//! snapshot that becomes the template.

use super::*;

impl Sandboxes {
    pub(super) async fn run_build(
        &self,
        caller: &Caller,
        template_id: &str,
        names: &[String],
        plan: &BuildPlan,
        size: BuildSize,
        log: &BuildLog,
    ) -> StepResult<String> {
        let base = match (&plan.from_template, &plan.from_image) {
            (Some(t), _) => t.clone(),
            (None, None) => BASE.into(),
            (None, Some(i)) if BASE_IMAGES.contains(&i.as_str()) => BASE.into(),
            (None, Some(i)) => self.image_base(caller, i, size, log).await?,
        };
        let base = self.sized_base(caller, base, size, log).await?;
        log.info(Some(BASE_STEP), format!("FROM {base}"));
        if let Some(why) = self.backend.networking_off() {
            log.warn(
                Some(BASE_STEP),
                format!("sandboxes get no network on this server ({why}): steps that download (apt, pip, npm) will fail"),
            );
        }
        let sbx = self
            .create(
                caller,
                super::super::CreateRequest {
                    template: base.clone(),
                    timeout_s: Some(BUILD_DEADLINE.as_secs()),
                    metadata: BTreeMap::from([(BUILD_MARK.into(), template_id.into())]),
                    ..Default::default()
                },
                None,
            )
            .await
            .map_err(|e| fail(BASE_STEP, format!("starting a sandbox from {base}: {e}")))?;
        let id = sbx.sandbox_id.clone();
        let r = self.run_steps(&id, plan, template_id, log).await;
        let r = match r {
            Ok(()) => {
                log.info(Some(FINALIZE_STEP), "Snapshotting the template");
                let mut all = names.to_vec();
                all.push(template_id.into());
                self.snapshot_named(caller, &id, &all, true)
                    .await
                    .map(|s| s.id)
                    .map_err(|e| fail(FINALIZE_STEP, format!("snapshot: {e}")))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = self.kill(caller, &id).await {
            tracing::warn!(sandbox = %id, error = %e, "killing a build sandbox failed");
        }
        r
    }

    /// `base` itself, or, when `size` asks for another machine than the base template's, a base template
    /// of that size (built once, as `base-<vcpus>c-<MiB>m`). Other templates keep their own size.
    async fn sized_base(
        &self,
        caller: &Caller,
        base: String,
        size: BuildSize,
        log: &BuildLog,
    ) -> StepResult<String> {
        let spec = size.spec();
        if base != BASE || spec == crate::backend::TemplateSpec::base() {
            return Ok(base);
        }
        let id = format!("base-{}c-{}m", spec.vcpus, spec.memory_mib);
        let msg = format!(
            "Building the base template with {} vCPUs and {} MiB as {id}",
            spec.vcpus, spec.memory_mib
        );
        let said = (msg, format!("building {id}"));
        self.base_once(
            &Caller::Server,
            caller,
            crate::backend::TemplateSpec { id, ..spec },
            said,
            log,
        )
        .await
    }

    /// A template of image `image` at `size`, this caller's: pulled and built once (`img-<hash>` of
    /// the caller, image and size), then reused by every build from it.
    async fn image_base(
        &self,
        caller: &Caller,
        image: &str,
        size: BuildSize,
        log: &BuildLog,
    ) -> StepResult<String> {
        use sha2::Digest;
        let spec = size.spec();
        let d = sha2::Sha256::digest(
            format!(
                "{}\n{image}\n{}\n{}",
                caller.owner(),
                spec.vcpus,
                spec.memory_mib
            )
            .as_bytes(),
        );
        let id = format!("img-{}", crate::keys::hex(&d[..10]));
        let said = (
            format!("Pulling {image} as {id}"),
            format!("fromImage {image}"),
        );
        let source = crate::backend::ImageSource {
            reference: image.into(),
            username: None,
            password: None,
        };
        let spec = crate::backend::TemplateSpec {
            id,
            from_image: Some(source),
            ..spec
        };
        self.base_once(caller, caller, spec, said, log).await
    }

    /// Template `spec.id` as `viewer` sees it, built by `builder` first where missing; `said`: the
    /// log line before the build and the prefix of its failure.
    async fn base_once(
        &self,
        builder: &Caller,
        viewer: &Caller,
        spec: crate::backend::TemplateSpec,
        said: (String, String),
        log: &BuildLog,
    ) -> StepResult<String> {
        let (msg, what) = said;
        let id = spec.id.clone();
        if self.templates(viewer).iter().any(|t| t.id == id) {
            return Ok(id);
        }
        log.info(Some(BASE_STEP), msg);
        self.build_template(builder, spec, std::sync::Arc::new(|_| {}))
            .await
            .map_err(|e| fail(BASE_STEP, format!("{what}: {e}")))?;
        Ok(id)
    }

    async fn exec(
        &self,
        id: &str,
        req: ExecRequest,
        step: &str,
        log: &BuildLog,
    ) -> StepResult<i32> {
        let mut pending = String::new();
        let deadline = Duration::from_millis(req.timeout_ms.max(1000) + 5000);
        let r = self
            .backend
            .exec(
                id,
                req,
                deadline,
                Box::new(|ev| {
                    let (ExecEvent::Stdout(t) | ExecEvent::Stderr(t)) = ev else {
                        return;
                    };
                    pending.push_str(&t);
                    take_lines(&mut pending, |line| log.info(Some(step), line));
                }),
            )
            .await;
        if !pending.is_empty() {
            log.info(Some(step), pending.trim_end().to_string());
        }
        r.map(|(code, _)| code)
            .map_err(|e| fail(step, e.to_string()))
    }

    async fn run_steps(
        &self,
        id: &str,
        plan: &BuildPlan,
        template_id: &str,
        log: &BuildLog,
    ) -> StepResult<()> {
        let mut cx = Context {
            user: "user".into(),
            cwd: "/home/user".into(),
            envs: BTreeMap::new(),
        };
        let t0 = Instant::now();
        let left = |t0: Instant| BUILD_DEADLINE.saturating_sub(t0.elapsed()).as_millis() as u64;
        let n = plan.steps.len();
        for (i, s) in plan.steps.iter().enumerate() {
            let step = (i + 1).to_string();
            let step = step.as_str();
            let abs = |p: &str| match p.starts_with('/') {
                true => p.to_string(),
                false => format!("{}/{p}", cx.cwd.trim_end_matches('/')),
            };
            let req = |cmd: String, user: &str| ExecRequest {
                cmd,
                user: user.into(),
                cwd: Some(cx.cwd.clone()),
                envs: cx.envs.clone(),
                timeout_ms: left(t0),
                ..Default::default()
            };
            match s {
                Step::Run { cmd, user } => {
                    let user = user.as_deref().unwrap_or(&cx.user);
                    log.info(Some(step), format!("[builder {}/{n}] RUN {cmd}", i + 1));
                    let code = self.exec(id, req(cmd.clone(), user), step, log).await?;
                    if code != 0 {
                        return Err(fail(step, format!("RUN {cmd}: exit status {code}")));
                    }
                }
                Step::Copy {
                    src,
                    dest,
                    user,
                    mode,
                    files_hash,
                } => {
                    log.info(
                        Some(step),
                        format!("[builder {}/{n}] COPY {src} {dest}", i + 1),
                    );
                    let data =
                        std::fs::read(self.file_path(template_id, files_hash)).map_err(|e| {
                            fail(step, format!("COPY {src}: the upload is unreadable: {e}"))
                        })?;
                    let gzip = data.starts_with(&[0x1f, 0x8b]);
                    let owner = user.as_deref().unwrap_or(&cx.user);
                    let mut r = req(copy_script(src, &abs(dest), owner, *mode, gzip), "root");
                    r.stdin_b64 = Some(base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        &data,
                    ));
                    let code = self.exec(id, r, step, log).await?;
                    if code != 0 {
                        return Err(fail(step, format!("COPY {src} {dest}: exit status {code}")));
                    }
                }
                Step::Env(kv) => {
                    log.info(
                        Some(step),
                        format!(
                            "[builder {}/{n}] ENV {}",
                            i + 1,
                            kv.iter()
                                .map(|(k, v)| format!("{k}={v}"))
                                .collect::<Vec<_>>()
                                .join(" ")
                        ),
                    );
                    cx.envs.extend(kv.iter().cloned());
                }
                Step::Workdir(dir) => {
                    log.info(Some(step), format!("[builder {}/{n}] WORKDIR {dir}", i + 1));
                    let dir = abs(dir);
                    let code = self
                        .exec(
                            id,
                            req(
                                format!(
                                    "mkdir -p {d} && chown {u} {d}",
                                    d = sh(&dir),
                                    u = sh(&cx.user)
                                ),
                                "root",
                            ),
                            step,
                            log,
                        )
                        .await?;
                    if code != 0 {
                        return Err(fail(step, format!("WORKDIR {dir}: exit status {code}")));
                    }
                    cx.cwd = dir;
                }
                Step::User(u) => {
                    log.info(Some(step), format!("[builder {}/{n}] USER {u}", i + 1));
                    let code = self
                        .exec(id, req(format!("id -u {}", sh(u)), "root"), step, log)
                        .await?;
                    if code != 0 {
                        return Err(fail(step, format!("USER {u}: no such user")));
                    }
                    cx.user = u.clone();
                }
            }
        }
        let Some(start) = &plan.start_cmd else {
            return Ok(());
        };
        log.info(Some(FINALIZE_STEP), format!("Starting: {start}"));
        let mut r = ExecRequest {
            cmd: start.clone(),
            user: cx.user.clone(),
            cwd: Some(cx.cwd.clone()),
            envs: cx.envs.clone(),
            background: true,
            ..Default::default()
        };
        self.exec(id, r.clone(), FINALIZE_STEP, log).await?;
        let ready = plan.ready_cmd.clone().unwrap_or_else(|| "sleep 1".into());
        log.info(Some(FINALIZE_STEP), format!("Waiting for: {ready}"));
        r.cmd = ready.clone();
        r.background = false;
        let t = Instant::now();
        loop {
            // One try may take what is left of the deadline (`sleep 10` is a ready check too).
            let left = READY_DEADLINE
                .saturating_sub(t.elapsed())
                .max(Duration::from_secs(1));
            r.timeout_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
            if self.exec(id, r.clone(), FINALIZE_STEP, log).await? == 0 {
                return Ok(());
            }
            if t.elapsed() > READY_DEADLINE {
                return Err(fail(
                    FINALIZE_STEP,
                    format!(
                        "the ready check `{ready}` did not pass within {} s",
                        READY_DEADLINE.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
