//! `agentenv`: the E2B-compatible sandbox API server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use agentenv_server::app::{self, AppState, DEFAULT_MAX_UPLOAD_BYTES, ServerConfig};
use agentenv_server::{keys, openapi, runtime_backend};

mod keys_cli;
use keys_cli::{KeysCommand, manage_keys};

#[derive(Parser)]
#[command(
    name = "agentenv",
    version,
    about = "E2B-compatible sandbox API server (control and data plane on one port)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server (the default).
    Serve(Box<ServeArgs>),
    /// Print the OpenAPI document.
    Openapi,
    /// One E2B endpoint in front of the nodes of a cluster (state in etcd; run as many as you like).
    Gateway(GatewayArgs),
    /// Named API keys (tenants): each sees and controls only its own sandboxes, snapshots and templates.
    /// Set up etcd's users and roles for a cluster, then turn etcd's auth on. Run as `root` (the
    /// common name of --etcd-cert); a user is a certificate's common name: each node (CN = its
    /// --node-id) writes only its own record and the sandbox map, gateways the cluster's prefix.
    /// Run again to add nodes or gateways.
    EtcdAuth(EtcdAuthArgs),
    Keys {
        /// State folder of the server.
        #[arg(long, env = "AGENTENV_STATE_DIR")]
        state_dir: Option<PathBuf>,
        #[command(subcommand)]
        command: KeysCommand,
    },
}

/// etcd over mutual TLS (`https://` endpoints): all three or none.
#[derive(clap::Args, Clone, Default)]
struct EtcdTlsArgs {
    /// CA certificate (PEM) that signed etcd's certificate.
    #[arg(long, env = "AGENTENV_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// This process's client certificate (PEM); its common name is its etcd user.
    #[arg(long, env = "AGENTENV_ETCD_CERT")]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "AGENTENV_ETCD_KEY")]
    etcd_key: Option<PathBuf>,
}

impl EtcdTlsArgs {
    fn tls(&self) -> anyhow::Result<Option<agentenv_cluster::EtcdTls>> {
        Ok(agentenv_cluster::EtcdTls::from_flags(
            self.etcd_ca.clone(),
            self.etcd_cert.clone(),
            self.etcd_key.clone(),
        )?)
    }
}

#[derive(clap::Args, Clone)]
struct EtcdAuthArgs {
    /// etcd endpoints (comma-separated), e.g. https://127.0.0.1:2379.
    #[arg(long, env = "AGENTENV_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    #[command(flatten)]
    tls: EtcdTlsArgs,
    /// Key prefix of the cluster in etcd.
    #[arg(long, default_value = agentenv_cluster::schema::DEFAULT_PREFIX)]
    etcd_prefix: String,
    /// A node's id (its certificate's common name); repeat for each.
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// A gateway's certificate common name; repeat for each.
    #[arg(long = "gateway")]
    gateways: Vec<String>,
}

#[derive(clap::Args, Clone)]
struct GatewayArgs {
    /// etcd endpoints (comma-separated), e.g. http://127.0.0.1:2379.
    #[arg(long, env = "AGENTENV_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    #[command(flatten)]
    tls: EtcdTlsArgs,
    /// Address to listen on.
    #[arg(long, env = "AGENTENV_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// State folder holding the API keys (`server/api_key`, `server/keys.json`): the same key files as
    /// every node's.
    #[arg(long, env = "AGENTENV_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Key prefix of the cluster in etcd.
    #[arg(long, default_value = agentenv_cluster::schema::DEFAULT_PREFIX)]
    etcd_prefix: String,
    /// Control-plane requests per second of each key at this gateway (0: unlimited).
    #[arg(long, default_value_t = agentenv_server::ratelimit::DEFAULT_RATE_LIMIT.per_second)]
    rate_limit: f64,
    /// CA (PEM) of the nodes' certificates: nodes are reached over HTTPS only, each certificate
    /// checked against the node id of its record; plain-HTTP nodes are refused.
    #[arg(long, env = "AGENTENV_NODE_CA")]
    node_ca: Option<PathBuf>,
    /// This gateway's client certificate for nodes (PEM, of the CA nodes take with `--gateway-ca`,
    /// naming `gateway.agentenv.internal`): the gateway then asserts each request's tenant instead
    /// of forwarding keys, and nodes need no API key of the operator's.
    #[arg(long, env = "AGENTENV_CLIENT_CERT", requires_all = ["client_key", "node_ca"])]
    client_cert: Option<PathBuf>,
    /// The `--client-cert` certificate's private key (PEM).
    #[arg(long, env = "AGENTENV_CLIENT_KEY", requires = "client_cert")]
    client_key: Option<PathBuf>,
    /// E2B's sandbox domain, as the nodes' `--sandbox-domain`: requests for `<port>-<sandbox id>.<domain>`
    /// go to that port of that sandbox.
    #[arg(long, env = "AGENTENV_SANDBOX_DOMAIN", value_parser = parse_sandbox_domain)]
    sandbox_domain: Option<String>,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum LazyArg {
    /// Imported template disks stay in the chunk store, served over NBD.
    Auto,
    /// Imported template disks are copied here whole.
    Off,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum NetArg {
    /// On where the host allows it (root, nftables, iproute2), else off with the reason logged.
    Auto,
    /// On, or the server does not start.
    On,
    /// Sandboxes get no network; creates that ask for the internet fail with 400.
    Off,
}

#[derive(Clone, Copy, ValueEnum)]
enum AccelArg {
    Auto,
    Kvm,
    Tcg,
}

#[derive(clap::Args, Clone)]
struct ServeArgs {
    /// Address to listen on (loopback by default; the API key is the only protection).
    #[arg(long, env = "AGENTENV_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// State folder (API key, sandbox records, runtime templates and VMs).
    #[arg(long, env = "AGENTENV_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Accelerator: auto uses KVM only where a probe guest boots, else TCG.
    #[arg(long, value_enum, default_value = "auto")]
    accel: AccelArg,
    /// The agentenv-guest binary for template builds.
    #[arg(long, env = "AGENTENV_GUEST_BIN")]
    guest_bin: Option<PathBuf>,
    /// Largest accepted data-plane request body (file upload) in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_UPLOAD_BYTES)]
    max_upload_bytes: u64,
    /// E2B's sandbox domain (`E2B_DOMAIN` of clients): answers name it, so the SDK's `get_host(port)` is
    /// `<port>-<sandbox id>.<domain>`, and requests for such a host reach that port of that sandbox.
    /// Needs a wildcard DNS name `*.<domain>` for this server (a port, `host:port`, when it listens
    /// elsewhere than 443/80).
    #[arg(long, env = "AGENTENV_SANDBOX_DOMAIN", value_parser = parse_sandbox_domain)]
    sandbox_domain: Option<String>,
    /// Most running sandboxes at once (429 beyond).
    #[arg(long)]
    max_running: Option<usize>,
    /// Most paused sandboxes at once (429 beyond; auto-pause then kills).
    #[arg(long)]
    max_paused: Option<usize>,
    /// Most memory of running sandboxes together, MiB (429 beyond).
    #[arg(long)]
    max_memory_mb: Option<u64>,
    /// Most disk all snapshots on this node occupy together, GiB: past it, new snapshots are refused
    /// (507). Unset: no budget.
    #[arg(long, env = "AGENTENV_MAX_STORED_GB")]
    max_stored_gb: Option<u64>,
    /// Control-plane requests per second of the API key (0: unlimited); bursts of twice as many.
    #[arg(long, default_value_t = agentenv_server::ratelimit::DEFAULT_RATE_LIMIT.per_second)]
    rate_limit: f64,
    /// Paused sandboxes are deleted this many seconds after they were paused.
    #[arg(long, default_value_t = agentenv_server::sandboxes::DEFAULT_PAUSED_RETENTION.as_secs())]
    paused_retention_s: u64,
    /// Folder for guest RAM files (e.g. /dev/shm/agentenv: faster, lost on reboot).
    #[arg(long, env = "AGENTENV_RAM_DIR")]
    ram_dir: Option<PathBuf>,
    /// S3-compatible endpoint of a bucket that keeps every snapshot's chunks (credentials from
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY). Servers sharing the bucket restore each other's snapshots.
    #[arg(long, env = "AGENTENV_S3_ENDPOINT", requires = "s3_bucket")]
    s3_endpoint: Option<String>,
    /// Bucket for `--s3-endpoint`.
    #[arg(long, env = "AGENTENV_S3_BUCKET", requires = "s3_endpoint")]
    s3_bucket: Option<String>,
    /// Key prefix inside the bucket.
    #[arg(long, env = "AGENTENV_S3_PREFIX", default_value = "")]
    s3_prefix: String,
    /// Region of the bucket.
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    s3_region: String,
    /// Disks of templates imported from the bucket: `auto` serves them block by block from the chunk
    /// store over NBD (a node starts an image it does not hold whole; the chunk cache keeps its bound),
    /// `off` copies each whole disk here first. With a bucket and `auto`, the default template is also
    /// published to the bucket for other servers.
    #[arg(long, env = "AGENTENV_LAZY_DISKS", value_enum, default_value = "auto")]
    lazy_disks: LazyArg,
    /// First uid QEMU processes run as, one uid per VM, when the server runs as root (`off` or 0:
    /// QEMU runs as the server's user). The VMs' group is this id too (the kvm group under KVM).
    #[arg(long, env = "AGENTENV_QEMU_UID_BASE", default_value = "1000000", value_parser = parse_uid_base)]
    qemu_uid_base: UidBase,
    /// Number of uids from `--qemu-uid-base` (at most this many VMs run at once).
    #[arg(long, default_value_t = agentenv_runtime::vmm::uid::DEFAULT_UID_COUNT)]
    qemu_uid_count: u32,
    /// Sandbox networking: a namespace, tap and nftables rules per sandbox, NAT to the uplink.
    #[arg(long, value_enum, default_value = "auto")]
    network: NetArg,
    /// Interface sandbox traffic leaves by (default: that of the host's default route).
    #[arg(long)]
    net_uplink: Option<String>,
    /// Resolver the sandboxes' DNS queries go to, `ip` or `ip:port` (repeatable; default: the host's).
    #[arg(long, value_parser = parse_resolver)]
    net_dns: Vec<SocketAddr>,
    /// Most concurrent connections a sandbox opens (0: no limit).
    #[arg(long, default_value_t = 1024)]
    net_max_connections: u32,
    /// An internal range (loopback, private, link-local, CGNAT; CIDR, repeatable or comma-separated)
    /// that `fromImage` pulls, their redirects and token realms may reach; by default none.
    #[arg(long, env = "AGENTENV_REGISTRY_ALLOW", value_delimiter = ',')]
    registry_allow: Vec<String>,
    /// A private range sandboxes may reach (CIDR; repeatable or comma-separated). By default they
    /// reach no RFC 1918 or CGNAT address and nothing on the uplink's own networks.
    #[arg(long, value_delimiter = ',')]
    net_allow_private: Vec<String>,
    /// Bandwidth of a sandbox each way, Mbit/s (0: no limit).
    #[arg(long, default_value_t = 0)]
    net_bandwidth_mbit: u64,
    /// Network slots kept ready for creates.
    #[arg(long, default_value_t = 4)]
    net_warm: usize,
    /// VMs kept restored and stopped per recently used template or snapshot, so that a create only
    /// continues one (0: every create restores). Each holds a QEMU process and its RAM copy.
    #[arg(long, env = "AGENTENV_WARM_VMS", default_value_t = 2)]
    warm_vms: usize,
    /// Most warm VMs per template or snapshot while its creates come in bursts (the largest burst of the
    /// last 5 minutes sets the pool's size, between --warm-vms and this).
    #[arg(long, env = "AGENTENV_WARM_VMS_MAX", default_value_t = 8)]
    warm_vms_max: usize,
    /// Most warm VMs of all templates and snapshots together; the least recently used ones' VMs are
    /// stopped first to stay within it (0: none are kept).
    #[arg(long, env = "AGENTENV_MAX_WARM_VMS", default_value_t = agentenv_runtime::config::DEFAULT_MAX_WARM_VMS)]
    max_warm_vms: usize,
    /// Seconds without a create after which a template or snapshot keeps no warm VM.
    #[arg(long, default_value_t = agentenv_runtime::config::DEFAULT_WARM_IDLE.as_secs())]
    warm_idle_s: u64,
    /// Seconds a paused sandbox's QEMU stays, stopped, so that a resume only continues it (0: it
    /// exits at once; the pause is committed to disk either way).
    #[arg(long, default_value_t = 30)]
    keep_paused_s: u64,
    /// Size cap in MiB of each QEMU's TCG translation cache (`-accel tcg,tb-size=N`; ignored under KVM).
    /// 0: QEMU's own default (1 GiB in QEMU 7.2). Unset: the runtime's default.
    #[arg(long, env = "AGENTENV_TCG_TB_MIB")]
    tcg_tb_mib: Option<u32>,
    /// Let the host's KSM merge identical pages of the VMs (guest RAM and QEMU's own memory): denser
    /// forks where `/sys/kernel/mm/ksm/run` is 1. Off by default: merged pages across tenants are a
    /// timing side channel, so guest RAM is then marked unmergeable.
    #[arg(long, env = "AGENTENV_MEM_MERGE")]
    mem_merge: bool,
    /// Join the cluster whose state is in this etcd (comma-separated endpoints): register with a lease
    /// and keep the node's record fresh. Needs `--advertise`.
    #[arg(
        long,
        env = "AGENTENV_JOIN",
        value_delimiter = ',',
        requires = "advertise"
    )]
    join: Vec<String>,
    /// URL gateways reach this server at (with `--join`): `https://` with `--tls-cert`.
    #[arg(long, env = "AGENTENV_ADVERTISE")]
    advertise: Option<String>,
    /// Serve HTTPS with this certificate (PEM; for a cluster node, one of the cluster's CA naming the
    /// node id as DNS name, checked by gateways with `--node-ca`).
    #[arg(long, env = "AGENTENV_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The `--tls-cert` certificate's private key (PEM).
    #[arg(long, env = "AGENTENV_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA (PEM) of the gateways' client certificates (with `--tls-cert`): a connection whose
    /// certificate of this CA names `gateway.agentenv.internal` acts for the tenant its gateway
    /// asserts, so gateways forward no API keys.
    #[arg(long, env = "AGENTENV_GATEWAY_CA", requires = "tls_cert")]
    gateway_ca: Option<PathBuf>,
    /// Key prefix of the cluster in etcd (with `--join`).
    #[arg(long, default_value = agentenv_cluster::schema::DEFAULT_PREFIX)]
    etcd_prefix: String,
    #[command(flatten)]
    etcd_tls: EtcdTlsArgs,
    /// This node's id in the cluster (with `--join`; over TLS, its certificate's common name); kept in
    /// the state folder. A random one is made and kept when none is given.
    #[arg(long, env = "AGENTENV_NODE_ID")]
    node_id: Option<String>,
    /// Lease TTL of the node's record, seconds: a node that stops refreshing leaves after this long.
    #[arg(long, default_value_t = agentenv_cluster::node::DEFAULT_TTL.as_secs())]
    join_ttl_s: u64,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn parse_resolver(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| {
            s.parse::<std::net::Ipv4Addr>()
                .map(|ip| SocketAddr::from((ip, 53)))
        })
        .map_err(|_| format!("{s:?} is not an IPv4 address or ip:port"))
}

/// `--qemu-uid-base`: the first uid, or `None` for `off`/`0`.
#[derive(Debug, Clone, Copy)]
struct UidBase(Option<u32>);

/// `off` or `0`: no per-VM uids; else the first uid (room for the count is checked at start).
fn parse_uid_base(s: &str) -> Result<UidBase, String> {
    match s {
        "off" | "0" => Ok(UidBase(None)),
        _ => s
            .parse::<u32>()
            .map(|b| UidBase(Some(b)))
            .map_err(|e| format!("{s:?}: {e} (a uid, or off)")),
    }
}

fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("agentenv");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".local/state/agentenv")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Openapi) => {
            println!("{}", openapi::document_json());
            Ok(())
        }
        Some(Command::Serve(args)) => serve(*args).await,
        Some(Command::Gateway(args)) => gateway(args).await,
        Some(Command::EtcdAuth(args)) => etcd_auth(args).await,
        Some(Command::Keys { state_dir, command }) => {
            // `agentenv --state-dir DIR keys ...` names the server's folder too: honour it.
            let dir = match (state_dir, cli.serve.state_dir) {
                (Some(a), Some(b)) if a != b => anyhow::bail!(
                    "two state folders given: {} and {}",
                    a.display(),
                    b.display()
                ),
                (a, b) => a.or(b).unwrap_or_else(default_state_dir),
            };
            manage_keys(&dir, command)
        }
        None => serve(cli.serve).await,
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let format = if args.log_json {
        k3_common::telemetry::LogFormat::Json
    } else {
        k3_common::telemetry::LogFormat::Text
    };
    k3_common::telemetry::init_with("info", format);
    raise_open_file_limit();
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let (api_key, fresh) = keys::load_or_create_api_key(&state_dir)?;
    let key_path = state_dir.join("server/api_key");
    if fresh {
        println!(
            "New API key (shown once; stored with mode 0600 in {}):\n  {api_key}",
            key_path.display()
        );
    } else {
        println!("API key: stored in {}", key_path.display());
    }

    let mut cfg = agentenv_runtime::RuntimeConfig::new(state_dir.join("runtime"));
    cfg.accel = match args.accel {
        AccelArg::Auto => agentenv_runtime::Accel::Auto,
        AccelArg::Kvm => agentenv_runtime::Accel::Kvm,
        AccelArg::Tcg => agentenv_runtime::Accel::Tcg,
    };
    cfg.guest_bin = args.guest_bin;
    cfg.ram_dir = args.ram_dir;
    cfg.warm_vms = args.warm_vms;
    cfg.warm_vms_max = args.warm_vms_max;
    cfg.max_warm_vms = args.max_warm_vms;
    cfg.warm_idle = std::time::Duration::from_secs(args.warm_idle_s);
    cfg.lazy_disks = match args.lazy_disks {
        LazyArg::Auto => agentenv_runtime::LazyDiskMode::Auto,
        LazyArg::Off => agentenv_runtime::LazyDiskMode::Off,
    };
    cfg.keep_paused = std::time::Duration::from_secs(args.keep_paused_s);
    if let Some(mib) = args.tcg_tb_mib {
        cfg.tcg_tb_mib = (mib > 0).then_some(mib);
    }
    cfg.mem_merge = args.mem_merge;
    cfg.registry_allow = args
        .registry_allow
        .iter()
        .map(|s| {
            agentenv_oci::AllowedNet::parse(s).map_err(|e| anyhow::anyhow!("--registry-allow {e}"))
        })
        .collect::<anyhow::Result<_>>()?;
    if let (Some(endpoint), Some(bucket)) = (args.s3_endpoint, args.s3_bucket) {
        let env = |k: &str| std::env::var(k).with_context(|| format!("--s3-endpoint needs {k}"));
        let mut remote = agentenv_store::RemoteConfig::new(
            &endpoint,
            &bucket,
            &env("AWS_ACCESS_KEY_ID")?,
            &env("AWS_SECRET_ACCESS_KEY")?,
        )
        // Metadata in the bucket carries a MAC under the nodes' shared bucket key: S3 credentials
        // alone cannot forge a snapshot or template record. A state folder from before the bucket key
        // keeps the key its API key gave (records in the bucket stay readable).
        .with_meta_key(keys::load_or_create_bucket_key(&state_dir, || {
            if fresh {
                rand::random()
            } else {
                agentenv_store::meta_key_from_secret(api_key.as_bytes())
            }
        })?);
        remote.allow_http = endpoint.starts_with("http://");
        remote.region = args.s3_region;
        remote.prefix = args.s3_prefix;
        remote.timeout = std::time::Duration::from_secs(60);
        tracing::info!(endpoint = %remote.endpoint, bucket = %remote.bucket, "snapshot chunks kept in S3");
        let mut store = agentenv_store::StoreConfig::local(
            state_dir.join("runtime/chunks"),
            agentenv_runtime::config::DEFAULT_STORE_BYTES,
        )
        .with_remote(remote);
        store.chunk_size = agentenv_runtime::config::DEFAULT_CHUNK_BYTES;
        cfg.store = Some(store);
    }
    cfg.qemu_uids = match args.qemu_uid_base.0 {
        Some(base) => {
            anyhow::ensure!(
                args.qemu_uid_count > 0 && base.checked_add(args.qemu_uid_count).is_some(),
                "--qemu-uid-base {base} with --qemu-uid-count {} leaves the uid space",
                args.qemu_uid_count
            );
            Some(agentenv_runtime::vmm::uid::UidRange {
                base,
                count: args.qemu_uid_count,
                gid: base,
            })
        }
        None => None,
    };
    let hairpin_app = Arc::new(std::sync::OnceLock::new());
    let egress = agentenv_server::hairpin::proxy(
        &state_dir,
        args.sandbox_domain.as_deref(),
        hairpin_app.clone(),
    )?;
    cfg.network = (args.network != NetArg::Off).then(|| agentenv_runtime::net::NetConfig {
        uplink: args.net_uplink,
        dns_upstream: args.net_dns,
        limits: agentenv_runtime::net::NetLimits {
            max_connections: args.net_max_connections,
            bandwidth_bytes_per_s: args.net_bandwidth_mbit * 125_000,
        },
        warm: args.net_warm,
        required: args.network == NetArg::On,
        allow_private: args.net_allow_private,
        egress: Some(egress),
    });
    let cfg_has_bucket = cfg.store.as_ref().is_some_and(|s| s.remote.is_some());
    // Volumes in the same bucket, through a chunk store of their own (its own local cache).
    let volume_store = cfg.store.clone().filter(|_| cfg_has_bucket).map(|mut s| {
        s.dir = state_dir.join("volumes-chunks");
        s.max_local_bytes = 1 << 30;
        // Files start at chunk boundaries: their zero tails compress away.
        s.compression = agentenv_store::Compression::Zstd { level: 1 };
        s
    });
    let runtime = runtime_backend::open_with_default_template(cfg).await?;
    if let Some(why) = runtime.networking_off() {
        tracing::warn!(reason = why, "sandbox networking is off");
    }
    if cfg_has_bucket && args.lazy_disks == LazyArg::Auto {
        // Other servers sharing the bucket start it without building it (its disk lazily).
        let rt = runtime.clone();
        tokio::spawn(async move {
            if let Err(e) = rt.publish_template("base").await {
                tracing::warn!(error = %e, "publishing the default template failed");
            }
        });
    }
    let closer = runtime.clone();
    tracing::info!(
        accel = runtime_backend::accel_label(&runtime),
        "runtime ready"
    );

    let shared_store = cfg_has_bucket;
    let backend: Arc<dyn agentenv_server::backend::VmBackend> =
        Arc::new(agentenv_server::runtime_backend::RuntimeBackend(runtime));
    let mut state = AppState::open(
        backend,
        ServerConfig {
            state_dir: state_dir.clone(),
            api_key,
            max_upload_bytes: args.max_upload_bytes,
            lifecycle: agentenv_server::sandboxes::LifecycleConfig {
                paused_retention: std::time::Duration::from_secs(args.paused_retention_s),
                quota: agentenv_server::sandboxes::Quota {
                    max_running: args.max_running,
                    max_paused: args.max_paused,
                    max_memory_mb: args.max_memory_mb,
                    ..Default::default()
                },
                max_stored_gb: args.max_stored_gb,
                ..Default::default()
            },
            rate_limit: (args.rate_limit > 0.0).then_some(agentenv_server::ratelimit::RateLimit {
                per_second: args.rate_limit,
                burst: 2.0 * args.rate_limit,
            }),
        },
    )
    .await?;
    state.sandbox_domain = args.sandbox_domain.clone();
    let volumes = state.sandboxes.volumes().clone();
    if let Some(c) = volume_store {
        let store = agentenv_store::ChunkStore::open(c)
            .await
            .context("opening the volumes' chunk store")?;
        volumes.attach_bucket(Arc::new(store))?;
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(agentenv_cluster::node_tls::server_config(
            cert,
            key,
            args.gateway_ca.as_deref(),
        )?),
        _ => None,
    };
    if let Some(adv) = &args.advertise {
        let want = if tls.is_some() { "https://" } else { "http://" };
        anyhow::ensure!(
            adv.starts_with(want),
            "--advertise {adv}: must start with {want} (TLS is {})",
            if tls.is_some() { "on" } else { "off" }
        );
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    println!(
        "agentenv listening on {scheme}://{addr}  (E2B_API_URL = E2B_SANDBOX_URL = {scheme}://{addr})"
    );
    let registration = match (args.join.is_empty(), args.advertise) {
        (false, Some(advertise)) => {
            let ttl = std::time::Duration::from_secs(args.join_ttl_s.max(1));
            let join = agentenv_server::join::JoinConfig {
                etcd: args.join,
                tls: args.etcd_tls.tls()?,
                node_id: args.node_id,
                prefix: args.etcd_prefix,
                advertise,
                ttl,
                interval: ttl / 3,
                max_running: args.max_running,
                shared_store,
                reconcile_every: agentenv_server::join::RECONCILE_EVERY,
            };
            Some(agentenv_server::join::join(&state_dir, state.sandboxes.clone(), join).await?)
        }
        _ => None,
    };
    tracing::info!(%addr, "listening");
    // SIGTERM drains: no new connections, in-flight requests (and the lifecycle calls and record
    // writes under them) finish. Open Connect streams would hold the drain forever, so it has a deadline.
    let signalled = Arc::new(tokio::sync::Notify::new());
    let on_signal = signalled.clone();
    let drained = async move {
        shutdown().await;
        on_signal.notify_one();
    };
    let serve = async move {
        // Handlers see each connection (`ConnectInfo<Conn>`), to reset one whose answer was cut.
        let app = app::app(state);
        let _ = hairpin_app.set(app.clone());
        let app = app.into_make_service_with_connect_info::<agentenv_api::conn::Conn>();
        match tls {
            Some(cfg) => {
                let listener = agentenv_server::tls_listener::TlsListener::new(listener, cfg)?;
                axum::serve(listener, app)
                    .with_graceful_shutdown(drained)
                    .await
            }
            None => {
                axum::serve(agentenv_api::conn::Listener::new(listener), app)
                    .with_graceful_shutdown(drained)
                    .await
            }
        }
    };
    tokio::select! {
        res = serve => res?,
        () = async {
            signalled.notified().await;
            tokio::time::sleep(DRAIN_DEADLINE).await;
        } => tracing::warn!(deadline_s = DRAIN_DEADLINE.as_secs(), "drain deadline passed; closing open streams"),
    }
    if let Some(r) = registration {
        r.leave().await;
    }
    volumes.flush_all().await;
    closer.close().await;
    tracing::info!("stopped; sandboxes keep running and are recovered on the next start");
    Ok(())
}

async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let format = if args.log_json {
        k3_common::telemetry::LogFormat::Json
    } else {
        k3_common::telemetry::LogFormat::Text
    };
    k3_common::telemetry::init_with("info", format);
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let (api_key, fresh) = keys::load_or_create_api_key(&state_dir)?;
    if fresh {
        println!(
            "New API key (shown once; copy {} to every gateway's state folder, and to nodes only when gateways have no --client-cert):\n  {api_key}",
            state_dir.join("server/api_key").display()
        );
    }
    let rate_limit = (args.rate_limit > 0.0).then_some(agentenv_server::ratelimit::RateLimit {
        per_second: args.rate_limit,
        burst: 2.0 * args.rate_limit,
    });
    let ring = Arc::new(agentenv_server::tenants::KeyRing::open(
        &state_dir,
        api_key.clone(),
        Default::default(),
        rate_limit,
    ));
    let store = agentenv_cluster::ClusterStore::connect_with(
        &args.etcd,
        args.tls.tls()?.as_ref(),
        &args.etcd_prefix,
        agentenv_cluster::store::DEFAULT_DEADLINE,
    )
    .await
    .context("connecting to etcd")?;
    let client = args.client_cert.as_deref().zip(args.client_key.as_deref());
    let node_tls = args
        .node_ca
        .as_deref()
        .map(|ca| agentenv_cluster::node_tls::client_config(ca, client))
        .transpose()?;
    let mut gw = agentenv_server::gateway::Gateway::new(store, ring, api_key, node_tls);
    gw.sandbox_domain = args.sandbox_domain;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "agentenv gateway listening on http://{addr}  (E2B_API_URL = E2B_SANDBOX_URL = http://{addr})"
    );
    let app = agentenv_server::gateway::app(gw)
        .into_make_service_with_connect_info::<agentenv_api::conn::Conn>();
    axum::serve(agentenv_api::conn::Listener::new(listener), app)
        .with_graceful_shutdown(shutdown())
        .await?;
    Ok(())
}

async fn etcd_auth(args: EtcdAuthArgs) -> anyhow::Result<()> {
    let Some(tls) = args.tls.tls()? else {
        anyhow::bail!(
            "etcd-auth needs --etcd-ca, --etcd-cert and --etcd-key: etcd users are certificate names"
        );
    };
    let root = agentenv_cluster::ClusterStore::connect_with(
        &args.etcd,
        Some(&tls),
        &args.etcd_prefix,
        agentenv_cluster::store::DEFAULT_DEADLINE,
    )
    .await
    .context("connecting to etcd")?;
    let members = agentenv_cluster::auth::Members {
        nodes: args.nodes,
        gateways: args.gateways,
    };
    agentenv_cluster::auth::provision(&root, &members)
        .await
        .context("setting up etcd's users and roles")?;
    println!(
        "etcd auth on for {}: {} node(s), {} gateway(s)",
        args.etcd_prefix,
        members.nodes.len(),
        members.gateways.len()
    );
    Ok(())
}

/// Longest SIGTERM drain.
const DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

async fn shutdown() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down: draining in-flight requests");
}

/// Raises this process's open-file limit to its hard limit (guests' streams, sockets and disks each
/// hold descriptors; 1,024 is a common soft default), and says what it got.
fn raise_open_file_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid resource and a pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return;
        }
        let before = l.rlim_cur;
        l.rlim_cur = l.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &l) == 0 {
            tracing::info!(before, now = l.rlim_cur, "open-file limit raised");
        } else {
            tracing::warn!(limit = before, "could not raise the open-file limit");
        }
    }
}

/// `--sandbox-domain`: a DNS name, optionally with `:port`, as hosts name it.
fn parse_sandbox_domain(s: &str) -> Result<String, String> {
    let (name, port) = s.rsplit_once(':').map_or((s, None), |(n, p)| (n, Some(p)));
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    let port_ok = port.is_none_or(|p| {
        p.parse::<u16>().is_ok_and(|n| n > 0) && p.bytes().all(|b| b.is_ascii_digit())
    });
    if name_ok && port_ok {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(format!("{s:?}: not a domain name (optionally with :port)"))
    }
}
