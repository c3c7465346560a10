//! Record → E2B JSON conversions and list-query parsing.

use std::collections::BTreeMap;

use crate::backend::{NetworkInfo, Sample, SnapshotInfo, TemplateInfo};
use crate::error::ApiError;
use crate::model::{
    CreatedSandbox, Lifecycle, ListedSandbox, NewSandbox, SandboxDetail, SandboxMetric,
    SandboxState, TemplateView,
};
use crate::sandboxes::{CreateRequest, ListFilter, parse_rfc3339_ms, rfc3339_ms};
use crate::store::SandboxRecord;

/// `clientID` of every sandbox (legacy field; one node).
pub const CLIENT_ID: &str = "local";
/// Default page size of `GET /v2/sandboxes`.
pub const DEFAULT_PAGE: usize = 100;

/// The create/connect answer of `rec`; `domain`: the server's sandbox domain (`--sandbox-domain`).
pub fn created(rec: &SandboxRecord, domain: Option<&str>) -> CreatedSandbox {
    CreatedSandbox {
        template_id: rec.template_id.clone(),
        sandbox_id: rec.sandbox_id.clone(),
        client_id: CLIENT_ID.into(),
        envd_version: rec.envd_version.clone(),
        envd_access_token: rec.access_token.clone(),
        alias: rec.alias.clone(),
        domain: domain.map(str::to_string),
        traffic_access_token: Some(crate::keys::traffic_token(&rec.access_token)),
    }
}

pub fn listed(rec: &SandboxRecord) -> ListedSandbox {
    ListedSandbox {
        template_id: rec.template_id.clone(),
        sandbox_id: rec.sandbox_id.clone(),
        client_id: CLIENT_ID.into(),
        envd_version: rec.envd_version.clone(),
        alias: rec.alias.clone(),
        started_at: rfc3339_ms(rec.started_at_ms),
        end_at: rfc3339_ms(rec.end_at_ms),
        cpu_count: rec.cpu_count,
        memory_mb: rec.memory_mb,
        disk_size_mb: rec.disk_mb,
        state: rec.state.into(),
        metadata: rec.metadata.clone(),
        volume_mounts: rec
            .volume_mounts
            .iter()
            .map(|m| crate::model::SandboxVolumeMount {
                name: m.name.clone(),
                path: m.path.clone(),
            })
            .collect(),
    }
}

/// A create request as the lifecycle takes it: E2B's fields checked, its egress rules parsed.
pub fn create_request(req: NewSandbox) -> Result<CreateRequest, ApiError> {
    let network = crate::egress::create_policy(req.allow_internet_access, req.network.as_ref())?;
    let mask_request_host = req
        .network
        .as_ref()
        .and_then(|n| n.mask_request_host.clone())
        .filter(|m| !m.is_empty());
    if let Some(m) = &mask_request_host
        && (m.len() > 255 || !m.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(ApiError::bad_request(
            "network.maskRequestHost: at most 255 visible ASCII characters",
        ));
    }
    let network_asked = req.allow_internet_access == Some(true)
        || req.network.as_ref().is_some_and(|n| n.allow_out.is_some());
    // `{"enabled": true}`, or `true` as older SDKs send it.
    let auto_resume = req.auto_resume.as_ref().is_some_and(|v| {
        v.get("enabled")
            .and_then(|e| e.as_bool())
            .unwrap_or(v.as_bool() == Some(true))
    });
    Ok(CreateRequest {
        template: req.template_id,
        timeout_s: req.timeout,
        metadata: req.metadata.unwrap_or_default(),
        env_vars: req.env_vars.unwrap_or_default(),
        auto_pause: req.auto_pause.unwrap_or(false),
        auto_pause_filesystem: req.auto_pause_memory == Some(false),
        auto_resume,
        network,
        network_asked,
        public_traffic: req.network.as_ref().and_then(|n| n.allow_public_traffic) != Some(false),
        mask_request_host,
        volume_mounts: req
            .volume_mounts
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.name, m.path))
            .collect(),
    })
}

/// Width of the time buckets samples are reported in (E2B's collection interval).
pub const METRIC_BUCKET_S: i64 = 5;

/// Whether a sample taken at `ts` (Unix seconds) belongs to the range `start..=end` (Unix seconds,
/// either open) of `GET /sandboxes/{id}/metrics`: its bucket overlaps the range.
pub fn metric_in_range(ts: i64, start: Option<i64>, end: Option<i64>) -> bool {
    let bucket = ts - ts.rem_euclid(METRIC_BUCKET_S);
    start.is_none_or(|s| bucket + METRIC_BUCKET_S > s) && end.is_none_or(|e| bucket <= e)
}

/// One sample of `GET /sandboxes/{id}/metrics`.
pub fn metric(s: &Sample) -> SandboxMetric {
    let g = &s.guest;
    SandboxMetric {
        timestamp: rfc3339_ms(g.ts as i64 * 1000),
        timestamp_unix: g.ts as i64,
        cpu_count: g.cpu_count,
        cpu_used_pct: g.cpu_used_pct,
        mem_used: g.mem_used,
        mem_total: g.mem_total,
        mem_cache: 0,
        disk_used: g.disk_used,
        disk_total: g.disk_total,
        net_tx_bytes: s.net.map(|n| n.tx_bytes),
        net_rx_bytes: s.net.map(|n| n.rx_bytes),
        net_dropped_packets: s.net.map(|n| n.dropped_packets),
    }
}

pub fn detail(
    rec: &SandboxRecord,
    net: Option<&NetworkInfo>,
    domain: Option<&str>,
) -> SandboxDetail {
    SandboxDetail {
        listed: listed(rec),
        envd_access_token: rec.access_token.clone(),
        domain: domain.map(str::to_string),
        allow_internet_access: net.is_some_and(|n| !n.policy.internet_blocked()),
        network: net.map(crate::egress::view).map(|mut n| {
            n.mask_request_host = rec.mask_request_host.clone();
            n
        }),
        lifecycle: Lifecycle {
            auto_resume: rec.auto_resume,
            on_timeout: if rec.auto_pause { "pause" } else { "kill" }.into(),
        },
    }
}

pub fn snapshot(s: &SnapshotInfo) -> crate::model::SnapshotView {
    crate::model::SnapshotView {
        snapshot_id: s.id.clone(),
        names: s.names.clone(),
        stored_bytes_new: s.stored.as_ref().map(|c| c.bytes_new),
        stored_bytes_data: s.stored.as_ref().map(|c| c.bytes_data),
    }
}

pub fn template(t: &TemplateInfo) -> TemplateView {
    TemplateView {
        template_id: t.id.clone(),
        aliases: t.aliases.clone(),
        cpu_count: t.vcpus,
        memory_mb: u32::try_from(t.memory_mib).unwrap_or(u32::MAX),
        disk_size_mb: u32::try_from(t.disk_mib).unwrap_or(u32::MAX),
        envd_version: t.envd_version.clone(),
        built_at: t.built_at.clone(),
        from_image: t.from_image.clone(),
    }
}

/// A parsed `GET /v2/sandboxes` query.
#[derive(Debug, Default)]
pub struct ListQuery {
    pub filter: ListFilter,
    pub limit: usize,
    pub next_token: Option<String>,
}

/// Parses the list query; `metadata` is itself a URL-encoded `k=v&k2=v2` string (decoded twice).
/// The order is newest first unless `order=asc`, as E2B's.
pub fn parse_list_query(raw: Option<&str>) -> Result<ListQuery, ApiError> {
    let mut q = ListQuery {
        limit: DEFAULT_PAGE,
        ..Default::default()
    };
    q.filter.descending = true;
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "state" => {
                let mut states: Vec<SandboxState> = Vec::new();
                for s in v.split(',').filter(|s| !s.is_empty()) {
                    states.push(match s {
                        "running" => SandboxState::Running,
                        "paused" => SandboxState::Paused,
                        other => {
                            return Err(ApiError::bad_request(format!("unknown state '{other}'")));
                        }
                    });
                }
                q.filter
                    .states
                    .get_or_insert_with(Vec::new)
                    .extend(states.into_iter().map(crate::sandboxes::SandboxState::from));
            }
            "metadata" => {
                let pairs: BTreeMap<String, String> =
                    form_urlencoded::parse(v.as_bytes()).into_owned().collect();
                q.filter.metadata.extend(pairs);
            }
            "limit" => {
                q.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| {
                        ApiError::bad_request(format!("limit must be 1..=1000, got '{v}'"))
                    })?;
            }
            "nextToken" if !v.is_empty() => q.next_token = Some(v.into_owned()),
            "order" => match v.as_ref() {
                "asc" => q.filter.descending = false,
                "desc" => q.filter.descending = true,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "order must be asc or desc, got '{other}'"
                    )));
                }
            },
            "startedAfter" => {
                q.filter.started_after_ms = Some(parse_rfc3339_ms(&v).ok_or_else(|| {
                    ApiError::bad_request(format!("startedAfter is not RFC 3339: '{v}'"))
                })?);
            }
            "template" => q.filter.template = Some(v.into_owned()),
            _ => {}
        }
    }
    Ok(q)
}

/// Cursor of a record for `x-next-token`.
pub fn page_token(rec: &SandboxRecord) -> String {
    format!("{}_{}", rec.started_at_ms, rec.sandbox_id)
}

/// One page of `sorted` (newest first when `descending`) after `token`; returns the page and the
/// next token (none after the last page).
pub fn paginate(
    sorted: Vec<SandboxRecord>,
    token: Option<&str>,
    limit: usize,
    descending: bool,
) -> Result<(Vec<SandboxRecord>, Option<String>), ApiError> {
    let start = match token {
        None => 0,
        Some(t) => {
            let (ms, id) = t
                .split_once('_')
                .and_then(|(ms, id)| Some((ms.parse::<i64>().ok()?, id)))
                .ok_or_else(|| ApiError::bad_request(format!("invalid nextToken '{t}'")))?;
            match sorted
                .iter()
                .position(|r| r.started_at_ms == ms && r.sandbox_id == id)
            {
                Some(i) => i + 1,
                // The cursor's sandbox is gone: continue after its position in the order.
                None => sorted
                    .iter()
                    .position(|r| {
                        let k = (r.started_at_ms, r.sandbox_id.as_str());
                        if descending {
                            k < (ms, id)
                        } else {
                            k > (ms, id)
                        }
                    })
                    .unwrap_or(sorted.len()),
            }
        }
    };
    let rest: Vec<SandboxRecord> = sorted.into_iter().skip(start).collect();
    let more = rest.len() > limit;
    let page: Vec<SandboxRecord> = rest.into_iter().take(limit).collect();
    let next = if more {
        page.last().map(page_token)
    } else {
        None
    };
    Ok((page, next))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RECORD_VERSION;
    use rand::Rng;

    fn rec(i: usize) -> SandboxRecord {
        SandboxRecord {
            version: RECORD_VERSION,
            sandbox_id: format!("sbx{i:04}"),
            template_id: "base".into(),
            alias: None,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            started_at_ms: 1000 + i as i64,
            end_at_ms: 0,
            state: crate::sandboxes::SandboxState::Running,
            auto_pause: false,
            auto_resume: false,
            access_token: String::new(),
            cpu_count: 1,
            memory_mb: 1,
            disk_mb: 1,
            envd_version: "0.5.7".into(),
            paused_at_ms: None,
            owner: crate::tenants::DEFAULT_TENANT.into(),
            auto_pause_memory: true,
            paused_filesystem: false,
            public_traffic: false,
            mask_request_host: None,
            volume_mounts: vec![],
        }
    }

    #[test]
    fn query_decodes_metadata_twice_and_states() {
        let q = parse_list_query(Some(
            "state=running%2Cpaused&metadata=user%3Dalice%26app%3Dx%2520y&limit=7&order=desc",
        ))
        .unwrap();
        assert_eq!(
            q.filter.states,
            Some(vec![
                crate::sandboxes::SandboxState::Running,
                crate::sandboxes::SandboxState::Paused
            ])
        );
        assert_eq!(
            q.filter.metadata.get("user").map(String::as_str),
            Some("alice")
        );
        assert_eq!(
            q.filter.metadata.get("app").map(String::as_str),
            Some("x y")
        );
        assert_eq!(q.limit, 7);
        assert!(q.filter.descending);
        assert!(parse_list_query(Some("state=dead")).is_err());
        assert!(parse_list_query(Some("limit=0")).is_err());
        assert!(parse_list_query(Some("startedAfter=nope")).is_err());
    }

    #[test]
    fn a_sample_is_in_a_range_its_bucket_overlaps() {
        let ts = rand::random_range(1_000_000_000..2_000_000_000i64);
        let b = ts - ts.rem_euclid(METRIC_BUCKET_S);
        assert!(metric_in_range(ts, None, None));
        assert!(metric_in_range(ts, Some(ts - 60), Some(ts)));
        assert!(
            metric_in_range(ts, Some(ts), Some(b)),
            "the bucket's start ends the range"
        );
        assert!(
            !metric_in_range(ts, Some(ts - 3600), Some(ts - 1800)),
            "an hour before"
        );
        assert!(
            !metric_in_range(ts, Some(b + METRIC_BUCKET_S), None),
            "after its bucket"
        );
        assert!(!metric_in_range(ts, None, Some(b - 1)));
    }

    #[test]
    fn pages_cover_everything_once() {
        let mut rng = rand::rng();
        for _ in 0..20 {
            let n = rng.random_range(0..40);
            let limit = rng.random_range(1..10);
            let descending = rng.random_bool(0.5);
            let mut all: Vec<SandboxRecord> = (0..n).map(rec).collect();
            if descending {
                all.reverse();
            }
            let mut seen = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let (page, next) =
                    paginate(all.clone(), token.as_deref(), limit, descending).unwrap();
                assert!(page.len() <= limit);
                seen.extend(page.into_iter().map(|r| r.sandbox_id));
                match next {
                    Some(t) => token = Some(t),
                    None => break,
                }
            }
            let want: Vec<String> = all.iter().map(|r| r.sandbox_id.clone()).collect();
            assert_eq!(seen, want);
        }
        assert!(paginate(vec![rec(1)], Some("garbage"), 5, true).is_err());
        assert!(
            parse_list_query(None).unwrap().filter.descending,
            "newest first, as E2B"
        );
        assert!(
            !parse_list_query(Some("order=asc"))
                .unwrap()
                .filter
                .descending
        );
    }
}

/// Query of `GET /snapshots`.
#[derive(Debug, Default)]
pub struct SnapshotQuery {
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    pub limit: usize,
    pub next_token: Option<String>,
}

/// Parses `sandboxID`, `name`, `limit` (1..=1000, default 100) and `nextToken`.
pub fn parse_snapshot_query(raw: Option<&str>) -> Result<SnapshotQuery, ApiError> {
    let mut q = SnapshotQuery {
        limit: DEFAULT_PAGE,
        ..Default::default()
    };
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "sandboxID" => q.sandbox_id = Some(v.into_owned()),
            "name" => q.name = Some(v.into_owned()),
            "nextToken" => q.next_token = Some(v.into_owned()),
            "limit" => {
                q.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| ApiError::bad_request(format!("invalid limit '{v}' (1-1000)")))?
            }
            _ => {}
        }
    }
    Ok(q)
}

/// A build request's steps as the builder takes them; a malformed step is a 400 that names it.
pub fn build_plan(
    req: crate::model::TemplateBuildStartV2,
) -> Result<crate::sandboxes::BuildPlan, ApiError> {
    use crate::sandboxes::Step;
    let mut steps = Vec::with_capacity(req.steps.len());
    for (i, s) in req.steps.into_iter().enumerate() {
        let bad = |why: &str| ApiError::bad_request(format!("step {} ({}): {why}", i + 1, s.kind));
        let arg = |n: usize| s.args.get(n).filter(|a| !a.is_empty()).cloned();
        let user = |n: usize| -> Result<Option<String>, ApiError> {
            match arg(n) {
                Some(u)
                    if !u
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-:".contains(&b)) =>
                {
                    Err(bad("a user is [A-Za-z0-9_.-], optionally :group"))
                }
                u => Ok(u),
            }
        };
        steps.push(match s.kind.as_str() {
            "RUN" => Step::Run {
                cmd: arg(0).ok_or_else(|| bad("no command"))?,
                user: user(1)?,
            },
            "COPY" => {
                let src = arg(0).ok_or_else(|| bad("no source"))?;
                if src.starts_with('/') || src.split('/').any(|c| c == "..") {
                    return Err(bad("the source is a path inside the build context"));
                }
                let mode = match arg(3) {
                    Some(m) => Some(u32::from_str_radix(&m, 8).map_err(|_| bad("mode is octal"))?),
                    None => None,
                };
                Step::Copy {
                    src,
                    dest: arg(1).ok_or_else(|| bad("no destination"))?,
                    user: user(2)?,
                    mode,
                    files_hash: s.files_hash.clone().ok_or_else(|| bad("no filesHash"))?,
                }
            }
            "ENV" => {
                if s.args.is_empty() || s.args.len() % 2 != 0 {
                    return Err(bad("ENV takes name, value pairs"));
                }
                let kv: Vec<(String, String)> = s
                    .args
                    .chunks(2)
                    .map(|c| (c[0].clone(), c[1].clone()))
                    .collect();
                let name_ok = |k: &str| {
                    !k.is_empty()
                        && !k.starts_with(|c: char| c.is_ascii_digit())
                        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                };
                if !kv.iter().all(|(k, _)| name_ok(k)) {
                    return Err(bad("a variable name is [A-Za-z_][A-Za-z0-9_]*"));
                }
                Step::Env(kv)
            }
            "WORKDIR" => Step::Workdir(arg(0).ok_or_else(|| bad("no folder"))?),
            "USER" => Step::User(user(0)?.ok_or_else(|| bad("no user"))?),
            _ => return Err(bad("unsupported step type (RUN, COPY, ENV, WORKDIR, USER)")),
        });
    }
    Ok(crate::sandboxes::BuildPlan {
        from_template: req.from_template.filter(|t| !t.is_empty()),
        from_image: req.from_image.filter(|t| !t.is_empty()),
        steps,
        start_cmd: req.start_cmd.filter(|c| !c.trim().is_empty()),
        ready_cmd: req.ready_cmd.filter(|c| !c.trim().is_empty()),
    })
}

fn log_entry(e: &crate::sandboxes::LogEntry) -> crate::model::BuildLogEntry {
    use crate::sandboxes::LogLevel;
    crate::model::BuildLogEntry {
        timestamp: rfc3339_ms(e.at_ms),
        message: e.message.clone(),
        level: match e.level {
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
        .into(),
        step: e.step.clone(),
    }
}

/// A build's status answer.
pub fn build_info(v: &crate::sandboxes::BuildView) -> crate::model::TemplateBuildInfo {
    use crate::sandboxes::BuildStatus;
    crate::model::TemplateBuildInfo {
        logs: vec![],
        log_entries: v.logs.iter().map(log_entry).collect(),
        template_id: v.template_id.clone(),
        build_id: v.build_id.clone(),
        status: match v.status {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
        .into(),
        reason: v.failure.as_ref().map(|f| crate::model::BuildStatusReason {
            message: f.message.clone(),
            step: f.step.clone(),
            log_entries: vec![],
        }),
    }
}
